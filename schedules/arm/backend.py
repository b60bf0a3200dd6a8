"""The cpu-arm backend (mhagen/backends.py): the generic CPU rules (schedules/cpu/); its
half-precision loads convert with fcvtl (float16) and 16-bit shifts (bfloat16)."""
from __future__ import annotations

from mhagen.schedules.cpu.backend import RULES, CpuBackend


class ArmBackend(CpuBackend):
    family = "cpu-arm"

    def half_load(self, dtype: str) -> str:
        return "fcvtl" if dtype == "float16" else super().half_load(dtype)


BACKEND = ArmBackend
__all__ = ["BACKEND", "RULES", "ArmBackend"]
