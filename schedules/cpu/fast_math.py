"""Vectorisable float32 math as TIR expressions (LLVM would call scalar expf otherwise)."""
import struct

import numpy as np
from tvm import tirx

from mhagen.lower.te import LOG2E

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


# 2^f: minimax polynomials (relative error, Lawson's iteration on float64, rounded to
# float32), highest power first. exp2: degree 5 on [-1/2, 1/2], 2.4e-7 in float32 arithmetic
# (the Taylor polynomial of degree 6 it replaced: ~2e-7, one multiply-add more). On [0, 1)
# for the AVX-512 helpers: degree 5, 1.7e-7 (float32 probabilities); degree 3, 7.5e-5
# (probabilities rounded to bfloat16, up to 2^-9, next).
EXP2_POLY = (0.001327647129073739, 0.009675541892647743, 0.05550713092088699,
             0.24022120237350464, 0.6931469440460205, 1.0000001192092896)
EXP2_POLY_UNIT = (0.0018775766948238015, 0.008989340625703335, 0.05582631751894951,
                  0.24015361070632935, 0.6931530833244324, 0.9999999403953552)
EXP2_POLY_UNIT_BF16 = (0.07802452147006989, 0.2260671705007553, 0.6958335041999817,
                       0.9999251961708069)


def exp2(t):
    """2^t for t <= 0, relative error ~2.4e-7; exactly 0 for t below -126.5 and for -inf (a
    masked score): t is clamped to -127, whose 2^n has exponent bits 0, so masked scores
    need no select of their own (AVX2: the masked softmax pass had spilled its constants)."""
    t = tirx.max(t, f32(-127.0))
    n = tirx.round(t)
    f = t - n
    p = f32(EXP2_POLY[0])
    for c in EXP2_POLY[1:]:
        p = p * f + f32(c)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * two_n


def _ir_float(v):
    """An LLVM IR float constant (a float written as the hex of its double)."""
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", float(np.float32(v))))[0]


def _ir_splat(v, lanes=16):
    return "<" + ", ".join([f"float {_ir_float(v)}"] * lanes) + ">"


def _exp2_16(name, poly):
    """LLVM IR of name(s, scale, sub) = 2^(s scale - sub) on 16 float32 lanes (AVX-512): t =
    s scale - sub (one multiply-add); f = t - floor(t) (vreduceps), 2^f by `poly`, times
    2^floor(t) (vscalefps): the polynomial's multiply-adds and 3 instructions, to exp2's 7
    (and its max with -127: vreduceps gives 0 for -inf, a masked score, and vscalefps 0 for
    2^-inf and below 2^-150, checked on the Intel Xeon)."""
    return "\n".join(
        [f"define <16 x float> @{name}(<16 x float> %s, <16 x float> %scale, "
         "<16 x float> %sub) {",
         "  %neg = fneg <16 x float> %sub",
         "  %x = call <16 x float> @llvm.fma.v16f32(<16 x float> %s, <16 x float> %scale, "
         "<16 x float> %neg)",
         # imm 9: keep 0 fraction bits, round down, no precision exception
         "  %f = call <16 x float> @llvm.x86.avx512.mask.reduce.ps.512(<16 x float> %x, i32 9, "
         "<16 x float> zeroinitializer, i16 -1, i32 4)",
         f"  %p0 = bitcast <16 x float> {_ir_splat(poly[0])} to <16 x float>"]
        + [f"  %p{i + 1} = call <16 x float> @llvm.fma.v16f32(<16 x float> %p{i}, "
           f"<16 x float> %f, <16 x float> {_ir_splat(c)})" for i, c in enumerate(poly[1:])]
        + [f"  %r = call <16 x float> @llvm.x86.avx512.mask.scalef.ps.512(<16 x float> "
           f"%p{len(poly) - 1}, <16 x float> %x, <16 x float> zeroinitializer, i16 -1, i32 4)",
           "  ret <16 x float> %r", "}", ""])


# the AVX-512 softmax's 2^t (LLVM IR linked into the kernel as bf16_dot's helpers are):
# EXP2_16 for float32 probabilities, EXP2_16_BF16 for those rounded to bfloat16 next
EXP2_16, EXP2_16_BF16 = "mhagen_exp2_16", "mhagen_exp2_16_bf16"
EXP2_HELPER = _exp2_16(EXP2_16, EXP2_POLY_UNIT) + _exp2_16(
    EXP2_16_BF16, EXP2_POLY_UNIT_BF16) + "\n".join([
        "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
        "declare <16 x float> @llvm.x86.avx512.mask.reduce.ps.512(<16 x float>, i32, "
        "<16 x float>, i16, i32)",
        "declare <16 x float> @llvm.x86.avx512.mask.scalef.ps.512(<16 x float>, <16 x float>, "
        "<16 x float>, i16, i32)", ""])


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
