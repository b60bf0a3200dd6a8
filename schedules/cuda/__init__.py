"""The cuda backend (mhagen/backends.py): NVIDIA GPUs, compile-only for now.

  attention  a CUDA flash-style template (schedules/cuda/attention.py); float16 layers on
             tensor cores (schedules/cuda/attention_tc.py, WMMA)
  rotary     RoPE in place on qkv's Q/K columns, one block per token (schedules/cuda/rotary.py)
  GEMMs      TVM's dlight GPU rules on the whole TE kernel (schedules/cuda/dlight_rule.py);
             weights in panels of 64 columns (each a 256-byte row per k: coalesced loads),
             the QKV output in the same panels (a 64-wide head's row is 256 contiguous bytes)
  verify     every block bound to GPU threads (schedules/cuda/verify.py)
  device     nvcc -> PTX -> ptxas -> fatbin at build time (schedules/cuda/nvcc.py)
"""
from mhagen.backends import Backend
from mhagen.program import round_up
from mhagen.schedules.cuda.attention import CudaAttentionRule, padded_head_dim
from mhagen.schedules.cuda.dlight_rule import DlightKernelRule
from mhagen.schedules.cuda.nvcc import compile_device
from mhagen.schedules.cuda.rotary import CudaRotaryRule
from mhagen.schedules.cuda.verify import check_bound

PANEL = 64      # weight / qkv columns per panel
ROW_TILE = 64   # GEMM rows are padded to whole row tiles (dlight's block tiles divide it)

ATTENTION, GEMM = CudaAttentionRule(), DlightKernelRule()
RULES = [ATTENTION, CudaRotaryRule(), GEMM]


class CudaBackend(Backend):
    family = "cuda"
    device = "cuda"
    rules, attention, gemm_rule = RULES, ATTENTION, GEMM
    half_temps = True

    def gemm_tile(self, pairs=False, on_amx=False) -> tuple:
        return ROW_TILE, PANEL

    def gemm_rows(self, rows, depth, cols, pairs=False, on_amx=False):
        return round_up(rows, ROW_TILE)

    def head_dim_padded(self, d: int) -> int:
        return padded_head_dim(d)

    def verify(self, kernel, func) -> None:
        check_bound(kernel, func, self.target)

    def compile_device(self, executable, mod, program):
        return compile_device(executable, self.target, mod, program)


BACKEND = CudaBackend
