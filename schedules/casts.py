"""Float32 <-> half-precision storage conversions compiled into a CPU half layer's library.

A half layer (float16, bfloat16 storage) also takes float32 x and then answers in float32
(mhagen/module.py). numpy and ml_dtypes convert on one core, and their range checks took
more passes, a cost next to a fast layer's time; these two functions convert at memory speed
(benchmarks/PERFORMANCE.md, Schedule decisions), in parallel chunks, vectorized:
    TO    (src float32[n], dst storage[n], n)   round to nearest even, as numpy / ml_dtypes
    FROM  (src storage[n], dst float32[n], n)   exact
bfloat16 is stored and passed as its uint16 bits: TVM's own float32 -> bfloat16 cast turned
some NaNs (small payloads) into inf or 0; here a NaN becomes the quiet NaN of its sign, as
ml_dtypes rounds it. float16 uses the target's conversion instruction (F16C, AVX-512, the
aarch64 fcvt), which quiets a signalling NaN where numpy keeps it signalling. Any alignment
(numpy's arrays start on 16 bytes): the buffers are declared with the element's alignment.
Values the storage cannot hold (they would round to inf) are refused by the caller before it
converts (Module._deferred, mhagen.dtypes.to_storage)."""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.dtypes import FROM_STORAGE as FROM, TO_STORAGE as TO
from mhagen.schedules.tvmscript import cheap_stack

CHUNK = 4096    # elements a parallel task converts (16 KiB of float32)
LANES = 16


def _storage(dtype: str) -> str:
    """The buffer dtype of the storage side: bfloat16 as its uint16 bits."""
    return "uint16" if dtype == "bfloat16" else dtype


def _to_bits(x):
    """float32 -> bfloat16 bits, round to nearest even; a NaN -> the quiet NaN of its sign."""
    u = T.reinterpret("uint32", x)
    rounded = (u + T.uint32(0x7FFF) + ((u >> T.uint32(16)) & T.uint32(1))) >> T.uint32(16)
    nan = ((u >> T.uint32(16)) & T.uint32(0x8000)) | T.uint32(0x7FC0)
    # NaN tested on the bits: LLVM folds x != x away (TVM compiles with fast-math flags)
    return T.Cast("uint16", T.Select((u & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000), nan,
                                     rounded))


def _from_bits(b):
    return T.reinterpret("float32", T.Cast("uint32", b) << T.uint32(16))


def storage_casts(dtype: str) -> dict:
    """{TO: PrimFunc, FROM: PrimFunc} for a half dtype ("float16", "bfloat16")."""
    store = _storage(dtype)
    to = _to_bits if dtype == "bfloat16" else (lambda x: T.Cast(dtype, x))
    back = _from_bits if dtype == "bfloat16" else (lambda x: T.Cast("float32", x))
    return {TO: _converter("float32", store, to), FROM: _converter(store, "float32", back)}


def _converter(src_dtype, dst_dtype, convert):
    with cheap_stack():
        @T.prim_func(s_tir=True)
        def func(src_h: T.handle, dst_h: T.handle, n: T.int64):
            T.func_attr({"tirx.noalias": True})
            src = T.match_buffer(src_h, (n,), src_dtype, align=2, offset_factor=1)
            dst = T.match_buffer(dst_h, (n,), dst_dtype, align=2, offset_factor=1)
            for c in T.parallel(n // CHUNK):
                for j in range(CHUNK // LANES):
                    for i in T.vectorized(LANES):
                        dst[c * CHUNK + j * LANES + i] = convert(src[c * CHUNK + j * LANES + i])
            for i in range(n % CHUNK):
                dst[n // CHUNK * CHUNK + i] = convert(src[n // CHUNK * CHUNK + i])
    return func
