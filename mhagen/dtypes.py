"""Storage dtypes: what a layer's inputs, outputs and weights are kept in.

A layer's dtype (Graph.dtype, `mhagen.mha(..., dtype=)`) is its storage: float32, float16 or
bfloat16. Every kernel computes in float32: products accumulate in float32, the softmax runs
in float32, and the temporaries between kernels (qkv, att) are float32. Half-precision
values are converted to float32 where a kernel loads them and the output is rounded to the
layer's dtype where it is stored (the "convert on load" path: F16C's vcvtph2ps for float16
on x86, a 16-bit shift for bfloat16; aarch64's fcvtl). Half precision thus halves the
weights' and activations' memory and bandwidth. One native path: on x86 targets with
AVX-512 BF16, a bfloat16 layer's GEMMs multiply bfloat16 pairs with vdpbf16ps
(schedules/x86/bf16_dot.py; float32 accumulation, the attention output rounded to bfloat16
before the output projection), and so does the attention (Q K^T and P V on pairs, P rounded
to bfloat16; qkv held in bfloat16; the softmax in float32); with AMX-BF16 they run on AMX
tiles instead (schedules/x86/amx.py). AVX512-FP16 and NEON fp16/bf16 arithmetic are not
used; the build says which path was taken (the backend's `precision_path`).
A CPU half layer's library also holds float32 <-> storage conversions (TO_STORAGE,
FROM_STORAGE: schedules/casts.py) for the module's float32 inputs and answers.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from mhagen.errors import InputError

NUMPY = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
         "bfloat16": np.dtype(ml_dtypes.bfloat16)}
COMPUTE = "float32"


def numpy_dtype(name) -> np.dtype:
    """The numpy dtype of a storage dtype's name (bfloat16: ml_dtypes.bfloat16)."""
    if isinstance(name, np.dtype):
        return name
    if name in NUMPY:
        return NUMPY[name]
    return np.dtype(name)


def name_of(dtype) -> str:
    """The storage name of a numpy dtype, e.g. 'bfloat16'."""
    dtype = np.dtype(dtype)
    for name, d in NUMPY.items():
        if d == dtype:
            return name
    return str(dtype)


def is_float(dtype) -> bool:
    """A floating-point numpy dtype, bfloat16 included (numpy does not count it)."""
    d = np.dtype(dtype)
    return bool(np.issubdtype(d, np.floating)) or d == NUMPY["bfloat16"]


def is_half(name: str) -> bool:
    return name in ("float16", "bfloat16")


def to_storage(what: str, a, name: str) -> np.ndarray:
    """`a` in the storage dtype `name` (round to nearest even), refusing non-float arrays and
    finite values the dtype cannot hold (they would become inf)."""
    a = np.asarray(a)
    if not is_float(a.dtype):
        raise InputError(f"{what} has dtype {a.dtype}; pass a floating-point array "
                         f"({name}, or float32 to be rounded to {name})")
    with np.errstate(over="ignore"):
        rounded = a.astype(NUMPY[name], copy=False)
    if rounded is not a and not np.array_equal(np.isfinite(rounded), np.isfinite(a)):
        raise InputError(f"{what} has values beyond {name}'s range (largest finite "
                         f"{float(np.finfo(NUMPY[name]).max):.6g}); scale the input, or build "
                         "the layer in float32")
    return rounded


TO_STORAGE, FROM_STORAGE = "mhagen_to_storage", "mhagen_from_storage"
# the least float32 magnitude each storage rounds to inf (round to nearest even: the midpoint
# of its largest finite value and the next power of two)
_OVERFLOW = {"float16": 65520.0, "bfloat16": float(np.uint32(0x7F7F8000).view(np.float32))}


def overflow_limit(dtype) -> float:
    """Float32 values of this magnitude or more become inf in the storage dtype."""
    return _OVERFLOW[name_of(dtype)]


# native half-precision arithmetic a CPU may have (not used yet: the build says so)
NATIVE_HALF = {"float16": ("avx512fp16", "fullfp16"), "bfloat16": ("avx512bf16", "bf16")}


def precision_text(name: str, how: str, note: str = "", paired=(), attention=None,
                   tiles=()) -> str | None:
    """What a half-precision build does, in words (None: float32); the target's backend
    (precision_path) says how a half value is converted where it is loaded (`how`) and
    which native arithmetic it leaves unused (`note`).
    paired: the weights whose GEMMs multiply bfloat16 pairs (AVX-512 BF16 vdpbf16ps);
    attention: "pairs" (its Q K^T and P V multiply them too), "amx" (they run on AMX
    tiles), None (it converts on load); tiles: the weights whose GEMMs run on AMX tiles
    (AMX-BF16 tdpbf16ps)."""
    if not is_half(name):
        return None
    if not (paired or tiles or attention):
        return (f"{name} storage, converted to float32 on load ({how}); float32 FMAs, "
                f"accumulation and softmax; output rounded to {name}{note}")
    attention = {
        "pairs": "the attention's Q K^T and P V too (Q, K, V and P in bfloat16), its "
                 "softmax in float32",
        "amx": "the attention's Q K^T and P V on AMX tiles (Q, K, V and P in "
               "bfloat16), its softmax in float32",
        None: f"the attention converts to float32 on load ({how}): float32 FMAs and "
              "softmax"}[attention]
    gemms = [f"the GEMMs of {', '.join(names)} {what}" for names, what in (
        (tiles, "run on AMX tiles (AMX-BF16 tdpbf16ps)"),
        (paired, "multiply bfloat16 pairs (AVX-512 BF16 vdpbf16ps)")) if names] or [
        f"the GEMMs convert to float32 on load ({how}): float32 FMAs"]
    output = ("the attention output is rounded to bfloat16 before the output projection"
              if "w_o" in (*tiles, *paired) else "")
    return (f"{name} storage; {' and '.join(gemms)}, with float32 accumulation"
            f"{'; ' + output if output else ''}; {attention}; output rounded to {name}")
