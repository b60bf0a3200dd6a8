"""Row softmax: parallel over rows; max, exp, sum and normalise computed per row in cache."""
from dataclasses import dataclass

from mhagen.schedules.x86 import denormals
from mhagen.schedules.cpu.elementwise import fitting_vector


@dataclass(frozen=True)
class SoftmaxConfig:
    rows_per_task: int
    """rows handled by one parallel task (amortises the thread pool for short rows)."""


class SoftmaxRule:
    name = "softmax"

    def applies(self, stage, target):
        return stage.pattern == "softmax"

    def default_config(self, workload, target):
        # whole tasks only: rows per task divides the rows (a guarded row loop that LLVM
        # vectorises when a column loop of extent 1 vanishes gave wrong results: seq 1, and
        # cross-attention over one key with 3 queries)
        rows = workload.batch * workload.rows
        per_task = fitting_vector(4 if workload.cols < 256 else 1, rows)
        while rows % per_task:
            per_task //= 2
        return SoftmaxConfig(rows_per_task=per_task)

    def apply(self, sch, stage, cfg, plan):
        mx, safe, e, total, inv, p = (sch.get_sblock(b) for b in stage.blocks)
        b, i, j = sch.get_loops(p)
        rows = sch.fuse(b, i)
        outer, inner = sch.split(rows, [None, cfg.rows_per_task])
        sch.parallel(outer)
        sch.annotate(outer, denormals.TASK, 1)   # x86: each task flushes denormals
        for blk in (inv, total, e, safe, mx):
            sch.compute_at(blk, inner)
        sch.vectorize(sch.get_loops(p)[-1])
        # compute_at drops a column loop of extent 1 (one key): then exp's last loop is the
        # row loop, whose body holds the reductions; vectorising it gave wrong rows
        e_loops = sch.get_loops(e)
        if len(e_loops) > 2:
            sch.vectorize(e_loops[-1])
        return []
