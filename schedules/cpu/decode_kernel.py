"""The CPU decode template's main loop and epilogue: workers walking their shares of the
call's key blocks (split-KV), and the merge of each group's partial results.

decode_function   the PrimFunc (qkv, cache_lens, k_cache, v_cache, part_o, part_ml, att):
  start_piece       a piece's Q rows (scaled to log2 units; Q^T too with rows in the lanes),
                    its partial O zeroed and (m, l) reset
  piece             a group's key blocks first .. end into one partial (decode_blocks.py),
                    up to the tile's last query's position when causal
  worker_task       one worker: its even, contiguous share (balanced_share) of every
                    group's blocks, in order
  merge_tile        a group's rows: out = sum_p 2^(m_p - m) O_p / sum_p 2^(m_p - m) l_p
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.schedules.x86 import denormals
from mhagen.schedules.cpu.decode_blocks import block_macros
from mhagen.schedules.cpu.decode_tiles import balanced_share
from mhagen.schedules.cpu.fast_math import exp2


def piece_macro(prm, rules):
    """piece for record prm (DecodeParams) and the workload's ScoreRules."""
    block_rows_in_lanes, block_rows = block_macros(prm, rules)
    kv_len_of, q_lane, q_pos = prm.kv_len_of, prm.q_lane, prm.q_pos
    RT, R, S, KB, d, LN, QCH = prm.RT, prm.R, prm.S, prm.KB, prm.d, prm.LN, prm.QCH
    GROUP, ROW_LANES, causal = prm.GROUP, prm.ROW_LANES, prm.causal
    c_log2e, neg_inf, zero = prm.c_log2e, prm.neg_inf, prm.zero

    @T.macro
    def start_piece(qkv, part_o, qb, ml, qt, b, g, rt, slot):
        for r in range(RT):
            row = T.min(rt * RT + r, R - 1)          # rows past R: copies, never stored
            h = g * GROUP + row // S
            t = row % S
            for ch in range(QCH):
                for ln in T.vectorized(LN):
                    qb[r, ch * LN + ln] = q_lane(qkv, b, h, t, ch, ln) * c_log2e
            for ch in T.unroll(QCH):
                for ln in T.vectorized(LN):
                    part_o[slot, r, ch * LN + ln] = zero
            ml[0, r] = neg_inf
            ml[1, r] = zero
            if ROW_LANES:
                for c in range(d):
                    qt[c, r] = qb[r, c]

    @T.macro
    def piece(qkv, cache_lens, k_cache, v_cache, part_o, part_ml, qb, s_buf, acc, st, ml,
              o_row, qt, sr, sacc, sm, b, g, rt, slot, first, end):
        # key blocks first .. end of group (b, g, rt) into partial `slot`; (m, l) stay in
        # ml until the end (one query row's partials lie 8 bytes apart: neighbouring tasks
        # would store into one cache line every block)
        kv_len = kv_len_of(cache_lens, b)
        # the keys this tile may see: up to its last query's position when causal (its
        # rows run over heads, then tokens: a tile within one head ends at token
        # (last row) % S, one that crosses heads reaches token S - 1)
        last = T.min(rt * RT + RT - 1, R - 1)
        t_last = T.Select((rt * RT) // S == last // S, last % S, S - 1)
        k_end = T.min(kv_len, q_pos(cache_lens, b, t_last) + 1) if causal else kv_len
        start_piece(qkv, part_o, qb, ml, qt, b, g, rt, slot)
        for kb in range(first, end):
            k0 = kb * KB
            if ROW_LANES and k0 < k_end:
                block_rows_in_lanes(cache_lens, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml,
                                    o_row, b, g, rt, slot, k0, kv_len)
            if not ROW_LANES and k0 < k_end:
                block_rows(cache_lens, qb, k_cache, v_cache, part_o, s_buf, acc, st, ml, o_row,
                           b, g, rt, slot, k0, kv_len)
        for r in range(RT):
            part_ml[slot, 0, r] = ml[0, r]
            part_ml[slot, 1, r] = ml[1, r]

    return piece


def task_macros(prm, rules):
    """(worker_task, merge_tile) for record prm and the workload's ScoreRules."""
    return worker_macro(prm, rules), merge_macro(prm)


def worker_macro(prm, rules):
    """worker_task for record prm and the workload's ScoreRules."""
    piece = piece_macro(prm, rules)
    n_blocks = prm.n_blocks
    B, G, NRT, NG, C, RT = prm.B, prm.G, prm.NRT, prm.NG, prm.C, prm.RT
    DP, KB, LN, JU, flush = prm.DP, prm.KB, prm.LN, prm.JU, prm.flush

    @T.macro
    def worker_task(qkv, cache_lens, k_cache, v_cache, part_o, part_ml, worker):
        csr = T.decl_buffer((1,), "int32")
        if flush:
            csr[0] = T.call_extern("int32", denormals.ENTER)
        qb = T.decl_buffer((RT, DP), "float32")
        s_buf = T.decl_buffer((KB,), "float32")
        acc = T.decl_buffer((LN,), "float32")
        st = T.decl_buffer((4,), "float32")     # m', alpha, sum p, subtracted max
        ml = T.decl_buffer((2, RT), "float32")  # a piece's running max and sum
        o_row = T.decl_buffer((DP,), "float32")  # one row's O over a key block
        qt = T.decl_buffer((DP, RT), "float32")   # rows in lanes: Q^T, scores, JU keys'
        sr = T.decl_buffer((KB, RT), "float32")   # score sums, softmax vectors
        sacc = T.decl_buffer((JU, RT), "float32")
        sm = T.decl_buffer((4, RT), "float32")
        cnt = T.decl_buffer((2,), "int32")      # all the blocks; the groups' before j
        cnt[0] = 0
        for bb in range(B):
            cnt[0] = cnt[0] + G * NRT * n_blocks(cache_lens, bb)
        lo, hi = T.meta_var(balanced_share(worker, C, cnt[0]))
        cnt[1] = 0
        for j in range(NG):
            b = j // (G * NRT)
            nb = n_blocks(cache_lens, b)
            first = T.max(lo - cnt[1], 0)
            end = T.min(hi - cnt[1], nb)
            if first < end:
                piece(qkv, cache_lens, k_cache, v_cache, part_o, part_ml, qb, s_buf, acc,
                      st, ml, o_row, qt, sr, sacc, sm, b, j // NRT % G, j % NRT,
                      j + worker, first, end)
            cnt[1] = cnt[1] + nb
        if flush:
            T.evaluate(T.call_extern("int32", denormals.EXIT, csr[0]))

    return worker_task


def merge_macro(prm):
    """merge_tile for record prm."""
    n_blocks, out_value = prm.n_blocks, prm.out_value
    B, G, NRT, C, RT, R, S, d = prm.B, prm.G, prm.NRT, prm.C, prm.RT, prm.R, prm.S, prm.d
    DP, LN, QCH, GROUP = prm.DP, prm.LN, prm.QCH, prm.GROUP
    neg_inf, zero = prm.neg_inf, prm.zero

    @T.macro
    def merge_tile(cache_lens, part_o, part_ml, out, tile):
        mg = T.decl_buffer((3,), "float32")       # max m, sum l, 1 / sum l
        wt = T.decl_buffer((C,), "float32")
        o = T.decl_buffer((DP,), "float32")
        cnt = T.decl_buffer((2,), "int32")        # all the blocks; those before the tile
        b = tile // (G * NRT)
        cnt[0] = 0
        cnt[1] = 0
        for bb in range(B):
            cnt[0] = cnt[0] + G * NRT * n_blocks(cache_lens, bb)
            if bb < b:
                cnt[1] = cnt[1] + G * NRT * n_blocks(cache_lens, bb)
        nb = n_blocks(cache_lens, b)
        begin = cnt[1] + tile % (G * NRT) * nb
        stop = begin + nb
        g = tile // NRT % G
        rt = tile % NRT
        for r in range(RT):
            if rt * RT + r < R:
                row = rt * RT + r
                h = g * GROUP + row // S
                t = row % S
                mg[0] = neg_inf
                for p in range(C):
                    lo, hi = T.meta_var(balanced_share(p, C, cnt[0]))
                    if lo < stop and begin < hi:
                        mg[0] = T.max(mg[0], part_ml[tile + p, 0, r])
                mg[0] = T.Select(mg[0] == neg_inf, zero, mg[0])
                mg[1] = zero
                for ch in T.unroll(QCH):
                    for ln in T.vectorized(LN):
                        o[ch * LN + ln] = zero
                for p in range(C):
                    lo, hi = T.meta_var(balanced_share(p, C, cnt[0]))
                    if lo < stop and begin < hi:
                        wt[p] = exp2(part_ml[tile + p, 0, r] - mg[0])   # 0 for -inf
                        mg[1] = mg[1] + wt[p] * part_ml[tile + p, 1, r]
                        for ch in T.unroll(QCH):
                            for ln in T.vectorized(LN):
                                o[ch * LN + ln] = (o[ch * LN + ln] + wt[p]
                                                   * part_o[tile + p, r, ch * LN + ln])
                mg[2] = T.Select(mg[1] > zero, T.float32(1) / mg[1], zero)
                for c in range(d):
                    out[b * S + t, h * d + c] = out_value(o[c] * mg[2])

    return merge_tile


def decode_function(prm, rules):
    """The decode PrimFunc for record prm (DecodeParams), the call's scalars still free."""
    worker_task, merge_tile = task_macros(prm, rules)
    NP, M, PW, B, G, N, d, CD = prm.NP, prm.M, prm.PW, prm.B, prm.G, prm.N, prm.d, prm.CD
    NP_MAX, RT, DP, MA, HD, C, NG = prm.NP_MAX, prm.RT, prm.DP, prm.MA, prm.HD, prm.C, prm.NG

    @T.prim_func(check_well_formed=False)   # free scalars until with_scalars
    def attention(qkv: T.Buffer((NP, M, PW), "float32"),
                  cache_lens: T.Buffer((B,), "int32"),
                  k_cache: T.Buffer((B, G, N, d), CD),
                  v_cache: T.Buffer((B, G, N, d), CD),
                  part_o: T.Buffer((NP_MAX, RT, DP), "float32"),
                  part_ml: T.Buffer((NP_MAX, 2, RT), "float32"),
                  out: T.Buffer((MA, HD), "float32")):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        # the call's key blocks, group after group ((batch row, K/V head, row tile) in
        # order), cut into one contiguous share per worker: every worker runs the same
        # work whatever the rows' cache lengths, and streams one stretch of the cache
        for worker in T.parallel(C):
            worker_task(qkv, cache_lens, k_cache, v_cache, part_o, part_ml, worker)
        # merge each row's pieces: out = sum_p 2^(m_p - m) O_p / sum_p 2^(m_p - m) l_p, the
        # pieces of group j being partials j + t of the workers t whose shares meet it
        for tile in T.parallel(NG):
            merge_tile(cache_lens, part_o, part_ml, out, tile)

    return attention
