"""The one tolerance table: how far a compiled result may be from the float64 reference.

A result passes when max|actual - expected| <= atol + rtol * max|expected|.
"""
import numpy as np

TOLERANCES = {
    "float32": {"atol": 1e-5, "rtol": 2e-5},
}


def max_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))))


def tolerance(expected, dtype: str = "float32") -> float:
    t = TOLERANCES[dtype]
    return t["atol"] + t["rtol"] * float(np.max(np.abs(expected)))


def assert_close(actual, expected, dtype: str = "float32"):
    """Raise AssertionError with the numbers when actual is outside the table's tolerance."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    assert np.all(np.isfinite(actual)), "result has NaN or inf"
    err, tol = max_error(actual, expected), tolerance(expected, dtype)
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g} ({dtype})"
