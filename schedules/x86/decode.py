"""Decoding with a K/V cache on CPUs (x86 and aarch64 alike): the cache append and a
split-KV ("flash-decoding") attention template.

cache_append  the new tokens' K and V rows (where the QKV GEMM wrote them, each head
              padded to the lanes) copied into k_cache / v_cache [B, G, max_len, d] at row
              cache_lens[b] + t; one parallel task per new token.
attention     a decode step has one query per head (or a few: S new tokens x the query heads
              sharing a K/V head), too few to fill the prefill template's vector lanes
              (there lanes are queries). Here lanes run along head_dim instead, and the keys
              are split: one parallel task per (batch, K/V head, row tile, key split), where
              the rows are the GROUP x S queries that read that K/V head. A task walks its
              keys in blocks of kv_block with the online softmax (scores in log2 units, as
              the prefill template) and leaves an unnormalised partial (O, m, l); a second
              parallel loop merges the splits of each row: O = sum_s 2^(m_s - m) O_s,
              l = sum_s 2^(m_s - m) l_s, out = O / l (0 for a row that saw no key). A
              row's splits share the keys of its call, kv_len = cache_lens[b] + S, so a
              short cache costs little in a long one and its splits stay even. Each K and
              V row is read from memory once per task (the rows of a tile reuse it from
              L1): the step is bound by reading the cache. Tasks run batch row outermost:
              each thread then streams its own contiguous part of the cache (with the
              split or the batch row innermost, 1.15x and 1.3x the time at full caches,
              so rows of very different lengths are not balanced across threads).
Positions are absolute: query t of row b is at q_idx = cache_lens[b] + t; every score goes
through the mask (no block table: the cache length is known only per call).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.blockmask import conjuncts
from mhagen.ir import expr as ex
from mhagen.lower.te import LOG2E, call_scalars
from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, with_scalars
from mhagen.schedules.x86.fast_math import SCORE_MATH, exp2, f32


@dataclass(frozen=True)
class DecodeConfig:
    row_tile: int
    """query rows per task (of the GROUP x S rows that read one K/V head)."""
    split: int
    """keys per task (a multiple of kv_block): the cache is cut into max_len / split parts."""
    kv_block: int
    """keys per online-softmax step."""
    lanes: int
    """floats per vector along head_dim."""


def split_span(kv_len, n_splits, kv_block):
    """Keys per split of a row whose call sees kv_len keys: the n_splits splits share them
    in whole key blocks (at most the config's split, since kv_len <= the cache's length).
    With splits of the cache's length, a step at 1024 of 4096 keys (1 K/V head, 8 splits of
    512) left its work to the first 2 splits, both in one thread's run of 4: the attention
    0.76x the time now (2 threads, AVX-512, Zen 4; 300 keys: 0.88x; a full cache 1.00x).
    ints or TIR expressions."""
    return ((kv_len + n_splits - 1) // n_splits + kv_block - 1) // kv_block * kv_block


def decode_layout(w, cfg):
    rows = w["heads"] // w["kv_heads"] * w["seq"]
    n_row_tiles = -(-rows // cfg.row_tile)
    n_splits = -(-w["cache"] // cfg.split)
    tasks = w["batch"] * w["kv_heads"] * n_row_tiles * n_splits
    return {"rows": rows, "n_row_tiles": n_row_tiles, "n_splits": n_splits, "tasks": tasks}


class DecodeRule:
    """The split-KV attention of decoding layers (mhagen/lower/fused.py, cache branch)."""
    name = "decode_attention"

    def applies(self, stage, target):
        return stage.pattern == "decode_template"

    def default_config(self, workload, target):
        rows = workload["heads"] // workload["kv_heads"] * workload["seq"]
        row_tile = min(rows, 16)
        kv_block = 64
        # enough tasks for every core several times over when the cache is full, in splits
        # of at least 256 keys (a split's partial costs row_tile x head_dim floats to merge)
        per_split = workload["batch"] * workload["kv_heads"] * -(-rows // row_tile)
        want = -(-4 * target.cores // per_split)
        split = max(256, -(-workload["cache"] // want))
        split = min(round_up(split, kv_block), round_up(workload["cache"], kv_block))
        return DecodeConfig(row_tile=row_tile, split=split, kv_block=kv_block,
                            lanes=target.lanes)

    def build(self, w, cfg, target):
        return build_decode(w, cfg)

    def partial_shapes(self, w, cfg):
        """Shapes of the two temporaries of partial results: O [tasks, row_tile, padded d]
        and (m, l) [tasks, 2, row_tile]."""
        n = decode_layout(w, cfg)["tasks"]
        return (n, cfg.row_tile, w["head_dim_padded"]), (n, 2, cfg.row_tile)


@dataclass(frozen=True)
class CacheAppendConfig:
    lanes: int
    """floats per vector copied along head_dim."""


class CacheAppendRule:
    name = "cache_append"

    def applies(self, stage, target):
        return stage.pattern == "cache_append_template"

    def default_config(self, workload, target):
        return CacheAppendConfig(lanes=target.lanes)

    def build(self, w, cfg, target):
        return build_cache_append(w, cfg)


def _chunks(d, lanes):
    """(whole vectors, tail floats) covering d columns."""
    return d // lanes, d % lanes


def build_cache_append(w, cfg):
    B, S, G, d, DP = w["batch"], w["seq"], w["kv_heads"], w["head_dim"], w["head_dim_padded"]
    N, PW = w["cache"], w["panel"]
    NP, M = w["qkv_width"] // PW, w["rows"]
    scalars = ()
    if w.get("symbolic"):      # the call's number of new tokens (symbolic-length builds)
        scalars = B, S = call_scalars()
        M = (B * S + w["row_tile"] - 1) // w["row_tile"] * w["row_tile"]
    K_BASE, V_BASE = w["k_base"], w["v_base"]
    LN = cfg.lanes
    NCH, TAIL = _chunks(d, LN)
    assert PW % LN == 0 and DP % LN == 0 and K_BASE % LN == 0 and V_BASE % LN == 0

    @T.macro
    def copy_head(qkv, cache, base, b, g, t, pos):
        for ch in range(NCH):
            for ln in T.vectorized(LN):
                cache[b, g, pos, ch * LN + ln] = qkv[(base + g * DP + ch * LN) // PW, b * S + t,
                                                     (base + g * DP + ch * LN) % PW + ln]
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                cache[b, g, pos, NCH * LN + ln] = qkv[(base + g * DP + NCH * LN) // PW,
                                                      b * S + t,
                                                      (base + g * DP + NCH * LN) % PW + ln]

    @T.prim_func(check_well_formed=False)   # free scalars until they become parameters
    def cache_append(qkv: T.Buffer((NP, M, PW), "float32"),
                     cache_lens: T.Buffer((B,), "int32"),
                     k_cache: T.Buffer((B, G, N, d), "float32"),
                     v_cache: T.Buffer((B, G, N, d), "float32")):
        T.func_attr({"global_symbol": "cache_append", "tirx.noalias": True})
        for task in T.parallel(B * S):
            b = task // S
            t = task % S
            pos = cache_lens[b] + t
            if pos < N:       # the caller checks lens + S <= max_len; never write past it
                for g in range(G):
                    copy_head(qkv, k_cache, K_BASE, b, g, t, pos)
                    copy_head(qkv, v_cache, V_BASE, b, g, t, pos)

    return with_scalars(cache_append, scalars)


def build_decode(w, cfg):
    """The decode attention PrimFunc (qkv, cache_lens, k_cache, v_cache, part_o, part_ml,
    att) for workload w."""
    H, G, d = w["heads"], w["kv_heads"], w["head_dim"]
    DP, N, PW = w["head_dim_padded"], w["cache"], w["panel"]
    NP, M, MA = w["qkv_width"] // PW, w["rows"], w["att_rows"]
    Q_BASE, HD, GROUP = w["q_base"], H * d, H // G
    L = decode_layout(w, cfg)
    R, NRT, NS, NT = L["rows"], L["n_row_tiles"], L["n_splits"], L["tasks"]
    NT_MAX = NT                   # the partial temporaries: sized for the largest call
    RT, SPLIT, KB, LN = cfg.row_tile, cfg.split, cfg.kv_block, cfg.lanes
    NCH, TAIL = _chunks(d, LN)
    QCH = DP // LN
    assert SPLIT % KB == 0 and KB % LN == 0 and PW % LN == 0 and DP % LN == 0 and Q_BASE % LN == 0
    c_log2e = f32(w["scale"] * LOG2E)
    neg_inf, zero = f32(float("-inf")), f32(0.0)
    mask = w.get("mask")
    # a causal part (kv_idx <= q_idx) bounds a row tile's keys by its last query's position:
    # a prompt's tile skips the blocks above the diagonal, as the prefill template does
    causal = mask is not None and any(p == ex.causal() for p in conjuncts(mask))

    rules = ScoreRules(w, SCORE_MATH)   # the mask and modifier, as the prefill template
    B, S = rules.batch, rules.seq       # ints, or the call's (symbolic-length builds)
    if rules.symbolic:
        R = GROUP * S
        NRT = (R + RT - 1) // RT
        NT = B * G * NRT * NS
        M = MA = (B * S + w["row_tile"] - 1) // w["row_tile"] * w["row_tile"]

    assert LN in (4, 8, 16), LN

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
                acc[ln] = acc[ln] + qb[r, ch * LN + ln] * k_cache[b, g, kr, ch * LN + ln]
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                acc[ln] = acc[ln] + qb[r, NCH * LN + ln] * k_cache[b, g, kr, NCH * LN + ln]
        lane_sum(acc)

    @T.macro
    def add_values(part_o, v_cache, p, task, r, b, g, kr):
        for ch in range(NCH):
            for ln in T.vectorized(LN):
                part_o[task, r, ch * LN + ln] = part_o[task, r, ch * LN + ln] + p * v_cache[
                    b, g, kr, ch * LN + ln]
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                part_o[task, r, NCH * LN + ln] = part_o[task, r, NCH * LN + ln] + p * v_cache[
                    b, g, kr, NCH * LN + ln]

    @T.prim_func(check_well_formed=False)   # free scalars until with_scalars
    def attention(qkv: T.Buffer((NP, M, PW), "float32"),
                  cache_lens: T.Buffer((B,), "int32"),
                  k_cache: T.Buffer((B, G, N, d), "float32"),
                  v_cache: T.Buffer((B, G, N, d), "float32"),
                  part_o: T.Buffer((NT_MAX, RT, DP), "float32"),
                  part_ml: T.Buffer((NT_MAX, 2, RT), "float32"),
                  out: T.Buffer((MA, HD), "float32")):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        for task in T.parallel(NT):
            qb = T.decl_buffer((RT, DP), "float32")
            s_buf = T.decl_buffer((KB,), "float32")
            acc = T.decl_buffer((LN,), "float32")
            st = T.decl_buffer((4,), "float32")     # m', alpha, sum p, subtracted max
            b = task // (G * NRT * NS)
            g = task // (NRT * NS) % G
            rt = task // NS % NRT
            sp = task % NS
            kv_len = T.min(cache_lens[b] + S, N)
            # the row's splits share the call's keys evenly (in whole key blocks), not the
            # cache's: a split past a short cache would do nothing while its neighbours in
            # the same thread's run did the work (split_span)
            span = split_span(kv_len, NS, KB)
            # the keys this tile may see: up to its last query's position when causal (its
            # rows run over heads, then tokens: a tile within one head ends at token
            # (last row) % S, one that crosses heads reaches token S - 1)
            last = T.min(rt * RT + RT - 1, R - 1)
            t_last = T.Select((rt * RT) // S == last // S, last % S, S - 1)
            k_end = T.min(kv_len, cache_lens[b] + t_last + 1) if causal else kv_len
            for r in range(RT):
                row = T.min(rt * RT + r, R - 1)          # rows past R: copies, never stored
                h = g * GROUP + row // S
                t = row % S
                for ch in range(QCH):
                    for ln in T.vectorized(LN):
                        qb[r, ch * LN + ln] = qkv[(Q_BASE + h * DP + ch * LN) // PW, b * S + t,
                                                  (Q_BASE + h * DP + ch * LN) % PW + ln] * c_log2e
                for c in T.vectorized(DP):
                    part_o[task, r, c] = zero
                part_ml[task, 0, r] = neg_inf
                part_ml[task, 1, r] = zero
            for kb in range(SPLIT // KB):
                k0 = sp * span + kb * KB
                if kb * KB < span and k0 < k_end:
                    for r in range(RT):
                        row = T.min(rt * RT + r, R - 1)
                        h = g * GROUP + row // S
                        qpos = cache_lens[b] + row % S
                        for j in range(KB):
                            dot_rows(qb, k_cache, acc, r, b, g, T.min(k0 + j, N - 1))
                            s_buf[j] = T.Select(
                                rules.visible(b, h, qpos, k0 + j, kv_len=kv_len),
                                rules.modified(acc[0], b, h, qpos, k0 + j, kv_len), neg_inf)
                        # m' = max(m, scores), P = 2^(S - m'), sum P: vectors over keys
                        for ln in T.vectorized(LN):
                            acc[ln] = part_ml[task, 0, r]
                        for jo in range(KB // LN):
                            for ln in T.vectorized(LN):
                                acc[ln] = T.max(acc[ln], s_buf[jo * LN + ln])
                        lane_max(acc)
                        st[0] = acc[0]
                        st[3] = T.Select(st[0] == neg_inf, zero, st[0])
                        st[1] = exp2(part_ml[task, 0, r] - st[3])
                        for ln in T.vectorized(LN):
                            acc[ln] = zero
                        for jo in range(KB // LN):
                            for ln in T.vectorized(LN):
                                # a masked score (-inf) gives exactly 0 (exp2)
                                s_buf[jo * LN + ln] = exp2(s_buf[jo * LN + ln] - st[3])
                                acc[ln] = acc[ln] + s_buf[jo * LN + ln]
                        lane_sum(acc)
                        st[2] = acc[0]
                        part_ml[task, 1, r] = part_ml[task, 1, r] * st[1] + st[2]
                        part_ml[task, 0, r] = st[0]
                        for c in T.vectorized(DP):
                            part_o[task, r, c] = part_o[task, r, c] * st[1]
                        for j in range(KB):
                            if s_buf[j] != zero:
                                add_values(part_o, v_cache, s_buf[j], task, r, b, g,
                                           T.min(k0 + j, N - 1))
        # merge the splits of each row: out = sum_s 2^(m_s - m) O_s / sum_s 2^(m_s - m) l_s
        for tile in T.parallel(B * G * NRT):
            mg = T.decl_buffer((3,), "float32")       # max m, sum l, 1 / sum l
            wt = T.decl_buffer((NS,), "float32")
            o = T.decl_buffer((DP,), "float32")
            b = tile // (G * NRT)
            g = tile // NRT % G
            rt = tile % NRT
            for r in range(RT):
                if rt * RT + r < R:
                    row = rt * RT + r
                    h = g * GROUP + row // S
                    t = row % S
                    mg[0] = neg_inf
                    for s in range(NS):
                        mg[0] = T.max(mg[0], part_ml[tile * NS + s, 0, r])
                    mg[0] = T.Select(mg[0] == neg_inf, zero, mg[0])
                    mg[1] = zero
                    for s in range(NS):
                        wt[s] = exp2(part_ml[tile * NS + s, 0, r] - mg[0])   # 0 for -inf
                        mg[1] = mg[1] + wt[s] * part_ml[tile * NS + s, 1, r]
                    mg[2] = T.Select(mg[1] > zero, T.float32(1) / mg[1], zero)
                    for c in T.vectorized(DP):
                        o[c] = zero
                    for s in range(NS):
                        for c in T.vectorized(DP):
                            o[c] = o[c] + wt[s] * part_o[tile * NS + s, r, c]
                    for c in range(d):
                        out[b * S + t, h * d + c] = o[c] * mg[2]

    return with_scalars(attention, rules.scalars, rules.tables)
