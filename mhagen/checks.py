"""Argument checks shared by every entry point (leaf module: imports only mhagen.errors)."""
from __future__ import annotations

from mhagen.errors import GraphError


def positive_int(name: str, value, error=GraphError) -> int:
    """value if it is a positive int (not a bool); else `error` saying so."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name}={value!r} must be a positive integer")
    return value
