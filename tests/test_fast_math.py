"""The vectorisable float32 math the CPU templates use (schedules/cpu/fast_math.py), compiled
for the host's generic LLVM target and checked against numpy in float64."""
import numpy as np
import pytest
import tvm
from tvm import te

from mhagen.schedules.cpu.fast_math import EXP2_16, EXP2_16_BF16, EXP2_HELPER, exp, exp2, tanh


def _run(fn, x):
    a = te.placeholder(x.shape, "float32", name="a")
    b = te.compute(x.shape, lambda i: fn(a[i]), name="b")
    lib = tvm.compile(te.create_prim_func([a, b]), target="llvm")
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib(tvm.runtime.tensor(x), out)
    return out.numpy()


def test_exp2_is_exactly_zero_for_masked_scores():
    """The softmax passes rely on exp2(-inf) == 0 (no select per masked score)."""
    x = np.array([-np.inf, -1e30, -200.0, -127.0, -126.75], np.float32)
    y = _run(exp2, x)
    assert np.array_equal(y, np.zeros_like(x)), y


@pytest.mark.parametrize("fn, ref, lo, hi, rtol", [
    (exp2, np.exp2, -126.0, 0.0, 4e-7),
    (exp, np.exp, -87.0, 88.0, 4e-7),
    (tanh, np.tanh, -10.0, 10.0, 1e-6),
])
def test_accuracy_over_the_range(fn, ref, lo, hi, rtol):
    x = np.linspace(lo, hi, 100003, dtype=np.float32)
    y = _run(fn, x).astype(np.float64)
    want = ref(x.astype(np.float64))
    assert np.all(np.abs(y - want) <= rtol * np.abs(want) + 1e-38), \
        np.max(np.abs(y - want) / np.maximum(np.abs(want), 1e-38))


@pytest.mark.parametrize("name, rtol", [(EXP2_16, 3e-7), (EXP2_16_BF16, 1e-4)])
def test_the_avx512_softmax_helpers(name, rtol):
    """The AVX-512 softmax's 2^(s scale - sub) (LLVM IR helpers: vreduceps, a polynomial,
    vscalefps): accurate over the scores' range, exactly 0 for masked scores (-inf) and far
    below, for the x86-avx512 preset: run where it runs, else its assembly checked."""
    from mhagen.schedules.x86.bf16_dot import with_llvm_ir
    from mhagen.target import resolve
    from tvm.script import tirx as T

    scale, sub = 0.125 * 1.4426950408889634, 3.0
    n = 16 * 6251

    @T.prim_func
    def f(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n // 16):
            b[T.ramp(i * 16, 1, 16)] = T.call_pure_extern(
                "float32x16", name, a[T.ramp(i * 16, 1, 16)],
                T.broadcast(T.float32(scale), 16), T.broadcast(T.float32(sub), 16))

    target = resolve("x86-avx512")
    lib = tvm.compile(with_llvm_ir(f, EXP2_HELPER), target=target.tvm)
    asm = lib.mod.inspect_source("asm")
    assert "vreduceps" in asm and "vscalefps" in asm
    if not target.runs_here():
        return
    special = np.array([-np.inf, -1e30, -2000.0, -1300.0, 0.0, 8.0, 24.0, 23.9], np.float32)
    x = np.concatenate([special, np.linspace(-1200.0, 24.0, n - len(special),
                                             dtype=np.float32)])
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib(tvm.runtime.tensor(x), out)
    y = out.numpy().astype(np.float64)
    # the exponent as the helper's multiply-add rounds it (the float64 product of two floats
    # is exact): what is left is 2^t's own error
    t = (np.float32(scale) * x.astype(np.float64) - sub).astype(np.float32)
    want = np.exp2(t.astype(np.float64))
    assert np.array_equal(y[:4], np.zeros(4)), y[:4]
    normal = want > 2.0 ** -126    # denormal results are left to the task's flush
    assert np.all(np.abs(y - want)[normal] <= rtol * want[normal]), \
        np.max(np.abs(y - want)[normal] / want[normal])
