"""The CPU decode template's row primitives: the reductions, dot products and O-row updates
its key blocks are made of, lanes along head_dim.

row_macros   the TVMScript macros for a DecodeParams record:
  lane_sum     acc[0] = the sum of acc's lanes, by halving
  lane_max     acc[0] = the max of acc's lanes
  dot_rows     acc[0] = Q row r . K row kr (one score, lanes along head_dim)
  add_values   o += p V row kr (o: a local row, in registers)
  rescaled_row o = a row of part_o x scale
  stored_row   a row of part_o = o
masked_score   a scaled score through the score modifier, -inf where the mask hides it
"""
from __future__ import annotations

import copy

from tvm.script import tirx as T


def masked_score(rules, neg_inf, value, b, h, qpos, kv, kv_len, q_len=None):
    """A scaled score with the score modifier applied, or -inf where the mask hides it.
    q_len: what the mask and modifier read as q_len when not the rules' seq (a packed
    call's row: its own new tokens)."""
    if q_len is not None:
        rules = copy.copy(rules)
        rules.seq = q_len
    return T.Select(rules.visible(b, h, qpos, kv, kv_len=kv_len),
                    rules.modified(value, b, h, qpos, kv, kv_len), neg_inf)


def row_macros(prm):
    """(lane_sum, lane_max, dot_rows, add_values, rescaled_row, stored_row) for record prm
    (DecodeParams)."""
    LN, NCH, TAIL, QCH, zero, loaded = prm.LN, prm.NCH, prm.TAIL, prm.QCH, prm.zero, prm.loaded

    @T.macro
    def lane_sum(acc):
        """acc[0] = the sum of acc's lanes, by halving (vector adds, no scalar chain)."""
        if LN == 16:
            for ln in T.vectorized(8):
                acc[ln] = acc[ln] + acc[ln + 8]
        if LN >= 8:
            for ln in T.vectorized(4):
                acc[ln] = acc[ln] + acc[ln + 4]
        for ln in T.vectorized(2):
            acc[ln] = acc[ln] + acc[ln + 2]
        acc[0] = acc[0] + acc[1]

    @T.macro
    def lane_max(acc):
        """acc[0] = the max of acc's lanes."""
        if LN == 16:
            for ln in T.vectorized(8):
                acc[ln] = T.max(acc[ln], acc[ln + 8])
        if LN >= 8:
            for ln in T.vectorized(4):
                acc[ln] = T.max(acc[ln], acc[ln + 4])
        for ln in T.vectorized(2):
            acc[ln] = T.max(acc[ln], acc[ln + 2])
        acc[0] = T.max(acc[0], acc[1])

    @T.macro
    def dot_rows(qb, k_cache, acc, r, b, g, kr):
        for ln in T.vectorized(LN):
            acc[ln] = zero
        for ch in range(NCH):
            for ln in T.vectorized(LN):
                acc[ln] = acc[ln] + qb[r, ch * LN + ln] * loaded(k_cache[b, g, kr, ch * LN + ln])
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                acc[ln] = acc[ln] + qb[r, NCH * LN + ln] * loaded(
                    k_cache[b, g, kr, NCH * LN + ln])
        lane_sum(acc)

    @T.macro
    def add_values(o, v_cache, p, b, g, kr):
        # o: a local [DP] row, unrolled so that it lives in registers (accumulated in
        # part_o, each key's FMAs waited on the last key's stores; see PERFORMANCE.md)
        for ch in T.unroll(NCH):
            for ln in T.vectorized(LN):
                o[ch * LN + ln] = o[ch * LN + ln] + p * loaded(v_cache[b, g, kr, ch * LN + ln])
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                o[NCH * LN + ln] = o[NCH * LN + ln] + p * loaded(
                    v_cache[b, g, kr, NCH * LN + ln])

    @T.macro
    def rescaled_row(o, part_o, slot, r, scale):
        # o = a row of part_o x scale, QCH vectors (as one vector of DP floats, a DP not a
        # power of two, 40-112, was legalised lane by lane by LLVM: vinsertps; see
        # benchmarks/PERFORMANCE.md, Schedule decisions)
        for ch in T.unroll(QCH):
            for ln in T.vectorized(LN):
                o[ch * LN + ln] = part_o[slot, r, ch * LN + ln] * scale

    @T.macro
    def stored_row(part_o, slot, r, o):
        for ch in T.unroll(QCH):
            for ln in T.vectorized(LN):
                part_o[slot, r, ch * LN + ln] = o[ch * LN + ln]

    return lane_sum, lane_max, dot_rows, add_values, rescaled_row, stored_row
