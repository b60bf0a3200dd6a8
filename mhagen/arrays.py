"""Aligned numpy arrays: what the kernels assume of every buffer they are given."""
from __future__ import annotations

import ctypes
import math

import numpy as np

from mhagen.dtypes import numpy_dtype

ALIGNMENT = 64   # bytes: what TVM assumes of every buffer it is given (aligned vector stores)


def aligned_empty(shape, dtype="float32") -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = numpy_dtype(dtype)
    n = math.prod(shape) if isinstance(shape, tuple) else int(np.prod(shape))
    raw = np.empty(n + ALIGNMENT // dtype.itemsize, dtype)
    start = (-address(raw) % ALIGNMENT) // dtype.itemsize
    return raw[start:start + n].reshape(shape)


def aligned_zeros(shape, dtype="float32") -> np.ndarray:
    """aligned_empty, filled with zeros."""
    a = aligned_empty(shape, dtype)
    a[...] = 0
    return a


def is_aligned(a: np.ndarray) -> bool:
    """C-contiguous, writable and starting on a 64-byte boundary: usable without a copy."""
    return a.flags.c_contiguous and a.flags.writeable and address(a) % ALIGNMENT == 0


def address(a: np.ndarray) -> int:
    """Where a C-contiguous, writable array's data starts. Through the buffer protocol:
    0.3 us, where a.ctypes.data and a.__array_interface__ build objects for ~1 us (a
    module call asks of x, the cache and the output)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):   # empty, or a dtype the buffer protocol lacks
        return a.__array_interface__["data"][0]
