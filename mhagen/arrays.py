"""Aligned numpy arrays: what the kernels assume of every buffer they are given."""
from __future__ import annotations

import math

import numpy as np

from mhagen.dtypes import numpy_dtype

ALIGNMENT = 64   # bytes: what TVM assumes of every buffer it is given (aligned vector stores)


def aligned_empty(shape, dtype="float32") -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = numpy_dtype(dtype)
    n = math.prod(shape) if isinstance(shape, tuple) else int(np.prod(shape))
    raw = np.empty(n + ALIGNMENT // dtype.itemsize, dtype)
    start = (-raw.ctypes.data % ALIGNMENT) // dtype.itemsize
    return raw[start:start + n].reshape(shape)


def aligned_zeros(shape, dtype="float32") -> np.ndarray:
    """aligned_empty, filled with zeros."""
    a = aligned_empty(shape, dtype)
    a[...] = 0
    return a


def is_aligned(a: np.ndarray) -> bool:
    """C-contiguous, writable and starting on a 64-byte boundary: usable without a copy."""
    return (a.flags.c_contiguous and a.flags.writeable
            and a.__array_interface__["data"][0] % ALIGNMENT == 0)
