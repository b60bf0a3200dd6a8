"""The backend seam: everything a target family brings to the compiler, in one interface.

Lowering, compiling, tuning and the runtime are target-neutral; they ask the target's backend
(`backend_for(target)`) for the target-specific parts:

  rules            schedule rules for TE stages, first match wins (dlight style)
  attention        the fused attention template rule, or None (the graph then stays unfused)
  decode           the attention template rule of decoding layers (a K/V cache), or None
                   (such layers then do not compile for the family)
  gemm_tile        (rows, columns) of the packed GEMMs' register tile; weights are laid out
                   in panels of `columns` columns
  gemm_rows        the rows a packed GEMM of rows x depth x cols runs over (padded to whole
                   register tiles where a partial one would cost more than the padding, or
                   where its rows are split over the cores; the lowering sizes its
                   temporaries with it); pairs=True for a GEMM over bfloat16 pairs of its depth
  head_dim_padded  the head width the attention template reads (each head padded)
  gemm_rule        the GEMM rule whose register-tile rows the autotuner samples first
  device           where kernels run and buffers live ("cpu", "cuda"): the runtime and the C API
  verify           (optional) (kernel, scheduled PrimFunc, target) -> None; raises ScheduleError
                   when the schedule cannot run there (CUDA: a block left outside GPU threads
                   would compile to host code, or to nothing, without any error from TVM)
  symbolic         whether its kernels take the call's batch and seq at run time (one build
                   for every length; mhagen.build(..., seq_len=None))
  cross            whether its attention template takes cross-attention (K/V projected from a
                   second input, mhagen.mha(..., cross=True)) fused
  device_compile   (optional) (executable, target, scheduled IRModule, program) -> DeviceCode:
                   the device code compiled at build time (CUDA: nvcc's fatbin, its PTX,
                   ptxas' resource report and the launch table the C API runs)
  gemm_pairs       (optional) (target, dtype, depth) -> bool: the packed GEMM multiplies
                   pairs of its depth in one instruction (x86 AVX-512 BF16 vdpbf16ps):
                   weights packed [N / nr, K / 2, nr, 2], A's rows packed likewise
  gemm_amx         (optional) (target, dtype, depth, attention=False) -> bool: the packed
                   GEMM runs on AMX tiles (x86 AMX-BF16): weights as for pairs, A packed in
                   32 x 32 tiles; gemm_tile and gemm_rows take on_amx=True for it.
                   attention=True: the attention of that head_dim runs its products on them
  finalize         (optional) (scheduled PrimFunc) -> PrimFunc: what the family's templates
                   need around a scheduled kernel (x86: AMX's per-task tile configuration)

A family is a folder of schedules/ (installed as mhagen.schedules.<folder>) whose __init__
defines BACKEND. The table below is all that is known of a family without importing it
(its records folder, its device), so `import mhagen` and loading an artifact stay light.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from mhagen.errors import TargetError


@dataclass(frozen=True)
class Family:
    name: str
    folder: str        # schedules/<folder>: rules, templates, tuned records
    device: str


FAMILIES = {"cpu-x86": Family("cpu-x86", "x86", "cpu"),
            "cpu-arm": Family("cpu-arm", "arm", "cpu"),
            "cuda": Family("cuda", "cuda", "cuda")}
FAMILY_OF_ARCH = {"x86_64": "cpu-x86", "aarch64": "cpu-arm"}   # presets that name none


@dataclass(frozen=True)
class Backend:
    family: str
    device: str
    rules: list
    attention: object | None
    gemm_tile: Callable          # (target, pairs=False, on_amx=False) -> (rows, columns)
    gemm_rows: Callable          # (target, rows, depth, cols, pairs=, on_amx=) -> rows run
    head_dim_padded: Callable    # (head_dim, target) -> padded head width
    gemm_rule: object
    verify: Callable | None = None
    decode: object | None = None
    device_compile: Callable | None = None
    symbolic: bool = False       # its templates take the call's batch and seq (seq_len=None)
    cross: bool = False          # its attention template reads K/V from a second GEMM's output
    gemm_packs_rows: Callable | None = None   # (target, depth) -> copy A into row-tile panels
    gemm_pairs: Callable | None = None        # (target, dtype, depth) -> depth pairs (bf16)
    gemm_amx: Callable | None = None          # (target, dtype, depth[, attention]) -> AMX
    finalize: Callable | None = None          # (scheduled PrimFunc) -> PrimFunc
    half_temps: bool = False     # qkv and att in a half layer's dtype (tensor-core GEMMs read
    #                              them); else float32, converted once by the QKV GEMM


def family_of(target) -> Family:
    name = target.backend_family
    if name not in FAMILIES:
        raise TargetError(f"no backend for target family {name!r} ({target.name}); mhagen "
                          f"has {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def backend_for(target) -> Backend:
    """The backend of a target's family (imports its schedules: TVM)."""
    family = family_of(target)
    return importlib.import_module(f"mhagen.schedules.{family.folder}").BACKEND
