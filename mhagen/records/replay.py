"""Replaying a tuning record's MetaSchedule trace on a kernel (TVM side of the records)."""
from __future__ import annotations

import json
import warnings

from mhagen.tolerances import max_error, tolerance
from mhagen.records.database import TuningWarning, stale_default, user_database_path
from mhagen.version import __version__


def kernel_hash(prim_func) -> str:
    """Structural hash of an unscheduled kernel: a record made for another kernel is stale."""
    import tvm_ffi
    return f"{tvm_ffi.structural_hash(prim_func) & 0xFFFFFFFFFFFFFFFF:016x}"


def versions() -> dict:
    import tvm
    return {"tvm": tvm.__version__, "mhagen": __version__}


# Attributes per instruction kind of the traces mhagen's searches write (TVM 0.27): a
# different count is a damaged record. Kinds not listed are checked by TVM alone.
TRACE_ATTRS = {"Annotate": 1, "CacheRead": 3, "CacheWrite": 2, "ComputeAt": 2,
               "ComputeInline": 0, "DecomposeReduction": 0, "EnterPostproc": 0, "Fuse": 1,
               "GetChildBlocks": 0, "GetConsumers": 0, "GetLoops": 0, "GetProducers": 0,
               "GetSBlock": 2, "Parallel": 0, "Reorder": 0, "ReverseComputeAt": 2,
               "ReverseComputeInline": 0, "SampleCategorical": 2, "SampleComputeLocation": 0,
               "SamplePerfectTile": 2, "SetScope": 2, "Split": 2, "Unannotate": 1,
               "Unroll": 0, "Vectorize": 0}


def trace_problem(trace) -> str | None:
    """What is structurally wrong with a trace's JSON ([instructions, decisions]), or None.
    TVM's replay trusts these: a decision's instruction index out of range, a sampled
    factor of 0 or a categorical index past its candidates, or an instruction's count of
    attributes changed, crashed the process (heap corruption, SIGSEGV, SIGFPE) in 6 of 600
    randomly edited records."""
    if not (isinstance(trace, list) and len(trace) == 2 and all(isinstance(t, list)
                                                                for t in trace)):
        return "not [instructions, decisions]"
    insts, decisions = trace
    defined = set()

    def known(value):
        if isinstance(value, list):
            return all(known(v) for v in value)
        if isinstance(value, str):
            return value == "None" or value.startswith('"') or value in defined
        return value is None or isinstance(value, (int, float))

    for i, inst in enumerate(insts):
        if not (isinstance(inst, list) and len(inst) == 4 and isinstance(inst[0], str)
                and all(isinstance(part, list) for part in inst[1:])):
            return f"instruction {i} is not [kind, inputs, attributes, outputs]"
        kind, inputs, attrs, outputs = inst
        if kind in TRACE_ATTRS and len(attrs) != TRACE_ATTRS[kind]:
            return f"instruction {i} ({kind}) has {len(attrs)} attributes, not {TRACE_ATTRS[kind]}"
        if not known(inputs):
            return f"instruction {i} ({kind}) uses a variable no earlier instruction defines"
        if not all(isinstance(o, str) and o not in defined for o in outputs) or \
                len(set(outputs)) != len(outputs):
            return f"instruction {i} ({kind}) redefines a variable"
        defined.update(outputs)
        if kind == "SampleCategorical" and not (
                len(attrs[0]) == len(attrs[1]) >= 1 and all(isinstance(a, list) for a in attrs)):
            return f"instruction {i} (SampleCategorical): candidates and probabilities differ"
    if not any(inst[0] == "EnterPostproc" for inst in insts):
        # every schedule MetaSchedule measures went through its postprocessors, whose
        # first instruction this is: a trace without it was cut short
        return "it has no EnterPostproc instruction (every measured trace has one): cut short"
    seen = set()
    for d in decisions:
        if not (isinstance(d, list) and len(d) == 2 and type(d[0]) is int
                and 0 <= d[0] < len(insts) and d[0] not in seen):
            return f"decision {d!r} names no instruction of the trace (or one twice)"
        seen.add(d[0])
        kind, value = insts[d[0]][0], d[1]
        if kind == "SampleCategorical":
            if not (type(value) is int and 0 <= value < len(insts[d[0]][2][0])):
                return f"decision {d!r}: no such candidate"
        elif kind in ("SamplePerfectTile", "SamplePartitionedTile"):
            if not (isinstance(value, list) and value
                    and all(type(v) is int and v >= 1 for v in value)):
                return f"decision {d!r}: tile factors must be positive integers"
        elif kind == "SampleComputeLocation":
            if not (type(value) is int and value >= -2):
                return f"decision {d!r}: no such location"
        else:
            return f"decision {d!r} is for a {kind}, which samples nothing"
    return None


def refuse_record(kernel, why, stacklevel=4):
    warnings.warn(f"tuning record for kernel {kernel.name!r} not used: {why}; using the "
                  "default schedule (re-run `mhagen tune` to refresh it)", TuningWarning,
                  stacklevel=stacklevel)


