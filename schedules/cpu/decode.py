"""Decoding with a K/V cache on CPUs (x86 and aarch64 alike): the cache append and a
split-KV ("flash-decoding") attention template.

cache_append  the new tokens' K and V rows (where the QKV GEMM wrote them, each head
              padded to the lanes) copied into k_cache / v_cache [B, G, max_len, d] at row
              cache_lens[b] + t; one parallel task per new token.
attention     a decode step has one query per head (or a few: S new tokens x the query heads
              sharing a K/V head), too few to fill the prefill template's vector lanes
              (there lanes are queries). Here lanes run along head_dim instead (a score is
              a dot product and a horizontal sum; tiles of 8 or more rows, the query heads
              of a K/V head x the tokens, put the rows in the lanes for the scores:
              rows_in_lanes), and the keys are split ("flash-decoding"): the call's key
              blocks, group after group (a group: batch row, K/V head, row tile, where the
              rows are the GROUP x S queries that read that K/V head), are cut into
              `workers` even, contiguous shares (balanced_share), one parallel task each
              (one a core by default), as Stream-K cuts a GEMM's k loops.
              A task walks the pieces of groups its share meets with the online softmax
              (scores in log2 units, as the prefill template), each leaving an unnormalised
              partial (O, m, l); a second parallel loop merges each group's pieces: O = sum_p
              2^(m_p - m) O_p, l = sum_p 2^(m_p - m) l_p, out = O / l (0 for a row that saw
              no key). Only the call's keys (kv_len = cache_lens[b] + S) count, so every
              thread runs the same work whatever the rows' cache lengths (splits of the
              cache had left a thread the long row), and each task streams one stretch of
              the cache (not splits interleaved with the rows or with each other; measured:
              benchmarks/PERFORMANCE.md, Schedule decisions).
              Each K and V row is read from memory once per piece (the rows of a tile reuse
              it from L1): the step is bound by reading the cache.
Positions are absolute: query t of row b is at q_idx = cache_lens[b] + t; every score goes
through the mask (no block table: the cache length is known only per call).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tvm.script import tirx as T

from mhagen.blockmask import conjuncts
from mhagen.ir import expr as ex
from mhagen.lower.te import LOG2E, call_scalars
from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, with_scalars
from mhagen.schedules.x86 import denormals
from mhagen.schedules.x86.bf16_dot import with_llvm_ir
from mhagen.schedules.cpu.fast_math import SCORE_MATH, exp2, f32


@dataclass(frozen=True)
class DecodeConfig:
    row_tile: int
    """query rows per task (of the GROUP x S rows that read one K/V head)."""
    workers: int
    """parallel tasks (one a core by default): each takes an even, contiguous share of the
    call's key blocks over all (batch row, K/V head, row tile) groups, in order
    (balanced_share)."""
    kv_block: int
    """keys per online-softmax step."""
    lanes: int
    """floats per vector along head_dim."""


def balanced_share(worker, workers, total):
    """[lo, hi) of the `total` work units (key blocks, every group's in a row) that
    `worker` of `workers` runs: even shares, each a contiguous run. ints or TIR (int32:
    t * total // workers as t * q + t * r // workers, total = q * workers + r, so no
    product exceeds total or workers^2)."""
    def start(t):
        return total // workers * t + total % workers * t // workers
    return start(worker), start(worker + 1)


def decode_kv_block(row_tile, lanes):
    """Keys per online-softmax step. Lanes along head_dim: 8 per query row of the tile, 16
    to 64: a block's fixed cost per row (its max, exp2 and rescale of O) wants many keys
    when rows are many; with one or two rows the step streams the cache, and short blocks
    keep the K and V streams both in flight. Rows in the lanes (rows_in_lanes): 16 keys,
    whose K and V blocks (4 KiB each at head_dim 64) stay in L1 while every row of the tile
    reads V. The measurements: benchmarks/PERFORMANCE.md, Schedule decisions."""
    if rows_in_lanes(row_tile, lanes):
        return round_up(16, lanes)
    return round_up(min(64, max(16, 8 * row_tile)), lanes)


def decode_layout(w, cfg):
    rows = w["heads"] // w["kv_heads"] * w["seq"]
    n_row_tiles = -(-rows // cfg.row_tile)
    groups = w["batch"] * w["kv_heads"] * n_row_tiles
    # a group's blocks split over the workers whose shares meet them: group j's piece of
    # worker t is partial j + t (shares are contiguous runs, so no two pieces meet there)
    return {"rows": rows, "n_row_tiles": n_row_tiles, "groups": groups,
            "partials": groups + cfg.workers - 1}


class DecodeRule:
    """The split-KV attention of decoding layers (mhagen/lower/fused.py, cache branch)."""
    name = "decode_attention"
    flush_denormals = False   # the x86 backend's rule flushes them (schedules/x86/denormals.py)

    def applies(self, stage, target):
        return stage.pattern == "decode_template"

    def default_config(self, workload, target):
        rows = workload["heads"] // workload["kv_heads"] * workload["seq"]
        row_tile = min(rows, 16)
        padded = round_up(row_tile, target.lanes)
        if (row_tile >= 8 and not rows_in_lanes(row_tile, target.lanes) and padded <= 16
                and rows_in_lanes(padded, target.lanes) and 3 * padded <= 4 * row_tile):
            # rows in the lanes pay for a few copied rows (AVX2, 12 rows a K/V head in a
            # tile of 16: benchmarks/PERFORMANCE.md, Schedule decisions)
            row_tile = padded
        # one task a core: TVM runs a parallel loop's tasks in static, contiguous chunks a
        # thread, so more tasks balance nothing and add partials to merge (against 4 a
        # core: benchmarks/PERFORMANCE.md, Schedule decisions)
        return DecodeConfig(row_tile=row_tile, workers=max(1, target.cores),
                            kv_block=decode_kv_block(row_tile, target.lanes),
                            lanes=target.lanes)

    def make_config(self, values: dict, target, workload) -> DecodeConfig:
        """A config from a tuning record, checked against the template's constraints and
        bounded by the workload (an edited record's row tile of 10^6 rows hung the build;
        2^31 workers overflowed its int32 indices)."""
        cfg = DecodeConfig(**{k: int(values[k]) for k in
                              ("row_tile", "workers", "kv_block", "lanes")})
        rows = decode_layout(workload, cfg)["rows"] if cfg.row_tile >= 1 else 0
        if (min(cfg.row_tile, cfg.workers, cfg.kv_block) < 1 or cfg.lanes != target.lanes
                or cfg.kv_block % cfg.lanes
                or cfg.row_tile > round_up(max(rows, 16), cfg.lanes)
                or cfg.workers > 64 * max(1, target.cores)
                or cfg.kv_block > max(round_up(workload["cache"], cfg.lanes), 128)):
            raise ValueError(f"{cfg} breaks the template's constraints for {target.name} "
                             f"({target.lanes} lanes)")
        return cfg

    def candidates(self, workload, target) -> list:
        """Configs worth measuring (the tuning space of this template), the default first:
        1, 2, 4 or 8 tasks a core; key blocks of 16 to 128 (whole vectors); row tiles of
        the default's, and of 4 and 8 rows where a K/V head has more query rows (smaller
        tiles read the head's keys once per tile, but give more tasks)."""
        default = self.default_config(workload, target)
        cores = max(1, target.cores)
        tiles = [default.row_tile] + [t for t in (8, 4) if t < default.row_tile]
        out = [default]
        for row_tile in tiles:
            for per_core in (1, 2, 4, 8):
                for kv_goal in (16, 32, 64, 128):
                    c = replace(default, row_tile=row_tile, workers=per_core * cores,
                                kv_block=round_up(kv_goal, target.lanes))
                    if c not in out:
                        out.append(c)
        return out

    def build(self, w, cfg, target):
        return build_decode(w, cfg, target.vector_registers, flush=self.flush_denormals)

    def partial_shapes(self, w, cfg):
        """Shapes of the two temporaries of partial results: O [partials, row_tile, padded
        d] and (m, l) [partials, 2, row_tile]."""
        n = decode_layout(w, cfg)["partials"]
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
    CD = w.get("cache_dtype", "float32")
    assert PW % LN == 0 and DP % LN == 0 and K_BASE % LN == 0 and V_BASE % LN == 0

    def stored(value):
        """A K/V value as the cache stores it (a half cache: rounded, nearest even)."""
        return value if CD == "float32" else T.Cast(CD, value)

    @T.macro
    def copy_head(qkv, cache, base, b, g, t, pos):
        for ch in range(NCH):
            for ln in T.vectorized(LN):
                cache[b, g, pos, ch * LN + ln] = stored(qkv[(base + g * DP + ch * LN) // PW,
                                                            b * S + t,
                                                            (base + g * DP + ch * LN) % PW + ln])
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                cache[b, g, pos, NCH * LN + ln] = stored(qkv[(base + g * DP + NCH * LN) // PW,
                                                             b * S + t,
                                                             (base + g * DP + NCH * LN) % PW
                                                             + ln])

    @T.prim_func(check_well_formed=False)   # free scalars until they become parameters
    def cache_append(qkv: T.Buffer((NP, M, PW), "float32"),
                     cache_lens: T.Buffer((B,), "int32"),
                     k_cache: T.Buffer((B, G, N, d), CD),
                     v_cache: T.Buffer((B, G, N, d), CD)):
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


def rows_in_lanes(row_tile, lanes):
    """Whether a tile's scores put its query rows in the vector lanes (8, 12 or 16 rows:
    the query heads of a K/V head x the new tokens): a multiply-add per head_dim column
    then makes a score for every row, with no horizontal sum per score; fewer than 8 rows
    keep the lanes along head_dim, where they ran faster. A row vector fits one register or
    is whole registers: 12 rows on 8 lanes (AVX2) came out of LLVM as lane inserts through
    the stack. The measurements: benchmarks/PERFORMANCE.md, Schedule decisions."""
    return row_tile >= 8 and row_tile % 4 == 0 and (row_tile <= lanes or row_tile % lanes == 0)


def keys_in_flight(row_tile, lanes, registers, kv_block):
    """Keys whose row-lane scores accumulate at once: as many as the registers hold (4 kept
    for Q^T and K's broadcasts), at most 8, a power of two dividing kv_block (fewer were
    slower: benchmarks/PERFORMANCE.md, Schedule decisions). A key's row vector
    takes whole registers: 12 rows on 8 lanes take 2 (8 keys of them spilled)."""
    fit = max(1, (registers - 4) // -(-row_tile // lanes))
    ju = 1
    while ju * 2 <= min(8, fit) and kv_block % (ju * 2) == 0:
        ju *= 2
    return ju


def build_decode(w, cfg, registers=16, flush=False):
    """The decode attention PrimFunc (qkv, cache_lens, k_cache, v_cache, part_o, part_ml,
    att) for workload w; registers: the target's vector registers; flush: the workers run
    with denormals flushed to zero (x86: denormals.py)."""
    H, G, d = w["heads"], w["kv_heads"], w["head_dim"]
    DP, N, PW = w["head_dim_padded"], w["cache"], w["panel"]
    NP, M, MA = w["qkv_width"] // PW, w["rows"], w["att_rows"]
    Q_BASE, HD, GROUP = w["q_base"], H * d, H // G
    L = decode_layout(w, cfg)
    R, NRT, NG, NP_MAX = L["rows"], L["n_row_tiles"], L["groups"], L["partials"]
    RT, C, KB, LN = cfg.row_tile, cfg.workers, cfg.kv_block, cfg.lanes
    NCH, TAIL = _chunks(d, LN)
    QCH = DP // LN    # vectors of an O row (rows go a vector at a time: see rescaled_row)
    ROW_LANES = rows_in_lanes(RT, LN)
    JU = keys_in_flight(RT, LN, registers, KB)
    CD = w.get("cache_dtype", "float32")
    assert KB % LN == 0 and PW % LN == 0 and DP % LN == 0 and Q_BASE % LN == 0
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
        NG = B * G * NRT
        M = MA = (B * S + w["row_tile"] - 1) // w["row_tile"] * w["row_tile"]

    assert LN in (4, 8, 16), LN

    def loaded(value):
        """A K/V value read from the cache, as float32 (a half cache converts it)."""
        return value if CD == "float32" else T.Cast("float32", value)

    def masked_score(value, b, h, qpos, kv, kv_len):
        """A scaled score with the score modifier applied, or -inf where the mask hides it."""
        return T.Select(rules.visible(b, h, qpos, kv, kv_len=kv_len),
                        rules.modified(value, b, h, qpos, kv, kv_len), neg_inf)

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

    @T.macro
    def block_rows_in_lanes(cache_lens, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml, o_row,
                            b, g, rt, slot, k0, kv_len):
        # scores of JU keys at a time for all RT rows, rows in the lanes: S[j, rows] +=
        # Q^T[c, rows] * K[j, c] over head_dim c (K[j, c] a broadcast)
        for jo in range(KB // JU):
            for u in T.unroll(JU):
                for ln in T.vectorized(RT):
                    sacc[u, ln] = zero
            for c in range(d):
                for u in T.unroll(JU):
                    for ln in T.vectorized(RT):
                        sacc[u, ln] = sacc[u, ln] + qt[c, ln] * loaded(k_cache[
                            b, g, T.min(k0 + jo * JU + u, N - 1), c])
            for u in T.unroll(JU):
                for r in range(RT):
                    row = T.min(rt * RT + r, R - 1)
                    h = g * GROUP + row // S
                    qpos = cache_lens[b] + row % S
                    kv = k0 + jo * JU + u
                    sr[jo * JU + u, r] = masked_score(sacc[u, r], b, h, qpos, kv, kv_len)
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
        for r in range(RT):
            rescaled_row(o_row, part_o, slot, r, sm[2, r])
            for j in range(KB):
                if sr[j, r] != zero:
                    add_values(o_row, v_cache, sr[j, r], b, g, T.min(k0 + j, N - 1))
            stored_row(part_o, slot, r, o_row)

    def kv_len_of(cache_lens, b):
        """The keys batch row b sees in this call: its cached keys and the new ones."""
        return T.min(cache_lens[b] + S, N)

    def n_blocks(cache_lens, b):
        """Key blocks of batch row b in this call."""
        return (kv_len_of(cache_lens, b) + KB - 1) // KB

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
        k_end = T.min(kv_len, cache_lens[b] + t_last + 1) if causal else kv_len
        for r in range(RT):
            row = T.min(rt * RT + r, R - 1)          # rows past R: copies, never stored
            h = g * GROUP + row // S
            t = row % S
            for ch in range(QCH):
                for ln in T.vectorized(LN):
                    qb[r, ch * LN + ln] = qkv[(Q_BASE + h * DP + ch * LN) // PW, b * S + t,
                                              (Q_BASE + h * DP + ch * LN) % PW + ln] * c_log2e
            for ch in T.unroll(QCH):
                for ln in T.vectorized(LN):
                    part_o[slot, r, ch * LN + ln] = zero
            ml[0, r] = neg_inf
            ml[1, r] = zero
            if ROW_LANES:
                for c in range(d):
                    qt[c, r] = qb[r, c]
        for kb in range(first, end):
            k0 = kb * KB
            if ROW_LANES and k0 < k_end:
                block_rows_in_lanes(cache_lens, k_cache, v_cache, part_o, qt, sr, sacc, sm, ml,
                                    o_row, b, g, rt, slot, k0, kv_len)
            if not ROW_LANES and k0 < k_end:
                for r in range(RT):
                    row = T.min(rt * RT + r, R - 1)
                    h = g * GROUP + row // S
                    qpos = cache_lens[b] + row % S
                    for j in range(KB):
                        dot_rows(qb, k_cache, acc, r, b, g, T.min(k0 + j, N - 1))
                        s_buf[j] = masked_score(acc[0], b, h, qpos, k0 + j, kv_len)
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
                    rescaled_row(o_row, part_o, slot, r, st[1])
                    for j in range(KB):
                        if s_buf[j] != zero:
                            add_values(o_row, v_cache, s_buf[j], b, g, T.min(k0 + j, N - 1))
                    stored_row(part_o, slot, r, o_row)
        for r in range(RT):
            part_ml[slot, 0, r] = ml[0, r]
            part_ml[slot, 1, r] = ml[1, r]


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
        # merge each row's pieces: out = sum_p 2^(m_p - m) O_p / sum_p 2^(m_p - m) l_p, the
        # pieces of group j being partials j + t of the workers t whose shares meet it
        for tile in T.parallel(NG):
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
                        out[b * S + t, h * d + c] = o[c] * mg[2]

    attention = with_llvm_ir(attention, denormals.HELPERS if flush else "")   # MXCSR helpers
    return with_scalars(attention, rules.scalars, rules.tables)
