"""The backend seam: everything a target family brings to the compiler, as one object bound
to one target (`Backend.for_target(target)`: build() makes it once and passes it to lower(),
compile_program() and schedule_kernel(); lower() and schedule_kernel() make it themselves
when called without one).

Lowering, compiling, tuning and the runtime are target-neutral; they ask the backend for the
target-specific parts:

  rules            schedule rules for TE stages, first match wins (dlight style)
  attention        the fused attention template rule, or None (the graph then stays unfused)
  decode           the attention template rule of decoding layers (a K/V cache), or None
                   (such layers then do not compile for the family)
  gemm_rule        the GEMM rule whose register-tile rows the autotuner samples first
  device           where kernels run and buffers live ("cpu", "cuda"): the runtime and the C API
  symbolic         whether its kernels take the call's batch and seq at run time (one build
                   for every length; mhagen.build(..., seq_len=None))
  cross_attention  whether its attention template takes cross-attention (K/V projected from
                   a second input, mhagen.mha(..., cross=True)) fused
  half_temps       qkv and att in a half layer's dtype (tensor-core GEMMs read them); else
                   float32, converted once by the QKV GEMM

and its methods (the base class answers for a family that has no such thing):

  gemm_tile(pairs, on_amx)   (rows, columns) of the packed GEMMs' register tile; weights are
                             laid out in panels of `columns` columns
  gemm_rows(rows, depth, cols, pairs, on_amx)
                             the rows a packed GEMM of rows x depth x cols runs over (padded
                             to whole register tiles where a partial one would cost more than
                             the padding, or where its rows are split over the cores)
  head_dim_padded(d)         the head width the attention template reads (each head padded)
  gemm_path(dtype, depth, tiles=True)
                             how a packed GEMM multiplies: "float32" (converting half values
                             on load), "pairs" (bfloat16 pairs of its depth in one instruction:
                             weights packed [N / nr, K / 2, nr, 2], A's rows likewise) or
                             "amx" (AMX tiles: weights as for pairs, A in 32 x 32 tiles);
                             tiles=False: not on AMX tiles (a decoding layer's few rows)
  attention_path(dtype, d)   how the attention of head_dim d multiplies: None (float32),
                             "pairs" or "amx"
  packs_rows(depth, half)    whether a GEMM copies its rows of A into row-tile panels first
  finalize(func)             what the family's templates need around a scheduled kernel
  verify(kernel, func)       raises ScheduleError when the schedule cannot run there
  compile_device(executable, mod, program)
                             the device code compiled at build time, or None
  storage_casts(program)     a half layer's float32 <-> storage conversion functions
  precision_path(dtype, ...) what a half-precision build does, in words (module.precision)

A family has a folder of schedules/ (installed as mhagen.schedules.<folder>: its tuned
records) and a module that defines BACKEND, its Backend subclass (the x86 backend lives with
the generic CPU rules it extends, schedules/cpu/x86_backend.py). The table below is all that
is known of a family without importing it (its records folder, its backend's module, its
device), so `import mhagen` and loading an artifact stay light.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from mhagen.dtypes import NATIVE_HALF, is_half, precision_text
from mhagen.errors import TargetError


@dataclass(frozen=True)
class Family:
    name: str
    folder: str        # schedules/<folder>: the family's own pieces, tuned records
    device: str
    backend: str       # the module whose BACKEND is the family's Backend class


FAMILIES = {"cpu-x86": Family("cpu-x86", "x86", "cpu", "mhagen.schedules.cpu.x86_backend"),
            "cpu-arm": Family("cpu-arm", "arm", "cpu", "mhagen.schedules.arm.backend"),
            "cuda": Family("cuda", "cuda", "cuda", "mhagen.schedules.cuda")}
FAMILY_OF_ARCH = {"x86_64": "cpu-x86", "aarch64": "cpu-arm"}   # presets that name none


def family_of(target) -> Family:
    name = target.backend_family
    if name not in FAMILIES:
        raise TargetError(f"no backend for target family {name!r} ({target.name}); mhagen "
                          f"has {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


class Backend:
    """A target family's compiler parts, bound to one target. Subclasses (one per family,
    FAMILIES' backend modules) set the class attributes and override the methods."""
    family = ""
    device = "cpu"
    rules: tuple = ()
    attention = None
    decode = None
    gemm_rule = None
    symbolic = False
    cross_attention = False
    half_temps = False

    def __init__(self, target):
        self.target = target

    @staticmethod
    def for_target(target) -> "Backend":
        """The backend of a target's family, bound to it (imports its schedules: TVM)."""
        family = family_of(target)
        return importlib.import_module(family.backend).BACKEND(target)

    def __repr__(self):
        return f"{type(self).__name__}({self.target.name})"

    def gemm_tile(self, pairs=False, on_amx=False) -> tuple:
        raise NotImplementedError

    def gemm_rows(self, rows, depth, cols, pairs=False, on_amx=False):
        raise NotImplementedError

    def head_dim_padded(self, d: int) -> int:
        raise NotImplementedError

    def gemm_path(self, dtype: str, depth: int, tiles: bool = True) -> str:
        return "float32"

    def attention_path(self, dtype: str, d: int) -> str | None:
        return None

    def packs_rows(self, depth: int, half: bool = False) -> bool:
        return False

    def finalize(self, func):
        return func

    def verify(self, kernel, func) -> None:
        return None

    def compile_device(self, executable, mod, program):
        return None

    def storage_casts(self, program) -> dict:
        return {}

    def precision_path(self, dtype: str, paired=(), attention=None, tiles=()) -> str | None:
        """What a half-precision build does, in words (None: float32); paired, attention,
        tiles: as mhagen.dtypes.precision_text takes them."""
        if not is_half(dtype):
            return None
        return precision_text(dtype, self.half_load(dtype), self.unused_half_note(dtype),
                              paired, attention, tiles)

    def half_load(self, dtype: str) -> str:
        """How a half value is converted to float32 where it is loaded (the x86 words; the
        ARM backend has its own, a GPU text is still to write)."""
        return {"float16": "vcvtph2ps, F16C", "bfloat16": "a 16-bit shift"}[dtype]

    def unused_half_note(self, dtype: str) -> str:
        """The target's native half-precision arithmetic that the build does not use."""
        have = [f for f in NATIVE_HALF[dtype] if f in (self.target.features or ())]
        return f"; {have[0]} is present but not used yet" if have else ""
