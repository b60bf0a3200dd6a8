"""The one tolerance table: how far a compiled result may be from the float64 reference.

A result passes when max|actual - expected| <= atol + rtol * max|expected|, with the row of
the layer's dtype. Half-precision layers (mhagen/dtypes.py) compute in float32 from rounded
inputs and weights, and round their output: the reference takes the same rounded inputs, so
the error is the output's rounding (half an ulp: eps/2 relative) plus float32's. rtol is one
eps of the dtype (2x that), as FlashAttention's tests allow a small multiple of a
half-precision reference's own error; tests also check that multiple directly
(`within_half_reference`: error <= 2x that of
mhagen.reference.run_reference(..., rounded_to=dtype)).
A decoding layer with a half-precision K/V cache is judged by its cache dtype's row
(`judged_as`).
"""
import numpy as np

from mhagen.kvcache import cache_shape

TOLERANCES = {
    "float32": {"atol": 1e-5, "rtol": 2e-5},
    "float16": {"atol": 1e-4, "rtol": 2.0 ** -10},    # eps(float16) = 2^-10
    "bfloat16": {"atol": 1e-3, "rtol": 2.0 ** -7},    # eps(bfloat16) = 2^-7
}


def judged_as(graph) -> str:
    """The row a layer's results are judged by: its dtype, or its K/V cache's when that holds
    less. A half-precision cache stores rounded keys and values; rounding the float32 rows
    of a kernel and the float64 rows of the reference can land an ulp apart (2^-8 relative
    in bfloat16), and the output inherits that."""
    spec = cache_shape(graph)
    names = [graph.dtype] + ([spec["dtype"]] if spec else [])
    return max(names, key=lambda name: TOLERANCES[name]["rtol"])


def max_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))))


def tolerance(expected, dtype: str | None = None) -> float:
    """The table's tolerance for `expected` (a float64 reference of a layer of `dtype`;
    default: expected's own dtype when that is a half one, else float32)."""
    if dtype is None:
        name = str(np.asarray(expected).dtype)
        dtype = name if name in TOLERANCES else "float32"
    t = TOLERANCES[dtype]
    return t["atol"] + t["rtol"] * float(np.max(np.abs(expected)))


def within_half_reference(actual, expected, rounded, factor: float = 2.0,
                          atol: float = 1e-5) -> tuple[float, float]:
    """FlashAttention's criterion: (error of actual, factor * error of `rounded` + atol), both
    against the float64 `expected`; `rounded` is a half-precision reference's result
    (mhagen.reference.run_reference(..., rounded_to=dtype)). Passes when the first <= the second."""
    return max_error(actual, expected), factor * max_error(rounded, expected) + atol


def assert_close(actual, expected, dtype: str | None = None):
    """Raise AssertionError with the numbers when actual is outside the table's tolerance."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    assert np.all(np.isfinite(actual)), "result has NaN or inf"
    err, tol = max_error(actual, expected), tolerance(expected, dtype)
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g} ({dtype or 'float32'})"