def apply_trace(kernel, record, default):
    """A Schedule of `kernel` with the record's trace applied, or None (with a warning).
    default: the rules' configs of today's default schedule (schedules.default_configs),
    which the record must have been measured against. A damaged trace is refused even when
    it still replays: one cut to its first instructions replays to an unscheduled kernel
    that computes the right output. Records written by mhagen tune carry the trace's length
    and the scheduled kernel's structural hash (trace_fields); older ones are accepted as
    before, their traces checked by trace_problem (a cut one lacks its EnterPostproc)."""
    import tvm
    from tvm import s_tir
    from tvm.s_tir.schedule import Trace

    def refuse(why):
        refuse_record(kernel, why, stacklevel=5)
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
        shaped = isinstance(trace, list) and len(trace) == 2 and all(
            isinstance(part, list) for part in trace)   # [instructions, decisions]
        if shaped and record.get("trace_instructions", len(trace[0])) != len(trace[0]):
            return refuse(f"its trace is damaged: it has {len(trace[0])} instructions, "
                          f"{record['trace_instructions']} were measured")
        problem = trace_problem(trace)
        if problem is not None:
            return refuse(f"its trace is damaged: {problem}")
        sch = s_tir.Schedule(tvm.IRModule({"main": kernel.prim_func}))
        Trace.apply_json_to_schedule(trace, sch)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this record
        return refuse(f"its trace does not apply ({type(err).__name__}: "
                      f"{str(err).splitlines()[-1][:200] if str(err) else ''})")
    if "schedule_hash" in record and record["schedule_hash"] != kernel_hash(sch.mod["main"]):
        return refuse("its trace is damaged: it replays to another schedule than the one "
                      "measured (structural hash of the scheduled kernel differs)")
    return sch


def trace_fields(scheduled_func, trace) -> dict:
    """What a trace record carries to tell its trace was damaged since it was measured: the
    trace's instruction count and the structural hash of the kernel it scheduled
    (apply_trace compares both; records written before them lack them and get only the
    structural checks of trace_problem)."""
    return {"trace_instructions": len(trace[0]), "schedule_hash": kernel_hash(scheduled_func)}


def replay_differs(default_func, traced_func, target) -> str | None:
    """Why a replayed trace's kernel computes something other than the default schedule's
    on the same random inputs (the check `mhagen tune` makes before it keeps a schedule), or
    None. A structurally sound trace with its decisions edited can still replay: one Split
    whose two loops were swapped gave wrong outputs, silently. Not checked (None) where this
    machine cannot run the target's code: a board's records tuned over RPC."""
    if target.device != "cpu" or target.cannot_run() is not None:
        return None
    key = json.dumps([kernel_hash(default_func), kernel_hash(traced_func), str(target.tvm),
                      versions()])
    if key in _passed_checks():
        return None
    outs = local_outputs([default_func, traced_func], target.tvm)
    why = "it does not build here" if outs is None else outputs_differ(*outs)
    if why is None:
        _remember_check(key)
    return why


def _checks_file():
    """Replay checks passed on this machine, one per line (beside the user's records): a
    build using trace records compiles each kernel's default beside it for the check (two
    records on the default layer: 1.01 s a build instead of 0.53 s, Zen 4), once per
    (default kernel, replayed kernel, target, versions)."""
    return user_database_path("replay-checks").with_suffix(".txt")


def _passed_checks() -> set:
    try:
        return set(_checks_file().read_text().splitlines())
    except OSError:
        return set()


def _remember_check(key: str, keep: int = 4096) -> None:
    path = _checks_file()
    try:
        lines = _passed_checks()
        path.parent.mkdir(parents=True, exist_ok=True)
        if len(lines) >= keep:     # start over rather than grow without end
            path.write_text("")
        with path.open("a") as f:
            f.write(key + "\n")
    except OSError:               # a read-only cache: check again next time
        pass


def local_outputs(funcs, tvm_target, fixed=None):
    """The last argument of each PrimFunc after one call here on the same arguments
    (prepared_calls), or None when one does not build."""
    calls = prepared_calls(funcs, tvm_target, fixed)
    return None if any(c is None for c in calls) else [c[1][-1].numpy() for c in calls]


def outputs_differ(want, got) -> str | None:
    """Why `got` (a schedule's output) is not `want` (the default's) within the tolerance
    table, or is not finite; None when they agree."""
    import numpy as np
    err, tol = max_error(got, want), tolerance(want)
    if not np.all(np.isfinite(got)) or err > tol:
        return f"its output differs from the default schedule's (max error {err:.2e} > {tol:.1e})"
    return None


def random_arguments(func, fixed, seed):
    """The numpy arguments of one call of PrimFunc `func`: the `fixed` arrays ({index:
    array}), random floats from `seed` (the same for every function of one check), zeros for
    integers."""
    import numpy as np
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    rng = np.random.default_rng(seed)
    fixed = {int(k): v for k, v in (fixed or {}).items()}
    args = []
    for i, info in enumerate(ArgInfo.from_prim_func(func)):
        shape, dtype = [int(s) for s in info.shape], str(info.dtype)
        if i in fixed:
            args.append(np.ascontiguousarray(fixed[i]))
        elif "float" in dtype:
            args.append(rng.standard_normal(shape).astype(dtype))
        else:
            args.append(np.zeros(shape, dtype))
    return args


def prepared_calls(funcs, target, fixed=None, seed=0):
    """Each PrimFunc compiled here for `target` with its arguments (random_arguments;
    `fixed`: one dict for all, or a list of dicts), called once: [(function, arguments)],
    None where it does not build. The replay check and the tuning search's result check
    run these."""
    import tvm
    per_func = fixed if isinstance(fixed, list) else [fixed] * len(funcs)
    calls = []
    for f, fixed in zip(funcs, per_func):
        try:
            ex = tvm.compile(tvm.IRModule({"main": f}), target=target)
        except Exception:  # noqa: BLE001 - a candidate that does not build is not timed
            calls.append(None)
            continue
        args = [tvm.runtime.tensor(a, tvm.cpu()) for a in random_arguments(f, fixed, seed)]
        func = ex["main"]
        func(*args)
        calls.append((func, args))
    return calls
