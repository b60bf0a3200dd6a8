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
            # a vector wider than the loop would compute lanes past its end (guarded lanes
            # of a too-wide vector wrote out of bounds: wrong results at seq 1 on AVX-512).
            # Stages marked scalar (the heads' concat: a Select whose vector form loads
            # both sides, past the end of one head's buffer) keep a scalar loop that LLVM
            # vectorises only where it is safe; wrong numbers at seq_len 1 otherwise.
            vector = fitting_vector(cfg.vector, int(sch.get(loops[-1]).extent))
            if getattr(stage.workload, "scalar", False):
                vector = 1
            if vector > 1:
                sch.vectorize(sch.split(loops[-1], [None, vector])[1])
        return []


def fitting_vector(lanes: int, extent: int) -> int:
    """lanes, or for a loop shorter than that the largest power of two within it."""
    vector = lanes
    while vector > 1 and vector > extent:
        vector //= 2
    return vector


class Fallback:
    """Leaves the stage as lowered (correct, scalar): for patterns no rule knows yet."""
    name = "fallback"

    def applies(self, stage, target):
        return True

    def default_config(self, workload, target):
        return None

    def apply(self, sch, stage, cfg, plan):
        return []
