"""The vectorisable float32 math the CPU templates use (schedules/x86/fast_math.py), compiled
for the host's generic LLVM target and checked against numpy in float64."""
import numpy as np
import pytest
import tvm
from tvm import te

from mhagen.schedules.x86.fast_math import exp, exp2, tanh


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
