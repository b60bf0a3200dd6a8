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

from tvm import tirx
from tvm.script import tirx as T

from mhagen.schedules.x86 import denormals
from mhagen.schedules.cpu.decode_blocks import block_macros
from mhagen.schedules.cpu.decode_tiles import balanced_share
from mhagen.schedules.cpu.fast_math import exp2


def piece_macro(prm, rules):
    """piece for record prm (DecodeParams) and the workload's ScoreRules."""
    block_rows_in_lanes, block_rows = block_macros(prm, rules)
    kv_len_of, count, rows_of = prm.kv_len_of, prm.count, prm.rows_of
    q_lane, q_pos = prm.q_lane, prm.q_pos
    RT, KB, d, LN, QCH = prm.RT, prm.KB, prm.d, prm.LN, prm.QCH
    GROUP, ROW_LANES, causal = prm.GROUPT, prm.ROW_LANES, prm.causal
    c_log2e, neg_inf, zero, PACKED = prm.c_log2e, prm.neg_inf, prm.zero, prm.packed

    @T.macro
    def start_piece(qkv, cache_lens, cu, part_o, qb, ml, qt, rq, b, g, rt, slot):
        for r in range(RT):
            row = T.min(rt * RT + r, rows_of(cu, b) - 1)   # rows past: copies, never stored
            h = g * GROUP + row // count(cu, b)
            t = row % count(cu, b)
            for ch in range(QCH):
                for ln in T.vectorized(LN):
                    qb[r, ch * LN + ln] = q_lane(qkv, cu, b, h, t, ch, ln) * c_log2e
            for ch in T.unroll(QCH):
                for ln in T.vectorized(LN):
                    part_o[slot, r, ch * LN + ln] = zero
            ml[0, r] = neg_inf
            ml[1, r] = zero
            if PACKED:    # the row's head and position, read by every key block
                rq[0, r] = h
                rq[1, r] = q_pos(cache_lens, cu, b, t)
            if ROW_LANES:
                for c in range(d):
                    qt[c, r] = qb[r, c]

    @T.macro
    def piece(qkv, cache_lens, cu, tables, k_cache, v_cache, part_o, part_ml, qb, s_buf, acc,
              st, ml, o_row, qt, sr, sacc, sm, rq, b, g, rt, slot, first, end):
        # key blocks first .. end of group (b, g, rt) into partial `slot`; (m, l) stay in
        # ml until the end (one query row's partials lie 8 bytes apart: neighbouring tasks
        # would store into one cache line every block)
        kv_len = kv_len_of(cache_lens, cu, b)
        # the keys this tile may see: up to its last query's position when causal (its
        # rows run over heads, then tokens: a tile within one head ends at token
        # (last row) % S, one that crosses heads reaches token S - 1)
        n_new = count(cu, b)
        last = T.min(rt * RT + RT - 1, rows_of(cu, b) - 1)
        t_last = T.Select((rt * RT) // n_new == last // n_new, last % n_new, n_new - 1)
        k_end = T.min(kv_len, q_pos(cache_lens, cu, b, t_last) + 1) if causal else kv_len
        start_piece(qkv, cache_lens, cu, part_o, qb, ml, qt, rq, b, g, rt, slot)
        for kb in range(first, end):
            k0 = kb * KB
            if ROW_LANES and k0 < k_end:
                block_rows_in_lanes(cache_lens, cu, tables, k_cache, v_cache, part_o, qt, sr,
                                    sacc, sm, ml, o_row, rq, b, g, rt, slot, k0, kv_len)
            if not ROW_LANES and k0 < k_end:
                block_rows(cache_lens, cu, tables, qb, k_cache, v_cache, part_o, s_buf, acc, st,
                           ml, o_row, rq, b, g, rt, slot, k0, kv_len)
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
    n_blocks, tiles_of = prm.n_blocks, prm.tiles_of
    B, G, C, RT = prm.B, prm.GT, prm.C, prm.RT
    DP, KB, LN, JU, flush = prm.DP, prm.KB, prm.LN, prm.JU, prm.flush

    @T.macro
    def worker_task(qkv, cache_lens, cu, tables, k_cache, v_cache, part_o, part_ml, worker):
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
        rq = T.decl_buffer((2, RT), "int32")     # packed: the tile rows' heads and positions
        cnt = T.decl_buffer((3,), "int32")      # all the blocks; the groups' before j; j
        cnt[0] = 0
        for bb in range(B):
            cnt[0] = cnt[0] + G * tiles_of(cu, bb) * n_blocks(cache_lens, cu, bb)
        lo, hi = T.meta_var(balanced_share(worker, C, cnt[0]))
        cnt[1] = 0
        cnt[2] = 0
        # groups (batch row, K/V head, row tile) in order; group j's piece is partial j + worker
        for b in range(B):
            nb = n_blocks(cache_lens, cu, b)
            nrt = tiles_of(cu, b)
            for gr in range(G * nrt):
                first = T.max(lo - cnt[1], 0)
                end = T.min(hi - cnt[1], nb)
                if first < end:
                    piece(qkv, cache_lens, cu, tables, k_cache, v_cache, part_o, part_ml, qb,
                          s_buf, acc, st, ml, o_row, qt, sr, sacc, sm, rq, b, gr // nrt,
                          gr % nrt, cnt[2] + worker, first, end)
                cnt[1] = cnt[1] + nb
                cnt[2] = cnt[2] + 1
        if flush:
            T.evaluate(T.call_extern("int32", denormals.EXIT, csr[0]))

    return worker_task


def merge_macro(prm):
    """merge_tile for record prm."""
    n_blocks, tiles_of, rows_of, count, first_row = (prm.n_blocks, prm.tiles_of, prm.rows_of,
                                                     prm.count, prm.first_row)
    out_value = prm.out_value
    B, G, C, RT, d = prm.B, prm.GT, prm.C, prm.RT, prm.d
    DP, LN, QCH, GROUP = prm.DP, prm.LN, prm.QCH, prm.GROUPT
    neg_inf, zero = prm.neg_inf, prm.zero

    @T.macro
    def merge_tile(cache_lens, cu, part_o, part_ml, out, tile):
        mg = T.decl_buffer((3,), "float32")       # max m, sum l, 1 / sum l
        wt = T.decl_buffer((C,), "float32")
        o = T.decl_buffer((DP,), "float32")
        # all the blocks; the groups before row bb's; the tile's batch row (-1: past the
        # call's groups), its first group, the blocks before that group
        cnt = T.decl_buffer((5,), "int32")
        cnt[0] = 0
        cnt[1] = 0
        cnt[2] = -1
        for bb in range(B):
            groups = G * tiles_of(cu, bb)
            if cnt[2] < 0 and tile < cnt[1] + groups:
                cnt[2] = bb
                cnt[3] = cnt[1]
                cnt[4] = cnt[0]
            cnt[1] = cnt[1] + groups
            cnt[0] = cnt[0] + groups * n_blocks(cache_lens, cu, bb)
        if cnt[2] >= 0:
            b = cnt[2]
            nrt = tiles_of(cu, b)
            nb = n_blocks(cache_lens, cu, b)
            begin = cnt[4] + (tile - cnt[3]) * nb
            stop = begin + nb
            g = (tile - cnt[3]) // nrt
            rt = (tile - cnt[3]) % nrt
            for r in range(RT):
                if rt * RT + r < rows_of(cu, b):
                    row = rt * RT + r
                    h = g * GROUP + row // count(cu, b)
                    t = row % count(cu, b)
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
                        out[first_row(cu, b) + t, h * d + c] = out_value(o[c] * mg[2])

    return merge_tile


def decode_function(prm, rules):
    """The decode PrimFunc for record prm (DecodeParams), the call's scalars still free:
    (qkv, cache_lens, [cu_seqlens,] [block_tables,] k_cache, v_cache, part_o, part_ml, att),
    cu_seqlens in packed builds, block_tables with a paged cache."""
    worker_task, merge_tile = task_macros(prm, rules)
    NP, M, PW, B, G, N, d, CD = prm.NP, prm.M, prm.PW, prm.B, prm.G, prm.N, prm.d, prm.CD
    NP_MAX, RT, DP, MA, HD, C, NG = prm.NP_MAX, prm.RT, prm.DP, prm.MA, prm.HD, prm.C, prm.NG
    # the caches: [B, G, N, d], or pools [blocks (the call's), G, BS, d] and block tables
    cache_shape = (B, G, N, d) if prm.BS is None else (tirx.Var("num_blocks", "int32"), G,
                                                        prm.BS, d)
    cu = tirx.decl_buffer((B + 1,), "int32", name="cu_seqlens") if prm.packed else None
    tables = tirx.decl_buffer((B, -(-N // prm.BS)), "int32", name="block_tables") \
        if prm.BS is not None else None

    @T.prim_func(check_well_formed=False)   # free scalars until with_scalars
    def attention(qkv: T.Buffer((NP, M, PW), "float32"),
                  cache_lens: T.Buffer((B,), "int32"),
                  k_cache: T.Buffer(cache_shape, CD),
                  v_cache: T.Buffer(cache_shape, CD),
                  part_o: T.Buffer((NP_MAX, RT, DP), "float32"),
                  part_ml: T.Buffer((NP_MAX, 2, RT), "float32"),
                  out: T.Buffer((MA, HD), "float32")):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        # the call's key blocks, group after group ((batch row, K/V head, row tile) in
        # order), cut into one contiguous share per worker: every worker runs the same
        # work whatever the rows' cache lengths, and streams one stretch of the cache
        for worker in T.parallel(C):
            worker_task(qkv, cache_lens, cu, tables, k_cache, v_cache, part_o, part_ml, worker)
        # merge each row's pieces: out = sum_p 2^(m_p - m) O_p / sum_p 2^(m_p - m) l_p, the
        # pieces of group j being partials j + t of the workers t whose shares meet it
        for tile in T.parallel(NG):
            merge_tile(cache_lens, cu, part_o, part_ml, out, tile)

    return with_buffers(attention, 2, [b for b in (cu, tables) if b is not None])


def with_buffers(func, at, buffers):
    """func with `buffers` (free while it was parsed) inserted as parameters at position
    `at`, in order (as attention_common.with_scalars appends the score tables)."""
    if not buffers:
        return func
    params = list(func.params)
    return tirx.PrimFunc(params[:at] + list(buffers) + params[at:], func.body, func.ret_type,
                         func.attrs)
