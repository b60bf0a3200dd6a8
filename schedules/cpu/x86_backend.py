"""The cpu-x86 backend (mhagen/backends.py): the generic CPU rules (schedules/cpu/) with
x86's own parts from schedules/x86/: AMX tiles (amx.py), AVX-512 BF16 dot products
(bf16_dot.py) and denormals flushed in the templates' tasks (denormals.py). Its records are
in schedules/x86/records/ (the family's folder)."""
from __future__ import annotations

from mhagen.schedules.cpu.attention import AttentionRule
from mhagen.schedules.cpu.backend import RULES as CPU_RULES, CpuBackend
from mhagen.schedules.cpu.decode import DecodeRule
from mhagen.schedules.x86.amx import amx_tiles, with_task_config
from mhagen.schedules.x86.bf16_dot import bf16_pairs


class X86AttentionRule(AttentionRule):
    flush_denormals = True
    x86_helpers = True


class X86DecodeRule(DecodeRule):
    flush_denormals = True


ATTENTION, DECODE = X86AttentionRule(), X86DecodeRule()
RULES = [ATTENTION, DECODE] + CPU_RULES[2:]


class X86Backend(CpuBackend):
    family = "cpu-x86"
    rules, attention, decode = RULES, ATTENTION, DECODE
    flushes_denormals = True

    def gemm_path(self, dtype: str, depth: int, tiles: bool = True) -> str:
        """AMX tiles (AMX-BF16) where they take the depth, else bfloat16 pairs (AVX-512
        BF16 vdpbf16ps) where those pay, else float32; tiles=False: never AMX (a decoding
        layer's steps: few rows, padded to a 32-row tile)."""
        if tiles and amx_tiles(self.target, dtype, depth):
            return "amx"
        return "pairs" if bf16_pairs(self.target, dtype, depth) else "float32"

    def attention_path(self, dtype: str, d: int) -> str | None:
        """S^T = K Q^T and P V on AMX tiles where a head_dim of whole 32s takes them, else
        on bfloat16 pairs where a GEMM of that depth would take them."""
        if amx_tiles(self.target, dtype, d, attention=True):
            return "amx"
        return "pairs" if bf16_pairs(self.target, dtype, d) else None

    def finalize(self, func):
        """AMX's per-task tile configuration, then the denormal flush."""
        return super().finalize(with_task_config(func))

    def unused_half_note(self, dtype: str) -> str:
        features = self.target.features or ()
        if dtype == "bfloat16" and "avx512bf16" in features:
            note = ("; avx512bf16 is present but not used (bfloat16 pairs run only on CPUs "
                    "whose vdpbf16ps beats their float32 FMA, over even depths: "
                    "schedules/x86/bf16_dot.py)")
        else:
            note = super().unused_half_note(dtype)
        if dtype == "bfloat16" and "amx-bf16" in features:
            note += ("; amx-bf16 is present but not used here (AMX tiles take GEMMs whose "
                     "depth is a multiple of 32 from 64 and attentions whose head_dim is a "
                     "multiple of 32, outside decoding layers: schedules/x86/amx.py)")
        return note


BACKEND = X86Backend
