"""The generic CPU backend (mhagen/backends.py): rules that read target attributes (lanes,
vector registers, caches, cores), never names, so x86 and aarch64 share them; the x86 and
ARM backends (schedules/cpu/x86_backend.py, schedules/arm/backend.py) add what is theirs."""
from __future__ import annotations

from mhagen.backends import Backend
from mhagen.schedules.cpu.attention import AttentionRule, padded_head_dim
from mhagen.schedules.cpu.decode import CacheAppendRule, DecodeRule
from mhagen.schedules.cpu.elementwise import ElementwiseRule, Fallback
from mhagen.schedules.cpu.matmul import MatmulRule, packed_blocking, packed_tile
from mhagen.schedules.cpu.rotary import RotaryRule
from mhagen.schedules.cpu.softmax import SoftmaxRule
from mhagen.schedules.x86.denormals import with_flush

ATTENTION, DECODE, GEMM = AttentionRule(), DecodeRule(), MatmulRule()
RULES = [ATTENTION, DECODE, CacheAppendRule(), RotaryRule(), GEMM, SoftmaxRule(),
         ElementwiseRule(), Fallback()]


class CpuBackend(Backend):
    """CPU targets: packed GEMMs in register tiles of the vector width, the flash-style
    attention and decode templates, float32 temporaries."""
    device = "cpu"
    rules, attention, decode, gemm_rule = RULES, ATTENTION, DECODE, GEMM
    symbolic = True
    cross_attention = True
    flushes_denormals = False

    def gemm_tile(self, pairs=False, on_amx=False) -> tuple:
        return packed_tile(self.target, pairs=pairs, on_amx=on_amx)

    def gemm_rows(self, rows, depth, cols, pairs=False, on_amx=False):
        return packed_blocking(self.target, rows, depth, cols, pairs=pairs, on_amx=on_amx)[2]

    def head_dim_padded(self, d: int) -> int:
        return padded_head_dim(d, self.target.lanes)

    def packs_rows(self, depth: int, half: bool = False) -> bool:
        """Half-precision rows are packed (converted to float32 once, by the copy, not on
        every tile step), and rows of A that lie 4 KiB apart or a multiple (depth 1024,
        2048): the rows of one register tile then share one set of the L1 (4 KiB per way),
        and copying A into row-tile panels first is faster, the copy included
        (benchmarks/PERFORMANCE.md, Schedule decisions)."""
        return half or depth * 4 % 4096 == 0

    def finalize(self, func):
        """The templates' parallel tasks: denormals flushed in each where the family does,
        else the task annotation dropped."""
        return with_flush(func, flush=self.flushes_denormals)

    def storage_casts(self, program) -> dict:
        """A half layer's float32 <-> storage conversions (schedules/casts.py), compiled
        beside its kernels, where module(x) converts a float32 x and answers in float32."""
        dtype = program.role("input")[0].dtype
        if dtype == "float32":
            return {}
        from mhagen.schedules.casts import storage_casts as casts
        return {name: func.with_attr("global_symbol", name)
                for name, func in casts(dtype).items()}
