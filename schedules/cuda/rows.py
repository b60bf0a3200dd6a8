"""What both CUDA attention templates (attention.py, attention_tc.py) run per thread: a thread
owns RT query rows and every CT-th column of them (keys for the scores, head columns for the
output); the macros below are the masking, the online softmax and the output write of those
rows, in the templates' log2 units."""
from __future__ import annotations

from tvm.script import tirx as T


RT = 4    # query rows a thread owns
CT = 8    # threads across a row: keys (S) or head columns (O), interleaved


def coordinates(bx, tid, heads, q_tiles, group, q_tile):
    """(batch, head, query tile, K/V head, first query row, row group, lane column) of
    thread tid of block bx (one block per (batch, head, query tile)), as expressions: bind
    them with T.meta_var (TVM's buffer flattening rejects let-bound scalars next to thread
    launches)."""
    return (bx // (heads * q_tiles), bx // q_tiles % heads, bx % q_tiles,
            bx // q_tiles % heads // group, bx % q_tiles * q_tile, tid // CT, tid % CT)


class RowMacros:
    """The TVMScript macros both CUDA templates run per thread: RT query rows, and the
    columns lane_col + CT * j of them (SC score columns, OC output columns). Scores are in
    log2 units; st[0] is a row's running max, st[1] its sum, st[2] the rescale alpha, st[3]
    the max subtracted (0 while the row saw no key)."""

    def __init__(self, w, rules, sc, oc):
        S, d = w.seq, w.head_dim
        neg_inf, zero = T.float32(float("-inf")), T.float32(0.0)
        has_mod = w.score_mod is not None
        visible, modified = rules.visible, rules.modified

        @T.macro
        def start(st, acc_o):
            for i in T.unroll(RT):
                st[0, i] = neg_inf
                st[1, i] = zero
                for j in T.unroll(oc):
                    acc_o[i, j] = zero

        @T.macro
        def mask_and_max(masked, acc_s, red, max_s, lens, b, h, q0, k0, row_group, lane_col):
            """The modifier and (a partial block) the mask on the scores; each thread's max
            per row to max_s."""
            for i in T.unroll(RT):
                red[0] = neg_inf
                for j in T.unroll(sc):
                    if has_mod:
                        acc_s[i, j] = modified(acc_s[i, j], b, h, q0 + row_group * RT + i,
                                               k0 + lane_col + CT * j)
                    if masked:
                        acc_s[i, j] = T.Select(visible(b, h, q0 + row_group * RT + i,
                                                       k0 + lane_col + CT * j, lens),
                                               acc_s[i, j], neg_inf)
                    red[0] = T.max(red[0], acc_s[i, j])
                max_s[row_group * RT + i, lane_col] = red[0]

        @T.macro
        def exponentiate(masked, acc_s, st, red, max_s, sum_s, p_s, row_group, lane_col):
            """Online softmax: every thread of a row computes the row's max and alpha alike;
            P = 2^(S - max) to p_s (in p_s's dtype), each thread's partial sum to sum_s."""
            for i in T.unroll(RT):
                red[0] = st[0, i]
                for t in T.unroll(CT):
                    red[0] = T.max(red[0], max_s[row_group * RT + i, t])
                st[3, i] = T.Select(red[0] == neg_inf, zero, red[0])
                st[2, i] = T.exp2(st[0, i] - st[3, i])
                st[0, i] = red[0]
                red[0] = zero
                for j in T.unroll(sc):
                    if masked:
                        acc_s[i, j] = T.Select(acc_s[i, j] == neg_inf, zero,
                                               T.exp2(acc_s[i, j] - st[3, i]))
                    else:
                        acc_s[i, j] = T.exp2(acc_s[i, j] - st[3, i])
                    p_s[row_group * RT + i, lane_col + CT * j] = T.Cast(p_s.dtype, acc_s[i, j])
                    red[0] = red[0] + acc_s[i, j]
                sum_s[row_group * RT + i, lane_col] = red[0]

        @T.macro
        def rescale(st, red, sum_s, acc_o, row_group):
            """l = l alpha + sum P; O = O alpha (P V is added next)."""
            for i in T.unroll(RT):
                red[0] = zero
                for t in T.unroll(CT):
                    red[0] = red[0] + sum_s[row_group * RT + i, t]
                st[1, i] = st[1, i] * st[2, i] + red[0]
                for j in T.unroll(oc):
                    acc_o[i, j] = acc_o[i, j] * st[2, i]

        @T.macro
        def write_out(out, st, red, acc_o, b, h, q0, row_group, lane_col):
            """out = O / l for the rows inside the sequence (a row that saw no key: 0)."""
            for i in T.unroll(RT):
                if q0 + row_group * RT + i < S:
                    red[0] = T.Select(st[1, i] > zero, T.float32(1) / st[1, i], zero)
                    for j in T.unroll(oc):
                        if lane_col + CT * j < d:
                            out[b * S + q0 + row_group * RT + i, h * d + lane_col + CT * j] = (
                                T.Cast(out.dtype, acc_o[i, j] * red[0]))

        self.start, self.mask_and_max, self.exponentiate = start, mask_and_max, exponentiate
        self.rescale, self.write_out = rescale, write_out
