"""Aligned numpy arrays: what the kernels assume of every buffer they are given."""
from __future__ import annotations

import ctypes
import math

import numpy as np

from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError

ALIGNMENT = 64   # bytes: what TVM assumes of every buffer it is given (aligned vector stores)


def aligned_empty(shape, dtype="float32", *, like: str = "numpy"):
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary: a
    module reads it in place. like="torch": a torch tensor over that memory
    (torch.from_numpy; bfloat16 through its int16 bits), for torch code that must never
    be copied (torch's own allocator aligns to 64 bytes too, but promises it nowhere)."""
    if like not in ("numpy", "torch"):
        raise InputError(f"like= takes 'numpy' or 'torch', got {like!r}")
    dtype = numpy_dtype(dtype)
    n = math.prod(shape) if isinstance(shape, tuple) else int(np.prod(shape))
    raw = np.empty(n + ALIGNMENT // dtype.itemsize, dtype)
    start = (-address(raw) % ALIGNMENT) // dtype.itemsize
    a = raw[start:start + n].reshape(shape)
    return a if like == "numpy" else as_torch(a)


def aligned_zeros(shape, dtype="float32", *, like: str = "numpy"):
    """aligned_empty, filled with zeros."""
    a = aligned_empty(shape, dtype, like=like)
    a[...] = 0
    return a


def as_torch(a: np.ndarray):
    """A torch tensor over a numpy array's memory (torch.from_numpy: no copy; bfloat16
    through its int16 bits); torch is imported here only."""
    import torch
    if a.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


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
