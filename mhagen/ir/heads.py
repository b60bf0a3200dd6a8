"""Grouped K/V heads (GQA/MQA): the one rule mapping query heads to K/V heads.

Query head h reads K/V head h // (heads // kv_heads); kv_heads divides heads.
"""
from __future__ import annotations

from mhagen.errors import GraphError


def kv_group(heads: int, kv_heads: int) -> int:
    """Query heads per K/V head; GraphError when kv_heads does not divide heads."""
    if kv_heads < 1 or heads % kv_heads:
        raise GraphError(f"kv_heads={kv_heads} must divide num_heads={heads}")
    return heads // kv_heads


def kv_head_of(h: int, heads: int, kv_heads: int) -> int:
    """The K/V head query head h reads."""
    return h // kv_group(heads, kv_heads)


def kv_head_map(heads: int, kv_heads: int) -> list:
    """[kv_head_of(h) for every query head h]."""
    group = kv_group(heads, kv_heads)
    return [h // group for h in range(heads)]
