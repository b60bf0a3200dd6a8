"""TE kernels on CUDA (the fused path's GEMMs, every stage of the unfused path): TVM's dlight
GPU rules, tried in order on the whole kernel; the first that applies schedules it.

dlight's Matmul normalises the packed GEMMs' access pattern (weights in column panels
w[n // nr, k, n % nr], output panels) by itself: shared-memory tiles of A and B, a register
tile per thread and the bias epilogue in the write-back, one kernel launch. The unfused path
(one PrimFunc of many stages) falls through to Fallback: one launch per stage, every spatial
loop bound to threads (correct and slow; the fused path is the one that matters).
"""
from __future__ import annotations

from tvm.s_tir import dlight

from mhagen.errors import ScheduleError
from mhagen.schedules import Decision
from mhagen.schedules.tvmscript import import_tensor_intrinsics


class DlightKernelRule:
    name = "dlight"

    def __init__(self):
        self.rules = [dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                      dlight.gpu.GeneralReduction(), dlight.gpu.Fallback()]

    def applies(self, stage, target):
        return not stage.pattern.endswith("_template")

    def default_config(self, workload, target):
        return None

    def schedule_whole(self, kernel, target):
        import_tensor_intrinsics()   # dlight's tensor-core Matmul would import them slowly
        tvm_target = target.tvm
        with tvm_target:
            for rule in self.rules:
                sch = rule.apply(kernel.prim_func, tvm_target, False)
                if sch is None:
                    continue
                name = f"dlight.{type(rule).__name__}"
                func = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                return func, [Decision(kernel.name, stage.name, self.name,
                                       {"rule": name, "pattern": stage.pattern})
                              for stage in kernel.stages]
        raise ScheduleError(f"kernel {kernel.name}: no dlight GPU rule applies (not even "
                            "Fallback)")
