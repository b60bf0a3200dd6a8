"""Vectorisable float32 math as TIR expressions (LLVM would call scalar expf otherwise)."""
import math

from tvm import tirx

from mhagen.lower.te import LN2, LOG2E

_LN2_HI = 0.693145751953125          # ln 2 split so n * _LN2_HI is exact (Cody-Waite)
_LN2_LO = 1.428606765330187e-06
_EXP_TAYLOR = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)


def f32(v):
    return tirx.const(v, "float32")


def exp(x):
    """e^x, relative error ~1e-7 for x in [-87, 88]; exactly 0 for x < -87 (and -inf).

    x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2; e^r by a degree-7 polynomial;
    2^n built in the exponent bits.
    """
    n = tirx.round(x * f32(LOG2E))
    r = x - n * f32(_LN2_HI) - n * f32(_LN2_LO)
    p = f32(_EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        p = p * r + f32(c)
    ni = tirx.Cast("int32", tirx.max(tirx.min(n, f32(127.0)), f32(-126.0)))
    two_n = tirx.reinterpret("float32", tirx.shift_left(ni + 127, 23))
    return tirx.Select(x < f32(-87.0), f32(0.0), p * two_n)


_EXP2_TAYLOR = tuple(LN2 ** k / math.factorial(k) for k in range(6, -1, -1))


def exp2(t):
    """2^t for t <= 0, relative error ~2e-7; t below -126 gives about 1e-38 (not 0): callers
    that need exact zeros (masked scores) select them explicitly."""
    t = tirx.max(t, f32(-126.0))
    n = tirx.round(t)
    f = t - n
    p = f32(_EXP2_TAYLOR[0])
    for c in _EXP2_TAYLOR[1:]:
        p = p * f + f32(c)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * two_n
