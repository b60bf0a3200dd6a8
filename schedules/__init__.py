"""Schedule rules, one folder per target (installed as mhagen.schedules).

A rule is a small class in the style of TVM's dlight rules:
  applies(stage, target) -> bool           does this rule handle that stage on that target?
  default_config(workload, target) -> cfg  a frozen dataclass, one docstring'd field per knob
  apply(sch, stage, cfg, plan) -> names    schedules a TE stage; returns the stages it absorbed
  build(workload, cfg, target) -> func     (template rules) writes the kernel's TIR itself
  schedule_whole(kernel, target) -> (func, decisions)
                                           (kernel rules, e.g. TVM's dlight on GPUs) schedules
                                           every stage of a TE kernel at once
Rules for a target are an ordered list; the first that applies wins and a Fallback always
applies (a kernel rule in the list takes every TE kernel). Rules read target attributes
(lanes, cores), never target names. Each family's Backend class (BACKEND of the module that
mhagen/backends.py's FAMILIES names) has a `finalize` and `verify` that see every scheduled
kernel.

The folders import one way only (tests/test_layers.py checks it):
  x86/   the x86-only instruction pieces -- AMX tiles, AVX-512 BF16 dot products, denormal
         flushing, the LLVM IR helpers they link -- and the cpu-x86 tuned records; it imports
         nothing of cpu/
  cpu/   the generic CPU rules and templates and the CPU backends (CpuBackend, X86Backend in
         x86_backend.py), which decide where the x86 pieces are used: cpu/ -> x86/
  arm/   ArmBackend and the cpu-arm records: arm/ -> cpu/
  cuda/  the cuda backend, its rules and device compile
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mhagen.records.replay import apply_trace, refuse_record, replay_differs


@dataclass
class Decision:
    """What was done to one stage: for inspection and, later, for tuning records."""
    kernel: str
    stage: str
    rule: str
    config: dict
    source: str = "default"   # "default", "tuned" (a record), or "stale" (record refused)


class Plan:
    """The stages of one kernel, looked up by block name while rules run, for a target."""

    def __init__(self, stages, target):
        self.stages = list(stages)
        self.target = target
        self.by_block = {b: s for s in self.stages for b in s.blocks}
        self.done: set = set()


def schedule_kernel(kernel, target, rules=None, record=None, backend=None):
    """A scheduled PrimFunc for `kernel` and its Decisions: a tuning record's trace when one
    is given and still fits the kernel, else the rules (TE stages) or the template.
    backend: the target's (target.backend() when not given)."""
    backend = backend or target.backend()
    func, decisions = _schedule(kernel, target, rules or backend.rules, record)
    func = backend.finalize(func)
    backend.verify(kernel, func)
    return func, decisions


def _schedule(kernel, target, rules, record):
    if kernel.template:
        stage = kernel.stages[0]
        rule = next(r for r in rules if r.applies(stage, target))
        cfg = kernel.config or rule.default_config(kernel.workload, target)
        func = rule.build(kernel.workload, cfg, target)
        source = "tuned" if kernel.tuned else "default"
        return func, [Decision(kernel.name, stage.name, rule.name, asdict(cfg), source)]
    func, decisions = _default_schedule(kernel, target, rules)
    if record is None or record.get("kind") != "trace":
        return func, decisions
    sch = apply_trace(kernel, record, default_configs(decisions))
    if sch is not None:
        wrong = replay_differs(func, sch.mod["main"], target)
        if wrong is None:
            return sch.mod["main"], [Decision(kernel.name, "*", "metaschedule",
                                              {"trials": record.get("trials")}, "tuned")]
        refuse_record(kernel, f"its trace replays, but {wrong}", stacklevel=3)
    return func, [replace(d, source="stale") for d in decisions]


def default_configs(decisions) -> list:
    """The rules' configs of a default schedule, as a trace record keeps them
    ("default_config": the default the trace was measured against)."""
    return [{"stage": d.stage, "rule": d.rule, "config": d.config} for d in decisions]


def _in_kernel(sch, stage) -> bool:
    """Whether the stage's blocks are in the PrimFunc: TVM drops the stages nothing reads
    (a head the concat leaves out; scores times a constant 0, which it folds to 0)."""
    from tvm.s_tir import ScheduleError
    try:
        for name in stage.blocks:
            sch.get_sblock(name)
    except ScheduleError:
        return False
    return True


def _default_schedule(kernel, target, rules):
    import tvm
    from tvm import s_tir
    whole = next((r for r in rules if hasattr(r, "schedule_whole")), None)
    if whole is not None:
        return whole.schedule_whole(kernel, target)
    sch = s_tir.Schedule(tvm.IRModule({"main": kernel.prim_func}))
    plan = Plan(kernel.stages, target)
    decisions = []
    for stage in plan.stages:
        if stage.name in plan.done or not _in_kernel(sch, stage):
            continue
        rule = next(r for r in rules if r.applies(stage, target))
        cfg = rule.default_config(stage.workload, target)
        absorbed = rule.apply(sch, stage, cfg, plan) or []
        plan.done.add(stage.name)
        plan.done.update(absorbed)
        decisions.append(Decision(kernel.name, stage.name, rule.name, asdict(cfg) if cfg else {}))
    return sch.mod["main"], decisions
