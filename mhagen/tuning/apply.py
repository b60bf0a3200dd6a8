"""Replaying a tuning record's MetaSchedule trace on a kernel (TVM side of the records)."""
from __future__ import annotations

import json
import warnings

from mhagen.tuning.records import TuningWarning, stale_default
from mhagen.version import __version__


def kernel_hash(prim_func) -> str:
    """Structural hash of an unscheduled kernel: a record made for another kernel is stale."""
    import tvm_ffi
    return f"{tvm_ffi.structural_hash(prim_func) & 0xFFFFFFFFFFFFFFFF:016x}"


def versions() -> dict:
    import tvm
    return {"tvm": tvm.__version__, "mhagen": __version__}


def apply_trace(kernel, record, default):
    """A Schedule of `kernel` with the record's trace applied, or None (with a warning).
    default: the rules' configs of today's default schedule (schedules.default_configs),
    which the record must have been measured against."""
    import tvm
    from tvm import s_tir
    from tvm.s_tir.schedule import Trace

    def refuse(why):
        warnings.warn(f"tuning record for kernel {kernel.name!r} not used: {why}; using the "
                      "default schedule (re-run `mhagen tune` to refresh it)", TuningWarning,
                      stacklevel=4)
        return None

    if record.get("tvm") != versions()["tvm"]:
        return refuse(f"made with TVM {record.get('tvm')}, this is {versions()['tvm']}")
    if record.get("kernel_hash") != kernel_hash(kernel.prim_func):
        return refuse("the kernel changed since it was tuned (structural hash differs)")
    why = stale_default(record, default)
    if why is not None:
        return refuse(why)
    try:
        trace = json.loads(record["trace"]) if isinstance(record["trace"], str) else record["trace"]
        sch = s_tir.Schedule(tvm.IRModule({"main": kernel.prim_func}))
        Trace.apply_json_to_schedule(trace, sch)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this record
        return refuse(f"its trace does not apply ({type(err).__name__}: "
                      f"{str(err).splitlines()[-1][:200] if str(err) else ''})")
    return sch
