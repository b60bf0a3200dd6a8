"""The CPU attention template's mask and score-modifier stage: a score's write-back into
S^T, where the mask (partial blocks only) and the score modifier apply and the running max
takes it in.

mask_macros   the stage's TVMScript macro for a kernel layout:
  masked_max    s_buf[key, query] = the score x in log2 units (score: scaled here on pairs
                and AMX), modified (ScoreRules.modified), -inf where masked blocks hide it
                (ScoreRules.visible); m_new[query] = max(m_new[query], it)
"""
from __future__ import annotations

from tvm.script import tirx as T


def mask_macros(k, rules):
    """masked_max for layout k (KernelLayout) and the workload's ScoreRules."""
    visible, modified, score = rules.visible, rules.modified, k.score
    MR, NR, neg_inf = k.MR, k.NR, k.neg_inf

    @T.macro
    def masked_max(masked, s_buf, m_new, x, lens, b, h, q0, k0, jo, io, jj, ii):
        # x: the score of key k0 + jo MR + jj and query q0 + io NR + ii
        if masked:
            s_buf[jo * MR + jj, io * NR + ii] = T.Select(
                visible(b, h, q0 + io * NR + ii, k0 + jo * MR + jj, lens),
                modified(score(x), b, h, q0 + io * NR + ii, k0 + jo * MR + jj), neg_inf)
        else:
            s_buf[jo * MR + jj, io * NR + ii] = modified(
                score(x), b, h, q0 + io * NR + ii, k0 + jo * MR + jj)
        m_new[io * NR + ii] = T.max(m_new[io * NR + ii], s_buf[jo * MR + jj, io * NR + ii])

    return masked_max
