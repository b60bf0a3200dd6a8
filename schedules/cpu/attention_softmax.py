"""The CPU attention template's online-softmax stage: a key block's scores into
probabilities, lane-wise over queries (no horizontal reduction).

softmax_macros   the stage's TVMScript macro for a kernel layout:
  online_softmax   P^T = 2^(S^T - m'), l = l alpha + sum P, alpha = 2^(m - m'), m = m':
                   on pairs and AMX tiles P^T straight into bfloat16 pairs of keys (EXP2_16_BF16
                   and PACK), on AVX-512 through EXP2_16, else exp2 lane by lane
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.schedules.x86.bf16_dot import PACK
from mhagen.schedules.cpu.fast_math import EXP2_16, EXP2_16_BF16, exp2


def softmax_macros(k):
    """online_softmax for layout k (KernelLayout)."""
    MQ, LN, QT_PAIRS, AVX512 = k.MQ, k.LN, k.QT_PAIRS, k.AVX512
    SOFTMAX_SCALE, neg_inf, zero = k.SOFTMAX_SCALE, k.neg_inf, k.zero

    @T.macro
    def online_softmax(n_rows, n_zipped, s_buf, m_buf, l_buf, m_new, alpha, vec, p32):
        # vec[0]: the subtracted max (0 for queries that saw no key yet), vec[1]: sum of P.
        # Pairs and AMX tiles: P^T straight into bfloat16 pairs of keys (p32; a row past the
        # last key is 0), 2^(s scale - m') on EXP2_16; float32 P is not stored (m' is scaled
        # here: LATE_SCALE).
        for io in range(MQ // LN):
            for ii in T.vectorized(LN):
                vec[0, ii] = T.Select(m_new[io * LN + ii] == neg_inf, zero,
                                      m_new[io * LN + ii] * SOFTMAX_SCALE)
                alpha[io * LN + ii] = exp2(m_buf[io * LN + ii] * SOFTMAX_SCALE - vec[0, ii])
                vec[1, ii] = zero
            if QT_PAIRS:
                for j2 in range(n_zipped):
                    for r in range(2):
                        vec[2 + r, T.ramp(0, 1, LN)] = T.call_pure_extern(
                            "float32x16", EXP2_16_BF16,
                            s_buf[2 * j2 + r, T.ramp(io * LN, 1, LN)],
                            T.broadcast(SOFTMAX_SCALE, LN), vec[0, T.ramp(0, 1, LN)])
                    vec[1, T.ramp(0, 1, LN)] = (vec[1, T.ramp(0, 1, LN)] + vec[2, T.ramp(0, 1, LN)]
                                                + vec[3, T.ramp(0, 1, LN)])
                    p32[j2, T.ramp(io * LN, 1, LN)] = T.call_pure_extern(
                        "int32x16", PACK, vec[2, T.ramp(0, 1, LN)], vec[3, T.ramp(0, 1, LN)])
            elif AVX512:
                for j in range(n_rows):   # a masked score (-inf) gives exactly 0
                    s_buf[j, T.ramp(io * LN, 1, LN)] = T.call_pure_extern(
                        "float32x16", EXP2_16, s_buf[j, T.ramp(io * LN, 1, LN)],
                        T.broadcast(T.float32(1), LN), vec[0, T.ramp(0, 1, LN)])
                    vec[1, T.ramp(0, 1, LN)] = (vec[1, T.ramp(0, 1, LN)]
                                                + s_buf[j, T.ramp(io * LN, 1, LN)])
            else:
                for j in range(n_rows):
                    for ii in T.vectorized(LN):   # a masked score (-inf) gives exactly 0
                        s_buf[j, io * LN + ii] = exp2(s_buf[j, io * LN + ii] - vec[0, ii])
                        vec[1, ii] = vec[1, ii] + s_buf[j, io * LN + ii]
            for ii in T.vectorized(LN):
                l_buf[io * LN + ii] = l_buf[io * LN + ii] * alpha[io * LN + ii] + vec[1, ii]
                m_buf[io * LN + ii] = m_new[io * LN + ii]

    return online_softmax
