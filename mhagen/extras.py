"""Optional extras' dependencies, the `tune` extra (pip install 'mhagen[tune]'): building, loading
and running modules need none of them, so a plain install leaves them out."""
from __future__ import annotations

import importlib.util

from mhagen.errors import MhagenError

# module -> what needs it; the extra also holds tornado, for TVM's RPC tracker (a server)
TUNING_MODULES = {"xgboost": "MetaSchedule's cost model"}
INSTALL_HINT = "pip install 'mhagen[tune]'"


class TuningDependencyError(MhagenError, ImportError):
    """A package tuning needs is not installed."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # ValueError: sys.modules holds None for it
        return False


def require_tuning_dependencies() -> None:
    """Raise TuningDependencyError naming the missing packages and how to install them."""
    missing = [f"{name} ({why})" for name, why in TUNING_MODULES.items()
               if not _installed(name)]
    if missing:
        raise TuningDependencyError(f"tuning needs {', '.join(missing)}, not installed "
                                    f"here; install the tuning extra: {INSTALL_HINT}")
