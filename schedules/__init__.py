"""Schedule rules, one folder per target (installed as mhagen.schedules).

A rule is a small class in the style of TVM's dlight rules:
  applies(stage, target) -> bool         does this rule handle that stage on that target?
  default_config(stage, target) -> cfg   a frozen dataclass, one docstring'd field per knob
  apply(sch, stage, cfg, plan) -> names  schedules the stage; returns the stages it absorbed
Rules for a target are an ordered list; the first that applies wins and a Fallback always
applies. Rules read target attributes (lanes, cores), never target names.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Decision:
    """What was done to one stage: for inspection and, later, for tuning records."""
    stage: str
    rule: str
    config: dict


class Plan:
    """The stages of one lowered function, looked up by block name while rules run."""

    def __init__(self, stages):
        self.stages = list(stages)
        self.by_block = {b: s for s in self.stages for b in s.blocks}
        self.done: set = set()


def rules_for(target):
    if target.arch == "x86_64":
        from mhagen.schedules.x86 import RULES
        return RULES
    raise NotImplementedError(f"no schedule rules for {target.arch} yet")


def apply_rules(sch, stages, target, rules=None) -> list:
    """Schedule every stage with the first applicable rule; returns the Decisions."""
    rules = rules or rules_for(target)
    plan = Plan(stages)
    decisions = []
    for stage in plan.stages:
        if stage.name in plan.done:
            continue
        rule = next(r for r in rules if r.applies(stage, target))
        cfg = rule.default_config(stage, target)
        absorbed = rule.apply(sch, stage, cfg, plan) or []
        plan.done.add(stage.name)
        plan.done.update(absorbed)
        decisions.append(Decision(stage.name, rule.name, asdict(cfg) if cfg else {}))
    return decisions
