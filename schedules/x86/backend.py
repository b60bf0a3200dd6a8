"""x86 schedule rules (AVX-512 / AVX2 through the target's vector width), first match wins,
and the cpu-x86 backend (mhagen/backends.py)."""
from mhagen.backends import Backend
from mhagen.schedules.x86.amx import amx_tiles, with_task_config
from mhagen.schedules.cpu.attention import AttentionRule, padded_head_dim
from mhagen.schedules.x86.bf16_dot import bf16_pairs
from mhagen.schedules.cpu.decode import CacheAppendRule, DecodeRule
from mhagen.schedules.x86.denormals import with_flush
from mhagen.schedules.cpu.elementwise import ElementwiseRule, Fallback
from mhagen.schedules.cpu.matmul import MatmulRule, packed_blocking, packed_tile
from mhagen.schedules.cpu.rotary import RotaryRule
from mhagen.schedules.cpu.softmax import SoftmaxRule

ATTENTION, DECODE, GEMM = AttentionRule(), DecodeRule(), MatmulRule()
RULES = [ATTENTION, DECODE, CacheAppendRule(), RotaryRule(), GEMM, SoftmaxRule(),
         ElementwiseRule(), Fallback()]


def cpu_backend(family: str) -> Backend:
    """A CPU backend over these rules: they read target attributes (lanes, registers,
    caches, cores), never names, so x86 and aarch64 share them."""
    return Backend(family=family, device="cpu", rules=RULES, attention=ATTENTION,
                   gemm_tile=packed_tile,
                   gemm_rows=lambda target, rows, depth, cols, pairs=False, on_amx=False:
                       packed_blocking(target, rows, depth, cols, pairs=pairs, on_amx=on_amx)[2],
                   head_dim_padded=lambda d, target: padded_head_dim(d, target.lanes),
                   gemm_rule=GEMM, decode=DECODE, symbolic=True, cross=True,
                   gemm_packs_rows=rows_alias_in_l1, gemm_pairs=bf16_pairs,
                   gemm_amx=amx_tiles,
                   finalize=lambda func: with_flush(with_task_config(func),
                                                    flush=family == "cpu-x86"))


def rows_alias_in_l1(target, depth) -> bool:
    """A GEMM's rows of A lie 4 KiB apart or a multiple (depth 1024, 2048): the rows of one
    register tile then share one set of the L1 (4 KiB per way), and the GEMM copies A into
    row-tile panels first (faster, the copy included: benchmarks/PERFORMANCE.md, Schedule
    decisions)."""
    return depth * 4 % 4096 == 0


BACKEND = cpu_backend("cpu-x86")
