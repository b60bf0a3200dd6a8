"""aarch64 schedule rules (NEON, SVE): the same rule classes as x86, first match wins.

The CPU rules in schedules/x86 read only target attributes -- float32 lanes per vector
(vector_bits / 32), vector register count (vector_registers: 32 on aarch64), cores -- so they
serve aarch64 unchanged: 128-bit NEON gets 4-lane tiles, 256-bit SVE (Neoverse-V1) 8-lane
tiles that LLVM lowers to fixed-length SVE (see targets/arm-sve.json). Tuned records of
aarch64 CPU classes live in schedules/arm/records/.
"""
from mhagen.schedules.x86 import RULES, cpu_backend

BACKEND = cpu_backend("cpu-arm")
__all__ = ["BACKEND", "RULES"]
