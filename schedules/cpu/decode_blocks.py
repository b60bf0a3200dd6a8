"""The CPU decode template's key blocks: one block of the online softmax for a row tile,
scores, softmax and values, in one of two shapes.

block_macros   the TVMScript macros for a DecodeParams record:
  Keys: row b of a contiguous cache at k0, or (paged) the pool block the block table gives
  for k0, read once a key block (key_block, key_slot: decode_params.py).
  Rows in the lanes (ROW_LANES: tiles of 8 or more rows):
    lanes_scores    S[j, rows] += Q^T[c, rows] K[j, c], JU keys at a time, then masked
    lanes_softmax   m', alpha, P = 2^(S - m') and l, vectors over the tile's rows
    lanes_values    each row's O += P V over the block's keys (P = 0 skipped)
    block_rows_in_lanes  the three
  Lanes along head_dim (fewer rows):
    row_scores      a row's scores: a dot product and a horizontal sum each
    row_softmax     the row's m', alpha, P and l, vectors over keys
    row_values      the row's O += P V
    block_rows      the three, row by row
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.schedules.cpu.decode_rows import masked_score, row_macros
from mhagen.schedules.cpu.fast_math import exp2


def block_macros(prm, rules):
    """(block_rows_in_lanes, block_rows) for record prm (DecodeParams) and the workload's
    ScoreRules."""
    return lanes_block_macro(prm, rules), row_block_macro(prm, rules)


def lanes_block_macro(prm, rules):
    """block_rows_in_lanes: a key block for a tile's rows in the vector lanes."""
    _, _, _, add_values, rescaled_row, stored_row = row_macros(prm)
    loaded, key_block, key_slot, q_len = prm.loaded, prm.key_block, prm.key_slot, prm.q_len
    rows_of = prm.rows_of
    KB, JU, RT, R, S, d = prm.KB, prm.JU, prm.RT, prm.R, prm.S, prm.d
    GROUP, neg_inf, zero, PACKED = prm.GROUP, prm.neg_inf, prm.zero, prm.packed
    PAGED = prm.BS is not None

    def scored(value, b, h, qpos, kv, kv_len, cu=None):
        return masked_score(rules, neg_inf, value, b, h, qpos, kv, kv_len, q_len(cu, b))

    @T.macro
    def lanes_scores(cache_lens, cu, k_cache, qt, sr, sacc, rq, b, g, rt, k0, kv_len, kr,
                     base):
        # scores of JU keys at a time for all RT rows, rows in the lanes: S[j, rows] +=
        # Q^T[c, rows] * K[j, c] over head_dim c (K[j, c] a broadcast); the keys at `base`
        # of the cache's row (or pool block) kr
        for jo in range(KB // JU):
            for u in T.unroll(JU):
                for ln in T.vectorized(RT):
                    sacc[u, ln] = zero
            for c in range(d):
                for u in T.unroll(JU):
                    for ln in T.vectorized(RT):
                        sacc[u, ln] = sacc[u, ln] + qt[c, ln] * loaded(k_cache[
                            kr, g, key_slot(base, jo * JU, u), c])
            for u in T.unroll(JU):
                for r in range(RT):
                    if PACKED:     # the rows' heads and positions, found at the piece's start
                        sr[jo * JU + u, r] = scored(sacc[u, r], b, rq[0, r], rq[1, r],
                                                    k0 + jo * JU + u, kv_len, cu)
                    else:
                        row = T.min(rt * RT + r, R - 1)
                        h = g * GROUP + row // S
                        qpos = cache_lens[b] + row % S
                        kv = k0 + jo * JU + u
                        sr[jo * JU + u, r] = scored(sacc[u, r], b, h, qpos, kv, kv_len)

    @T.macro
    def lanes_softmax(sr, sm, ml):
        # the online softmax, vectors over rows: sm = m', the max subtracted, alpha, sum P
        for ln in T.vectorized(RT):
            sm[0, ln] = ml[0, ln]
        for j in range(KB):
            for ln in T.vectorized(RT):
                sm[0, ln] = T.max(sm[0, ln], sr[j, ln])
        for ln in T.vectorized(RT):
            sm[1, ln] = T.Select(sm[0, ln] == neg_inf, zero, sm[0, ln])
            sm[2, ln] = exp2(ml[0, ln] - sm[1, ln])
            sm[3, ln] = zero
        for j in range(KB):
            for ln in T.vectorized(RT):
                sr[j, ln] = exp2(sr[j, ln] - sm[1, ln])      # a masked score gives 0
                sm[3, ln] = sm[3, ln] + sr[j, ln]
        for ln in T.vectorized(RT):
            ml[1, ln] = ml[1, ln] * sm[2, ln] + sm[3, ln]
            ml[0, ln] = sm[0, ln]

    @T.macro
    def lanes_values(cu, v_cache, part_o, sr, sm, o_row, b, rt, kr, g, slot, base):
        for r in range(RT):
            # packed: a tile's rows past its batch row's skipped (their lanes were copies)
            if not PACKED or rt * RT + r < rows_of(cu, b):
                rescaled_row(o_row, part_o, slot, r, sm[2, r])
                for j in range(KB):
                    if sr[j, r] != zero:
                        add_values(o_row, v_cache, sr[j, r], kr, g, key_slot(base, j))
                stored_row(part_o, slot, r, o_row)

    @T.macro
    def lanes_block(cache_lens, cu, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml, o_row, rq,
                    b, g, rt, slot, k0, kv_len, kr, base):
        lanes_scores(cache_lens, cu, k_cache, qt, sr, sacc, rq, b, g, rt, k0, kv_len, kr, base)
        lanes_softmax(sr, sm, ml)
        lanes_values(cu, v_cache, part_o, sr, sm, o_row, b, rt, kr, g, slot, base)

    @T.macro
    def block_rows_in_lanes(cache_lens, cu, tables, k_cache, v_cache, part_o, qt, sr, sacc, sm,
                            ml, o_row, rq, b, g, rt, slot, k0, kv_len):
        if PAGED:     # the key block's pool block: one read of the block table
            kr = key_block(tables, b, k0)[0]
            lanes_block(cache_lens, cu, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml, o_row,
                        rq, b, g, rt, slot, k0, kv_len, kr, key_block(tables, b, k0)[1])
        else:
            lanes_block(cache_lens, cu, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml, o_row,
                        rq, b, g, rt, slot, k0, kv_len, b, k0)

    return block_rows_in_lanes


def row_block_macro(prm, rules):
    """block_rows: a key block for a tile's rows one by one, lanes along head_dim."""
    lane_sum, lane_max, dot_rows, add_values, rescaled_row, stored_row = row_macros(prm)
    key_block, key_slot, q_len, kv_head = prm.key_block, prm.key_slot, prm.q_len, prm.kv_head
    rows_of = prm.rows_of
    KB, RT, R, S, LN = prm.KB, prm.RT, prm.R, prm.S, prm.LN
    GROUP, neg_inf, zero, PACKED = prm.GROUPT, prm.neg_inf, prm.zero, prm.packed
    PAGED = prm.BS is not None

    def scored(value, b, h, qpos, kv, kv_len, cu=None):
        return masked_score(rules, neg_inf, value, b, h, qpos, kv, kv_len, q_len(cu, b))

    @T.macro
    def row_scores(qb, cu, k_cache, s_buf, acc, r, b, g, h, qpos, k0, kv_len, kr, base):
        for j in range(KB):
            dot_rows(qb, k_cache, acc, r, kr, g, key_slot(base, j))
            s_buf[j] = scored(acc[0], b, h, qpos, k0 + j, kv_len, cu)

    @T.macro
    def row_softmax(s_buf, acc, st, ml, r):
        # m' = max(m, scores), P = 2^(S - m'), sum P: vectors over keys
        for ln in T.vectorized(LN):
            acc[ln] = ml[0, r]
        for jo in range(KB // LN):
            for ln in T.vectorized(LN):
                acc[ln] = T.max(acc[ln], s_buf[jo * LN + ln])
        lane_max(acc)
        st[0] = acc[0]
        st[3] = T.Select(st[0] == neg_inf, zero, st[0])
        st[1] = exp2(ml[0, r] - st[3])
        for ln in T.vectorized(LN):
            acc[ln] = zero
        for jo in range(KB // LN):
            for ln in T.vectorized(LN):
                # a masked score (-inf) gives exactly 0 (exp2)
                s_buf[jo * LN + ln] = exp2(s_buf[jo * LN + ln] - st[3])
                acc[ln] = acc[ln] + s_buf[jo * LN + ln]
        lane_sum(acc)
        st[2] = acc[0]
        ml[1, r] = ml[1, r] * st[1] + st[2]
        ml[0, r] = st[0]

    @T.macro
    def row_values(v_cache, part_o, s_buf, st, o_row, r, kr, g, slot, base):
        rescaled_row(o_row, part_o, slot, r, st[1])
        for j in range(KB):
            if s_buf[j] != zero:
                add_values(o_row, v_cache, s_buf[j], kr, g, key_slot(base, j))
        stored_row(part_o, slot, r, o_row)

    @T.macro
    def row_block(cache_lens, cu, qb, k_cache, v_cache, part_o, s_buf, acc, st, ml, o_row, rq,
                  b, g, rt, slot, k0, kv_len, kr, base):
        for r in range(RT):
            # packed: the rows' heads and positions were found at the piece's start; a
            # tile's rows past its batch row's (a row of fewer tokens than the most) skipped
            if PACKED and rt * RT + r < rows_of(cu, b):
                row_scores(qb, cu, k_cache, s_buf, acc, r, b, kv_head(g, rq[0, r]), rq[0, r],
                           rq[1, r], k0, kv_len, kr, base)
                row_softmax(s_buf, acc, st, ml, r)
                row_values(v_cache, part_o, s_buf, st, o_row, r, kr, kv_head(g, rq[0, r]),
                           slot, base)
            if not PACKED:
                row = T.min(rt * RT + r, R - 1)
                h = g * GROUP + row // S
                qpos = cache_lens[b] + row % S
                row_scores(qb, cu, k_cache, s_buf, acc, r, b, kv_head(g, h), h, qpos, k0,
                           kv_len, kr, base)
                row_softmax(s_buf, acc, st, ml, r)
                row_values(v_cache, part_o, s_buf, st, o_row, r, kr, kv_head(g, h), slot, base)

    @T.macro
    def block_rows(cache_lens, cu, tables, qb, k_cache, v_cache, part_o, s_buf, acc, st, ml,
                   o_row, rq, b, g, rt, slot, k0, kv_len):
        if PAGED:     # the key block's pool block: one read of the block table
            kr = key_block(tables, b, k0)[0]
            row_block(cache_lens, cu, qb, k_cache, v_cache, part_o, s_buf, acc, st, ml, o_row,
                      rq, b, g, rt, slot, k0, kv_len, kr, key_block(tables, b, k0)[1])
        else:
            row_block(cache_lens, cu, qb, k_cache, v_cache, part_o, s_buf, acc, st, ml, o_row,
                      rq, b, g, rt, slot, k0, kv_len, b, k0)

    return block_rows
