"""Generated x86 code: no vector register spills in the multiply-add loops of either
class, and the LLVM IR register transposes."""

import numpy as np
import pytest

import mhagen
from mhagen.records.database import Tuning
from x86_helpers import PRESETS, spills_in_fma_loops, _asm_of


@pytest.mark.parametrize("preset", PRESETS)
def test_no_vector_register_spills(preset):
    for layer, seq in ((mhagen.mha(512, 8), 128),
                       (mhagen.mha(256, 4, kv_heads=2, causal=True), 97)):
        asm = _asm_of(layer, preset, seq)
        assert "vfmadd" in asm
        spills = spills_in_fma_loops(asm)
        assert not spills, f"{preset}: vector spills in multiply-add loops at {spills}"


def test_the_spill_check_sees_spills():
    """The check above can fail: a 8 x 16 S^T tile (16 accumulators) on 16 ymm registers
    spills, as the AVX-512-sized template did on AVX2."""
    from mhagen.schedules.cpu.attention import AttentionConfig

    class Forced:
        def lookup(self, key):
            if key["kernel"] != "attention":
                return None
            return {"kind": "config", "config": AttentionConfig(64, 128, 8, 16, 8, 16).__dict__}
    asm = _asm_of(mhagen.mha(512, 8), "x86-avx2", 128, tuning=Tuning([Forced()]))
    assert spills_in_fma_loops(asm)


@pytest.mark.parametrize("n, word, offset", [(8, "i32", "i64"), (16, "i32", "i64"),
                                             (16, "i32", "i32"), (32, "i16", "i64")])
def test_the_register_transposes_transpose(n, word, offset):
    """The LLVM IR transposes (transpose.py: the float32 Q^T copy of both presets, AMX's
    O^T and V^T): dst = src^T between rows of other strides and at offsets, the words
    around the block untouched. Generic IR: runs on every x86 host."""
    import tvm
    from tvm.script import tirx as T
    from mhagen.schedules.x86.bf16_dot import with_llvm_ir
    from mhagen.schedules.x86.transpose import transpose

    dtype = {"i32": "int32", "i16": "int16"}[word]
    # rows and offsets of even words: 4-byte aligned, as the helpers' loads declare
    sstride, dstride, soff, doff = n + 4, n + 6, 2 * (n + 4) + 2, n + 6 + 4
    name = f"test_transpose_{n}_{word}_{offset}"
    cast = (lambda v: T.int64(v)) if offset == "i64" else (lambda v: T.int32(v))

    @T.prim_func
    def f(src: T.Buffer((soff + n * sstride,), dtype),
          dst: T.Buffer((doff + n * dstride,), dtype)):
        T.evaluate(T.call_extern("int32", name, dst.data, cast(doff),
                                 T.int64(dstride * src.dtype.bits // 8), src.data,
                                 cast(soff), T.int64(sstride * src.dtype.bits // 8)))

    lib = tvm.compile(with_llvm_ir(f, transpose(name, n, word, offset)), target="llvm")
    rng = np.random.default_rng(n)
    src = rng.integers(-30000, 30000, soff + n * sstride).astype(dtype)
    dst = rng.integers(-30000, 30000, doff + n * dstride).astype(dtype)
    out = tvm.runtime.tensor(dst.copy())
    lib(tvm.runtime.tensor(src), out)
    got = out.numpy()
    block = lambda a, off, stride: a[off:off + n * stride].reshape(n, stride)[:, :n]
    np.testing.assert_array_equal(block(got, doff, dstride), block(src, soff, sstride).T)
    outside = np.ones(got.shape, bool)
    block(outside, doff, dstride)[...] = False
    np.testing.assert_array_equal(got[outside], dst[outside])
