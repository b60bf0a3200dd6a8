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
    """2^t for t <= 0, relative error ~2e-7; exactly 0 for t below -126.5 and for -inf (a
    masked score): t is clamped to -127, whose 2^n has exponent bits 0, so masked scores
    need no select of their own (AVX2: the masked softmax pass had spilled its constants)."""
    t = tirx.max(t, f32(-127.0))
    n = tirx.round(t)
    f = t - n
    p = f32(_EXP2_TAYLOR[0])
    for c in _EXP2_TAYLOR[1:]:
        p = p * f + f32(c)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * two_n


# tanh(x) = x P(x^2) / Q(x^2) on x clamped to [-7.9053, 7.9053] (Eigen's fast tanh, also
# XLA's): relative error 3.5e-7 over the floats; x itself below 4e-4 in magnitude.
_TANH_NUM = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
             5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
             4.89352455891786e-03)
_TANH_DEN = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
             4.89352518554385e-03)
_TANH_CLAMP = 7.90531110763549805


def tanh(x):
    """tanh(x) as a vectorisable rational function (LLVM would call scalar tanhf)."""
    c = tirx.max(tirx.min(x, f32(_TANH_CLAMP)), f32(-_TANH_CLAMP))
    c2 = c * c
    p = f32(_TANH_NUM[0])
    for k in _TANH_NUM[1:]:
        p = p * c2 + f32(k)
    q = f32(_TANH_DEN[0])
    for k in _TANH_DEN[1:]:
        q = q * c2 + f32(k)
    return tirx.Select(tirx.abs(x) < f32(4e-4), x, c * p / q)


# what the attention templates pass to score_to_tir: vectorisable versions of its functions
SCORE_MATH = {"tanh": tanh, "exp": exp}
