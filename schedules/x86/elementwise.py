"""Injective stages (transposes, concat, unfused epilogues) and the Fallback that always applies."""
from dataclasses import dataclass


@dataclass(frozen=True)
class ElementwiseConfig:
    vector: int
    """innermost loop split and vectorised by this many elements (the vector lanes)."""


class ElementwiseRule:
    name = "elementwise"

    def applies(self, stage, target):
        return stage.pattern in ("elementwise", "epilogue")

    def default_config(self, workload, target):
        return ElementwiseConfig(vector=target.lanes)

    def apply(self, sch, stage, cfg, plan):
        for name in stage.blocks:
            blk = sch.get_sblock(name)
            loops = sch.get_loops(blk)
            outer = sch.fuse(*loops[:-1]) if len(loops) > 1 else None
            if outer is not None:
                sch.parallel(outer)
            sch.vectorize(sch.split(loops[-1], [None, cfg.vector])[1])
        return []


class Fallback:
    """Leaves the stage as lowered (correct, scalar): for patterns no rule knows yet."""
    name = "fallback"

    def applies(self, stage, target):
        return True

    def default_config(self, workload, target):
        return None

    def apply(self, sch, stage, cfg, plan):
        return []
