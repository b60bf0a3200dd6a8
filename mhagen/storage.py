"""A module's dtype handling: x and a context into the layer's storage dtype, the answer out.

A half-precision layer (mhagen/dtypes.py) takes float32 too: rounded on the way in, its answer
then float32. On CPUs its library holds conversions (schedules/casts.py: mhagen_to_storage,
mhagen_from_storage) that do both faster than numpy; where it has none (a float32 layer, a GPU
build, an artifact saved before December 6) numpy's conversions (dtypes.to_storage) serve.
"""
from __future__ import annotations

import numpy as np

from mhagen import runtime
from mhagen.dtypes import FROM_STORAGE, TO_STORAGE, name_of, numpy_dtype, overflow_limit, \
    to_storage
from mhagen.staging import deliver

_BFLOAT16 = numpy_dtype("bfloat16")


class StorageCasts:
    """The conversions between the dtypes a module takes and its storage dtype `dtype`,
    with the library's conversion functions looked up once."""

    def __init__(self, library, dtype):
        self.library, self.dtype = library, dtype
        self.casts = {}     # conversions by name (None: not in the library)

    @property
    def takes(self) -> tuple:
        """The dtypes x and a context are taken in as they are (others: converted to the
        first, float32)."""
        return (np.dtype(np.float32), self.dtype)

    def cast(self, name):
        """The library's conversion `name` (schedules/casts.py), None where it has none."""
        if name not in self.casts:
            try:
                self.casts[name] = self.library.get_function(name)
            except AttributeError:
                self.casts[name] = None
        return self.casts[name]

    def convert(self, name, src, dst):
        """src into dst (same size, C-contiguous) by the library's conversion `name`;
        bfloat16 goes as its uint16 bits."""
        bits = [a.view(np.uint16) if a.dtype == _BFLOAT16 else a for a in (src, dst)]
        self.cast(name)(*(runtime.tensor(a.reshape(-1)) for a in bits), src.size)

    def stored(self, name, a):
        """x or a context (of the dtypes `takes`) in the storage dtype: as given, or a
        float32 array rounded."""
        if a.dtype == self.dtype:
            return a
        return to_storage(name, a, name_of(self.dtype))

    def deferred(self, name, a):
        """x or a context for the kernels: a half layer's float32 array as it is, when the
        library converts it on the way in (Staging.input_tensor) and every value fits the
        storage (else, and for NaNs, stored's check and rounding: same results, same
        errors)."""
        if a.dtype != np.float32 or self.dtype == np.float32 or self.cast(TO_STORAGE) is None:
            return self.stored(name, a)
        limit = overflow_limit(self.dtype)
        if not -limit < a.min() <= a.max() < limit:    # NaN compares false: checked there
            return self.stored(name, a)
        return np.ascontiguousarray(a)

    def deliver(self, result, target):
        """staging.deliver(), a half layer's float32 answer converted by the library where
        the kernels' output has no padded columns."""
        if (result.dtype != target.dtype and result.flags.c_contiguous
                and target.shape[-1] == result.shape[-1] and target.flags.c_contiguous
                and self.cast(FROM_STORAGE) is not None):
            self.convert(FROM_STORAGE, target, result)
            return result
        return deliver(result, target)
