"""Fused attention template for CPUs with wide vectors (flash-style online softmax).

One parallel task per (batch, head, query tile of q_tile rows). The task works on transposed
scores: rows are keys, vector lanes are queries. So it reads K and V where the QKV GEMM wrote
them (no K^T copy), and every softmax reduction runs down the rows, lane-wise, with no
horizontal reduction. The task first copies its Q tile transposed and scaled by
scale * log2(e) (Q^T, d x q_tile). Then, for each key block of kv_block keys that the block
table does not skip:
    S^T = K Q^T in register tiles of tile_rows keys x tile_cols queries; the tile's write-back
          applies the mask (partial blocks only) and folds in the running max m' = max(m, S^T);
    P^T = 2^(S^T - m'), l = l 2^(m - m') + sum_keys P^T (lane-wise over queries);
    O = O 2^(m - m') + P V in register tiles of at most out_rows queries (their heights one
        apart: q_tile need not be a multiple of out_rows) x out_cols head columns (the
        rescale happens when the tile is loaded), V rows read straight from qkv.
Partial blocks differ from full ones only in the write-back's mask: their key rows stay
affine (no clamp per row, which cost 4 integer instructions per broadcast; see
benchmarks/PERFORMANCE.md, Schedule decisions). Only a block that runs past the last
key is cut: its S^T tiles stop at the tile holding the last key (that tile alone clamps its
rows) and P V stops at the last key: seq 512 in key blocks of 132 computes 4 padded keys in
S^T and none in P V, not 16 in both.
Both register tiles are sized from the target's vector registers (register_tiles): the
accumulators, the vectors they multiply and one broadcast fit without spills.
Finally out = O / l (a row that saw no key gives 0). Memory per task: q_tile x (kv_block +
2 head_dim) floats; the [S, S] score matrix never exists. The block table (built at build
time from the mask expression, like FlexAttention's BlockMask) marks each (query tile, key
block) as 0 skip, 1 partial (apply the mask), 2 full (no mask work): causal masks skip about
half the blocks.
bfloat16 pairs (work["pairs"], targets with AVX-512 BF16): qkv is bfloat16; Q^T is copied
unscaled as int32 pairs of head columns and the write-back applies the scale; S^T = K Q^T
and P V run on vdpbf16ps (bf16_dot), P packed into pairs of keys in bfloat16 and the block's
V rows zipped likewise; the softmax stays float32.
AMX tiles (work["amx"], AMX-BF16 targets, head_dim whole 32s: amx.py): qkv is bfloat16, Q^T
is copied as for pairs; S^T runs on tiles of 32 x 32 (key tiles and query tiles of 32), its
write-back reads the stored tile; P V runs as O^T = V^T P^T: the softmax's bfloat16 pairs
of P^T are its B tiles as packed, V^T its A tiles (the kernel's first parallel loop
transposes V once a call, into a workspace of V's size); O^T is rescaled lane-wise before
P V accumulates into it and turned back into rows at the task's end.
Pairs and AMX: the softmax writes P^T straight into bfloat16 pairs; without a score
modifier the scores stay unscaled until the softmax's exponent (LATE_SCALE). AVX-512: 2^t
on LLVM IR helpers (fast_math.EXP2_16: vreduceps, a polynomial, vscalefps).
"""
from dataclasses import dataclass, replace

import numpy as np
from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL, block_table
from mhagen.lower.te import LOG2E
from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, attention_entry
from mhagen.schedules.x86 import amx, denormals
from mhagen.schedules.x86.bf16_dot import DOT, HELPERS, PACK, ZIP, with_llvm_ir
from mhagen.schedules.cpu.fast_math import (EXP2_16, EXP2_16_BF16, EXP2_HELPER, SCORE_MATH,
                                            exp2, f32)
from mhagen.schedules.cpu.matmul import rows_that_fit
from mhagen.schedules.cpu.transpose import (TRANSPOSE_16_I32, TRANSPOSE_32_I16, transpose,
                                            transpose_words)

# register tiles: a stack array LLVM keeps in registers, not a TVM workspace allocation
ON_STACK = {"disable_lower_builtin": True}


@dataclass(frozen=True)
class AttentionConfig:
    q_tile: int
    """query rows per task (a multiple of tile_cols; where out_rows does not divide it, P V
    covers it in tiles one row apart)."""
    kv_block: int
    """keys per block of the online softmax (a multiple of tile_rows)."""
    tile_rows: int
    """keys per S^T register tile (unrolled)."""
    tile_cols: int
    """queries per S^T register tile (vectorised; a multiple of the lanes)."""
    out_rows: int = 8
    """queries per P V register tile (unrolled)."""
    out_cols: int = 32
    """head columns per P V register tile (vectorised; divides the padded head_dim)."""


def register_tiles(target, head_dim_padded, panel):
    """(tile_rows, tile_cols, out_rows, out_cols) for this target's registers.
    S^T: two vectors of queries, as many key rows as fit, at most 8: AVX-512 (32 zmm)
    8 x 32, AVX2 (16 ymm) 6 x 16, NEON 8 x 8 (the GEMMs' AVX-512 tile is 12 rows; key
    blocks here are whole S^T tiles, and 8 divides the block sizes and windows of 32 the
    defaults take). P V: the width (of 32, 16, 8 head columns dividing the padded head_dim
    and the panel) with the most accumulators: AVX-512 8 x 32, AVX2 6 x 16."""
    lanes, regs = target.lanes, target.vector_registers
    tile_rows, tile_cols = rows_that_fit(2, regs), 2 * lanes
    best = None
    for width in (32, 16, 8):
        if head_dim_padded % width or panel % width or width % lanes:
            continue
        rows = rows_that_fit(width // lanes, regs)
        if best is None or rows * width > best[0] * best[1]:
            best = (rows, width)
    out_rows, out_cols = best or (rows_that_fit(1, regs), lanes)
    return tile_rows, tile_cols, out_rows, out_cols


BAND_TILE = 32


def computed_scores(workload, cfg, states=(PARTIAL, FULL)) -> int:
    """Scores the template computes under cfg: the query tiles' rows x the key blocks the
    mask's block table does not skip (the first batch row and head where the table has
    several); states=(PARTIAL,): those it computes through the mask."""
    w = workload
    table = block_table(w["mask"], w["batch"], w["heads"], w["seq"], cfg.q_tile,
                        cfg.kv_block, lengths=bool(w.get("lengths")),
                        symbolic=bool(w.get("symbolic")))[0, 0]
    rows = np.minimum(cfg.q_tile, w["seq"] - cfg.q_tile * np.arange(table.shape[0]))
    return int((np.isin(table, states).sum(axis=1) * rows).sum() * cfg.kv_block)


def rows_dividing(n, most):
    """The most S^T key rows, at most `most` and at least 4, that divide n (None: none do):
    4 for AVX2's 6 and query tiles or bands of 16, 32 or 64."""
    return next((r for r in range(most, 3, -1) if n % r == 0), None)


def narrow_band_tiles(workload, cfg):
    """Query tiles and key blocks of BAND_TILE, aligned (S^T tiles of fewer key rows where
    the target's do not divide it: AVX2 4 x 16), when the mask's block table leaves them at
    most 0.8x the scores of cfg to compute: a band of keys per query, as a sliding window,
    whose wider tiles compute mostly hidden scores. A causal mask saves too little: cfg
    stays (the measurements: benchmarks/PERFORMANCE.md, Schedule decisions). None: keep
    cfg."""
    tr = rows_dividing(BAND_TILE, cfg.tile_rows)
    if BAND_TILE % cfg.tile_cols or tr is None or cfg.q_tile == cfg.kv_block == BAND_TILE:
        return None
    fine = replace(cfg, q_tile=BAND_TILE, kv_block=BAND_TILE, tile_rows=tr)
    if computed_scores(workload, fine) <= 0.8 * computed_scores(workload, cfg):
        return fine
    return None


def aligned_key_blocks(workload, cfg):
    """Key blocks as wide as the query tiles where the S^T tile's key rows do not divide
    them (AVX2's 6 rows, query tiles of 16, 32 or 64), with S^T tiles of the most rows up to
    cfg's that do (AVX2: 4), where that computes at most 3/4 of the scores through the mask:
    blocks of 36 or 66 keys straddle a causal diagonal's query tiles, each of which then
    meets two partial blocks, not one (measured: benchmarks/PERFORMANCE.md, Schedule
    decisions). None: keep cfg."""
    rows = rows_dividing(cfg.q_tile, cfg.tile_rows)
    if rows is None or rows == cfg.tile_rows:
        return None
    fine = replace(cfg, kv_block=cfg.q_tile, tile_rows=rows)
    if (computed_scores(workload, fine, (PARTIAL,))
            <= 0.75 * computed_scores(workload, cfg, (PARTIAL,))):
        return fine
    return None


def _balanced(total, goal, unit):
    """A tile size: a multiple of `unit` within [goal/2, 1.5 goal] (at least one unit) that
    covers `total` with the least padding, the closest to `goal` among those. Padding is
    work thrown away: 128 keys in blocks of 96 waste a third (benchmarks/PERFORMANCE.md,
    Schedule decisions)."""
    import math
    sizes = [k * unit for k in range(1, int(1.5 * goal) // unit + 1) if k * unit >= goal / 2]
    sizes = sizes or [unit]
    return min(sizes, key=lambda n: (-(-total // n) * n, abs(math.log2(n / goal))))


class AttentionRule:
    name = "attention"
    flush_denormals = False   # the x86 backend's rule flushes them (schedules/x86/denormals.py)

    def applies(self, stage, target):
        return stage.pattern == "attention_template"

    @staticmethod
    def tiles(workload, target):
        """(tile_rows, tile_cols, out_rows, out_cols): register_tiles, or on AMX S^T in
        tiles of 32 keys x 32 queries."""
        tiles = register_tiles(target, workload["head_dim_padded"], workload["panel"])
        if workload.get("amx"):
            return (amx.ROWS, amx.COLS) + tiles[2:]
        return tiles

    def default_config(self, workload, target):
        seq = workload["seq"]
        keys = workload.get("kv_seq") or seq    # the context's length in cross-attention
        tr, tc, orows, ocols = self.tiles(workload, target)
        # q_tile: whole S^T tiles (P V covers it in tiles one row apart where out_rows does
        # not divide it: AVX2's query tiles of 64, not 48, pad fewer queries; see
        # benchmarks/PERFORMANCE.md, Schedule decisions)
        q_tile = _balanced(seq, 64 if seq >= 256 else 32, tc)
        if seq < 256 and workload.get("mask") is None:
            # unmasked and short: ~64 where that pads no more queries and leaves every core 4
            # tasks; masked layers keep 32: a causal one skips more blocks (measured:
            # benchmarks/PERFORMANCE.md, Schedule decisions)
            wider = _balanced(seq, 64, tc)
            tasks = workload["batch"] * workload["heads"] * -(-seq // wider)
            if (round_up(seq, wider) <= round_up(seq, q_tile)
                    and tasks >= 4 * target.cores):
                q_tile = wider
        # a task a core at least: smaller query tiles (down to one S^T tile wide) where the
        # (batch, head, query tile) tasks would leave cores idle (8 heads at seq 256 on 64
        # cores: 32 tasks of 64 queries, or 64 of 32)
        while q_tile > tc and workload["batch"] * workload["heads"] * -(-seq // q_tile) \
                < target.cores:
            q_tile = max(tc, q_tile // 2 // tc * tc)
        # key blocks of ~128 keys (~96 with 16 registers: smaller tiles, and a 32 KiB L1);
        # ~256 on AMX tiles: P V then loads and stores its O^T tiles, and rescales O^T, once
        # per 8 steps of 32 keys, not 4; ~512 on bfloat16 pairs, for the same reason (see
        # benchmarks/PERFORMANCE.md, Schedule decisions); fewer keys than the goal: one
        # block of them
        kv_goal = (256 if workload.get("amx") else 512 if workload.get("pairs")
                   else 128 if target.vector_registers >= 32 else 96)
        kv_block = (_balanced(keys, min(kv_goal, keys), tr) if keys >= 128
                    else round_up(keys, tr))
        if workload.get("mask") is not None and keys == seq:
            # key blocks as wide as the query tiles: a causal diagonal block then wastes a
            # quarter of a 64 x 64 tile, not of 64 x 128, and a short causal sequence skips
            # blocks at all (see benchmarks/PERFORMANCE.md, Schedule decisions)
            kv_block = round_up(q_tile, tr)
        cfg = AttentionConfig(q_tile=q_tile, kv_block=kv_block, tile_rows=tr, tile_cols=tc,
                              out_rows=orows, out_cols=ocols)
        if workload.get("mask") is not None and keys == seq:
            return (narrow_band_tiles(workload, cfg) or aligned_key_blocks(workload, cfg)
                    or cfg)
        return cfg

    def make_config(self, values: dict, target, workload) -> AttentionConfig:
        """A config from a tuning record, checked against the template's constraints for
        this workload (a record edited by hand met an assertion in build_attention)."""
        cfg = AttentionConfig(**{k: int(values[k]) for k in
                                 ("q_tile", "kv_block", "tile_rows", "tile_cols", "out_rows",
                                  "out_cols")})
        lanes, w = target.lanes, workload
        keys = w.get("kv_seq") or w["seq"]
        most = 4 * target.vector_registers     # accumulators of a register tile, spilled or not
        broken = (min(cfg.q_tile, cfg.kv_block, cfg.tile_rows, cfg.tile_cols, cfg.out_rows,
                      cfg.out_cols) < 1
                  # tiles within twice the sequence (as candidates) and register tiles
                  # within reason
                  or cfg.q_tile > longest_tile(w["seq"], cfg.tile_cols)
                  or cfg.kv_block > max(longest_tile(keys, cfg.tile_rows),
                                        round_up(cfg.q_tile, cfg.tile_rows))
                  or cfg.out_rows > cfg.q_tile
                  or cfg.tile_rows * cfg.tile_cols > most * lanes
                  or cfg.out_rows * cfg.out_cols > most * lanes
                  or cfg.q_tile % cfg.tile_cols or cfg.kv_block % cfg.tile_rows
                  or cfg.tile_cols % lanes or cfg.out_cols % lanes
                  # a P V vector lies inside one qkv panel and one head
                  or w["panel"] % cfg.out_cols or w["v_base"] % cfg.out_cols
                  or w["head_dim_padded"] % cfg.out_cols
                  or (w.get("amx") and (cfg.tile_rows, cfg.tile_cols) != (amx.ROWS, amx.COLS)))
        if broken:
            raise ValueError(f"{cfg} breaks the template's tiling constraints")
        return cfg

    def candidates(self, workload, target) -> list:
        """Configs worth measuring for a workload (the tuning space of this template): query
        tiles of about 32, 64, 128 and key blocks of about 64, 128, 256, in whole tiles.
        (P V tiles of 4 rows instead of AVX2's 6 were candidates while query tiles had to be
        whole P V tiles; with P V tiles one row apart they measured the same at 1x128.)"""
        seq = workload["seq"]
        default = self.default_config(workload, target)
        # the grid in the register tile's rows (the default may take fewer: aligned tiles)
        rows = self.tiles(workload, target)[0]
        out = []
        for q_goal in (32, 64, 128):
            for kv_goal in (64, 128, 256):
                kv_block = round_up(kv_goal, rows)
                q_tile = max(default.tile_cols, q_goal // default.tile_cols * default.tile_cols)
                # make_config's key bound (a 64-key goal on AVX2 at seq 32: 66 keys)
                if q_tile > 2 * seq or kv_block > longest_tile(seq, rows):
                    continue
                c = replace(default, q_tile=q_tile, kv_block=kv_block, tile_rows=rows)
                if c not in out:
                    out.append(c)
        return [default] + [c for c in out if c != default]

    def build(self, w, cfg, target):
        return build_attention(w, cfg, target.lanes, flush=self.flush_denormals)


def longest_tile(length, multiple):
    """The longest query tile or key block worth having over `length` rows: twice the
    length (at least 16), rounded up to whole register tiles of `multiple` rows."""
    return round_up(2 * max(length, 8), multiple)


def padded_head_dim(head_dim, lanes):
    """Columns per head in qkv (the lowering pads them with zeros): a multiple of the vector
    lanes, so P V vectors over head_dim are whole vectors (head_dim 40: 48 on AVX-512, 40 on
    AVX2)."""
    return round_up(head_dim, lanes)


def query_tile_order(i, n):
    """The query tile of a head's i-th task (of n): 0, n-1, 1, n-2, ... TVM hands each thread
    a run of consecutive tasks, and under a causal mask a later tile has more key blocks:
    paired light with heavy, runs of even length hold the same work (see
    benchmarks/PERFORMANCE.md, Schedule decisions). ints or TIR expressions."""
    odd = i % 2
    return odd * (n - 1) + (1 - 2 * odd) * (i // 2)


def task_tile(task, batch, heads, n_q, batch_inner):
    """(batch row, head, query tile) of parallel task `task`: tasks run by batch row, head,
    then query tile (in query_tile_order); with key lengths per call (batch_inner) by head,
    query tile, then batch row, so a thread's run of tasks holds every row's alike,
    whatever each row's length (see benchmarks/PERFORMANCE.md, Schedule decisions). ints or
    TIR expressions."""
    if batch_inner:
        b, rest = task % batch, task // batch
    else:
        b, rest = task // (heads * n_q), task % (heads * n_q)
    return b, rest // n_q, query_tile_order(rest % n_q, n_q)


def layout(w, cfg):
    """Sizes shared by the lowering (block table) and the template."""
    seq, keys = w["seq"], w.get("kv_seq") or w["seq"]
    return {"n_q_tiles": -(-seq // cfg.q_tile), "n_kv_blocks": -(-keys // cfg.kv_block),
            "head_dim_padded": w["head_dim_padded"]}


def build_attention(w, cfg, lanes, flush=False):
    """The attention PrimFunc for workload w (see mhagen/lower/fused.py for its fields).
    flush: each task runs with denormals flushed to zero (x86: denormals.py)."""
    H, G, d = w["heads"], w["kv_heads"], w["head_dim"]
    L = layout(w, cfg)
    NQT, NKB, DP = L["n_q_tiles"], L["n_kv_blocks"], L["head_dim_padded"]   # table extents
    MQ, KB, MR, NR = cfg.q_tile, cfg.kv_block, cfg.tile_rows, cfg.tile_cols
    OR, NV = cfg.out_rows, cfg.out_cols               # P V register tile
    # P V covers the query tile in as few tiles of at most OR rows as it can, their heights
    # one apart: AVX2's 6-row tiles cover 64 queries as 9 x 6 + 2 x 5, 32 as 2 x 6 + 4 x 5
    # (not 10 x 6 + 4, 5 x 6 + 2: a 2-row tile reuses each V load twice, and LLVM unrolled
    # and spilled its short loop)
    PV_TILES = -(-MQ // OR)
    PV_ROWS, PV_BIG = MQ // PV_TILES, MQ % PV_TILES   # PV_BIG tiles of PV_ROWS + 1 rows
    LN = lanes
    GROUP = H // G
    PW, HD = w["panel"], H * d                        # qkv is [columns / PW, M, PW]
    NP = w["qkv_width"] // PW
    cross = bool(w.get("cross"))       # K/V in kv [kv_width / PW, kv_rows, PW], else in qkv
    KV_SHAPE = (w["kv_width"] // PW, w["kv_rows"], PW) if cross else None
    Q_BASE, K_BASE, V_BASE = w["q_base"], w["k_base"], w["v_base"]   # in columns
    # a P V vector (NV columns of one V head) must lie inside one panel
    assert PW % NV == 0 and V_BASE % NV == 0 and DP % NV == 0, (PW, NV, V_BASE, DP)
    TB, TH = w["table_batch"], w["table_heads"]
    c_log2e = f32(w["scale"] * LOG2E)
    neg_inf = f32(float("-inf"))
    zero = f32(0.0)
    M = w.get("rows", w["batch"] * w["seq"])   # qkv rows and att rows: batch*seq padded to
    MA = w.get("att_rows", M)         # whole GEMM tiles (rows past batch*seq are never read)
    # bfloat16 pairs (AVX-512 BF16, bf16_dot.py): qkv (and kv) hold bfloat16; S^T = K Q^T
    # multiplies pairs of head columns, P V pairs of keys (P rounded to bfloat16, as
    # FlashAttention does), both with vdpbf16ps and float32 accumulators; the softmax stays
    # float32. Q^T is copied unscaled (rounding Q * scale again would add an error): the
    # write-back scales the tile.
    PAIRS = bool(w.get("pairs"))
    # AMX tiles (amx.py; work["amx"]): qkv (and kv) hold bfloat16, S^T = K Q^T runs on AMX
    # tiles of 32 keys x 32 queries (K straight from qkv, Q^T as for pairs), the write-back
    # (scale, mask, max) reads the stored tile; P V runs on AMX tiles of 32 queries x 32
    # head columns, P (rounded to bfloat16) transposed into rows of keys, V zipped as for
    # pairs
    AMX = bool(w.get("amx"))
    QT_PAIRS = PAIRS or AMX           # Q^T copied unscaled, as int32 pairs of head columns
    QKV_DTYPE = "bfloat16" if QT_PAIRS else "float32"
    if PAIRS:
        assert d % 2 == 0 and LN == 16 and NR % LN == 0 and NV % LN == 0, (d, LN, NR, NV)

    rules = ScoreRules(w, SCORE_MATH)
    visible, modified, key_row = rules.visible, rules.modified, rules.key_row
    tb, th = rules.tb, rules.th
    B, S = rules.batch, rules.seq     # ints, or the call's (symbolic-length builds)
    # every K head starts a panel and fills whole ones (head_dim 64 or 128): the S^T loop
    # then walks panels and columns, with no division per column (62 -> 47 instructions per
    # 24 FMAs on AVX2)
    K_PANELS = K_BASE % PW == 0 and DP % PW == 0 and d % PW == 0
    CW = PW if K_PANELS else d        # head columns per step of the S^T loop's outer loop
    if AMX:   # whole AMX steps: K heads in whole panels of 32 columns, tiles of 32 x 32
        assert K_PANELS and PW == amx.DEPTH and MR == amx.ROWS and NR == amx.COLS, (
            K_PANELS, PW, MR, NR)
    O_SHAPE = (DP, MQ) if AMX else (MQ, DP)   # the task's O: O^T on AMX tiles
    AVX512 = flush and LN == 16       # x86 (flush) with 512-bit vectors: EXP2_16's helpers
    # Q^T on x86: LN x LN blocks of words through registers (transpose.py), where a strided
    # copy became one scalar insert per element (benchmarks/PERFORMANCE.md, Schedule decisions)
    QW = 2 if QT_PAIRS else 1         # Q^T's words: int32 pairs of head columns, or floats
    NW = d // QW                      # words a query
    QT_SHUFFLE = (flush and LN in (8, 16) and PW % (LN * QW) == 0
                  and Q_BASE % (LN * QW) == 0 and DP % (LN * QW) == 0)
    QT_TRANSPOSE = transpose_words(LN)
    NB = NW // LN * LN if QT_SHUFFLE else 0   # Q^T's words copied through the transposes

    def q_word(src, h, c, row, scaled):
        """Q head h's word c (a head column, or a pair of them) at qkv's `row`, in log2
        units where scaled (floats; pairs stay unscaled: the S^T write-back scales)."""
        word = src[(Q_BASE + h * DP + c * QW) // PW, row, (Q_BASE + h * DP + c * QW) % PW // QW]
        return word * c_log2e if scaled and not QT_PAIRS else word

    def k_at(kv, g, cp, ci, row):
        """K head g's column cp * CW + ci at `row` of kv (column panels of PW)."""
        if K_PANELS:
            return kv[(K_BASE + g * DP) // PW + cp, row, ci]
        c = cp * CW + ci
        return kv[(K_BASE + g * DP + c) // PW, row, (K_BASE + g * DP + c) % PW]
    def k_pair(kv32, g, cp, ci2, row):
        """K head g's columns c, c + 1 (c = cp * CW + 2 ci2) at `row`: one 32-bit word of the
        int32 view kv32 of kv ([panels, rows, PW / 2])."""
        if K_PANELS:
            return kv32[(K_BASE + g * DP) // PW + cp, row, ci2]
        c = cp * CW + 2 * ci2
        return kv32[(K_BASE + g * DP + c) // PW, row, (K_BASE + g * DP + c) % PW // 2]
    KV_LEN = rules.kv_seq             # keys per batch row (the context's in cross-attention)
    NQ, NK = NQT, NKB                 # query tiles and key blocks a call runs
    if rules.symbolic:
        NQ, NK = (S + MQ - 1) // MQ, (rules.kv_seq + KB - 1) // KB
        M = MA = (B * S + w["row_tile"] - 1) // w["row_tile"] * w["row_tile"]
        if cross:   # the context's rows, padded as its GEMM's
            KV_SHAPE = (KV_SHAPE[0], (B * rules.kv_seq + w["row_tile"] - 1) // w["row_tile"]
                        * w["row_tile"], PW)
    NKT = (KV_LEN + 31) // 32         # AMX: tiles of 32 keys in V^T

    # pairs and AMX without a score modifier: scores stay unscaled until the softmax, whose
    # exponent is then one multiply-add, s * scale - m * scale (the running max is unscaled
    # too: the scale is positive); the S^T write-back loses its multiply (AMX: a full block's
    # write-back then only reads the stored tile for the max)
    LATE_SCALE = QT_PAIRS and rules.score_mod is None
    SOFTMAX_SCALE = c_log2e if LATE_SCALE else f32(1.0)

    def score(x):
        """A tile's accumulator in log2 units, or unscaled (LATE_SCALE) (pairs, AMX: Q^T is
        not pre-scaled)."""
        return x * c_log2e if QT_PAIRS and not LATE_SCALE else x

    @T.macro
    def s_tiles(masked, clamp, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0, jo, kv32,
                q_t32, k_pad):
        # one row of S^T register tiles (MR keys from k0 + jo MR, every query tile):
        # S^T = K Q^T in log2 units; the write-back masks and takes the running max.
        # clamp: the tile runs past the last key (its key rows clamped, its scores masked)
        for io in range(MQ // NR):
            if AMX:   # the S^T tile into s_buf, then its write-back from there
                if clamp:   # the keys' rows clamped, copied where the tile loads them
                    for cp in range(d // CW):
                        for jj in range(MR):
                            for ci in T.vectorized(CW):
                                k_pad[cp, jj, ci] = kv[(K_BASE + g * DP) // PW + cp,
                                                       key_row(b, k0 + jo * MR + jj, True), ci]
                    T.evaluate(T.call_extern(
                        "int32", amx.SCORES, s_buf.data, jo * MR * MQ + io * NR,
                        T.int64(MQ * 4), k_pad.data, T.int64(0), T.int64(CW * 2),
                        T.int64(MR * CW * 2), q_t32.data, io * NR, T.int64(MQ * 4), d // CW))
                else:
                    T.evaluate(T.call_extern(
                        "int32", amx.SCORES, s_buf.data, jo * MR * MQ + io * NR,
                        T.int64(MQ * 4), kv.data,
                        T.Cast("int64", (K_BASE + g * DP) // PW) * T.Cast("int64", kv.shape[1])
                        * PW + T.Cast("int64", key_row(b, k0 + jo * MR, False)) * PW,
                        T.int64(PW * 2), T.Cast("int64", kv.shape[1]) * (PW * 2), q_t32.data,
                        io * NR, T.int64(MQ * 4), d // CW))
                if masked or not LATE_SCALE:
                    for jj in range(MR):
                        for ii in T.vectorized(NR):
                            if masked:
                                s_buf[jo * MR + jj, io * NR + ii] = T.Select(
                                    visible(b, h, q0 + io * NR + ii, k0 + jo * MR + jj, lens),
                                    modified(score(s_buf[jo * MR + jj, io * NR + ii]), b, h,
                                             q0 + io * NR + ii, k0 + jo * MR + jj), neg_inf)
                            else:
                                s_buf[jo * MR + jj, io * NR + ii] = modified(
                                    score(s_buf[jo * MR + jj, io * NR + ii]), b, h,
                                    q0 + io * NR + ii, k0 + jo * MR + jj)
                            m_new[io * NR + ii] = T.max(m_new[io * NR + ii],
                                                        s_buf[jo * MR + jj, io * NR + ii])
                else:   # the stored tile is the scores: its max only
                    for jj in T.unroll(MR):
                        for ii in T.vectorized(NR):
                            m_new[io * NR + ii] = T.max(m_new[io * NR + ii],
                                                        s_buf[jo * MR + jj, io * NR + ii])
            else:
                for jj in T.unroll(MR):
                    for ii in T.vectorized(NR):
                        acc[jj, ii] = zero
                if PAIRS:   # one vdpbf16ps per pair of head columns and 16 queries
                    for cp in range(d // CW):
                        for ci2 in range(CW // 2):
                            for jj in T.unroll(MR):
                                for v in T.unroll(NR // LN):
                                    acc[jj, T.ramp(v * LN, 1, LN)] = T.call_pure_extern(
                                        "float32x16", DOT, acc[jj, T.ramp(v * LN, 1, LN)],
                                        T.broadcast(k_pair(kv32, g, cp, ci2, key_row(
                                            b, k0 + jo * MR + jj, clamp)), LN),
                                        q_t32[cp * CW // 2 + ci2, T.ramp(io * NR + v * LN, 1, LN)])
                else:
                    for cp in range(d // CW):
                        for ci in range(CW):
                            for jj in T.unroll(MR):
                                for ii in T.vectorized(NR):
                                    acc[jj, ii] = acc[jj, ii] + k_at(
                                        kv, g, cp, ci, key_row(b, k0 + jo * MR + jj, clamp)
                                    ) * q_t[cp * CW + ci, io * NR + ii]
                for jj in T.unroll(MR):
                    for ii in T.vectorized(NR):
                        if masked:
                            s_buf[jo * MR + jj, io * NR + ii] = T.Select(
                                visible(b, h, q0 + io * NR + ii, k0 + jo * MR + jj, lens),
                                modified(score(acc[jj, ii]), b, h, q0 + io * NR + ii,
                                         k0 + jo * MR + jj), neg_inf)
                        else:
                            s_buf[jo * MR + jj, io * NR + ii] = modified(
                                score(acc[jj, ii]), b, h, q0 + io * NR + ii, k0 + jo * MR + jj)
                        m_new[io * NR + ii] = T.max(m_new[io * NR + ii],
                                                    s_buf[jo * MR + jj, io * NR + ii])

    @T.macro
    def pv_tile(rows, r0, co, n_keys, n_pairs, kv, s_buf, o_buf, alpha, acc_o, b, g, k0, p32,
                v32):
        # queries r0 .. r0 + rows, head columns co NV .. (co + 1) NV
        for ii in T.unroll(rows):
            for cc in T.vectorized(NV):
                acc_o[ii, cc] = o_buf[r0 + ii, co * NV + cc] * alpha[r0 + ii]
        if PAIRS:   # one vdpbf16ps per pair of keys and 16 head columns
            for j2 in range(n_pairs):
                for ii in T.unroll(rows):
                    for v in T.unroll(NV // LN):
                        acc_o[ii, T.ramp(v * LN, 1, LN)] = T.call_pure_extern(
                            "float32x16", DOT, acc_o[ii, T.ramp(v * LN, 1, LN)],
                            T.broadcast(p32[j2, r0 + ii], LN),
                            v32[j2, T.ramp(co * NV + v * LN, 1, LN)])
        else:
            for j in range(n_keys):
                for ii in T.unroll(rows):
                    for cc in T.vectorized(NV):
                        acc_o[ii, cc] = acc_o[ii, cc] + s_buf[j, r0 + ii] * T.Cast(
                            "float32", kv[(V_BASE + g * DP + co * NV) // PW,
                                          key_row(b, k0 + j, False),
                                          (V_BASE + g * DP + co * NV) % PW + cc])
        for ii in T.unroll(rows):
            for cc in T.vectorized(NV):
                o_buf[r0 + ii, co * NV + cc] = acc_o[ii, cc]

    @T.macro
    def key_block(masked, cut, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf, m_new, alpha, acc,
                  acc_o, vec, b, h, g, q0, k0, kv32, q_t32, p32, v32, k_pad, vt):
        # masked: scores go through the mask (PARTIAL blocks). cut: the block runs past the
        # last key (masked too): its S^T tiles stop at the tile holding the last key (only
        # that tile clamps its key rows) and P V stops at the last key, so no loop pays for
        # the padding and the others keep the unclamped, affine key rows of full blocks.
        n_keys = T.min(KB, KV_LEN - k0) if cut else KB          # keys that exist
        n_full = n_keys // MR if cut else KB // MR                # S^T tiles of such keys
        n_rows = (n_keys + MR - 1) // MR * MR if cut else KB     # s_buf rows written
        for i in T.vectorized(MQ):
            m_new[i] = m_buf[i]
        for jo in range(n_full):
            s_tiles(masked, False, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0, jo, kv32,
                    q_t32, k_pad)
        if cut:
            if n_keys % MR > 0:
                s_tiles(True, True, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0,
                        n_full, kv32, q_t32, k_pad)
        # P^T = 2^(S^T - m'), l = l alpha + sum P, alpha = 2^(m - m'); lane-wise over queries.
        # vec[0]: the subtracted max (0 for queries that saw no key yet), vec[1]: sum of P.
        # Pairs and AMX tiles: P^T straight into bfloat16 pairs of keys (p32; a row past the
        # last key is 0), 2^(s scale - m') on EXP2_16; float32 P is not stored (m' is scaled
        # here: LATE_SCALE).
        n_pairs = (n_keys + 1) // 2
        # pairs of keys P V multiplies: the keys that exist, or on AMX tiles the block's
        # whole 32s (their depth; P is 0 past the last key)
        n_zipped = n_rows // 2 if AMX else n_pairs
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
        if PAIRS:
            # V's rows in pairs of keys (zipped; the pairs past the last key read clamped rows)
            for j2 in range(n_zipped):
                for c16 in range(DP // LN):
                    v32[j2, T.ramp(c16 * LN, 1, LN)] = T.call_pure_extern(
                        "int32x16", ZIP,
                        kv32[(V_BASE + g * DP + c16 * LN) // PW, key_row(b, k0 + 2 * j2, cut),
                             T.ramp((V_BASE + g * DP + c16 * LN) % PW // 2, 1, LN // 2)],
                        kv32[(V_BASE + g * DP + c16 * LN) // PW,
                             key_row(b, k0 + 2 * j2 + 1, cut),
                             T.ramp((V_BASE + g * DP + c16 * LN) % PW // 2, 1, LN // 2)])
        if AMX:
            # O^T = O^T alpha + V^T P^T on AMX tiles (32 head columns x 32 queries) over the
            # block's whole 32s of keys: P^T's pairs as the softmax packed them, V^T as the
            # kernel's first loop transposed it (vt)
            for c in range(DP):
                for i in T.vectorized(MQ):
                    o_buf[c, i] = o_buf[c, i] * alpha[i]
            for co in range(DP // 32):
                for qo in range(MQ // 32):
                    T.evaluate(T.call_extern(
                        "int32", amx.PV, o_buf.data, co * 32 * MQ + qo * 32, T.int64(MQ * 4),
                        vt.data, T.Cast("int64", (b * G + g) * NKT + k0 // 32) * (DP * 32)
                        + co * 32 * 32, T.int64(DP * 64), p32.data, qo * 32, T.int64(MQ * 4),
                        n_rows // 32))
        else:
            # O = O alpha + P V (keys that exist only), in PV_TILES tiles of at most OR
            # queries
            for co in range(DP // NV):
                for io in range(PV_BIG):
                    pv_tile(PV_ROWS + 1, io * (PV_ROWS + 1), co, n_keys, n_pairs, kv, s_buf,
                            o_buf, alpha, acc_o, b, g, k0, p32, v32)
                for io in range(PV_TILES - PV_BIG):
                    pv_tile(PV_ROWS, PV_BIG * (PV_ROWS + 1) + io * PV_ROWS, co, n_keys, n_pairs,
                            kv, s_buf, o_buf, alpha, acc_o, b, g, k0, p32, v32)

    @T.macro
    def body(qkv, kv, blocks, lens, out):
        # int32 views of the bfloat16 pairs (used when PAIRS)
        kv32 = T.decl_buffer((kv.shape[0], kv.shape[1], PW // 2), "int32", data=kv.data)
        # AMX: V^T of every (batch row, K/V head, 32 keys), [B, G, NKT, DP, 32] (rows of 32
        # keys: A tiles of P V), transposed once a call here, not once a query tile
        vt = T.decl_buffer((B * G * NKT * DP * 32 if AMX else 1,), "bfloat16")
        if AMX:
            for t in T.parallel(B * G * NKT):
                v_pad = T.decl_buffer((32, 32), "bfloat16")
                vb = t // (G * NKT)
                vg = t // NKT % G
                kt = t % NKT
                for cp in range(DP // 32):
                    if kt * 32 + 32 <= KV_LEN:
                        T.evaluate(T.call_extern(
                            "int32", TRANSPOSE_32_I16, vt.data,
                            T.Cast("int64", t) * (DP * 32) + cp * 32 * 32, T.int64(64), kv.data,
                            T.Cast("int64", (V_BASE + vg * DP) // PW + cp)
                            * T.Cast("int64", kv.shape[1]) * PW
                            + T.Cast("int64", key_row(vb, kt * 32, False)) * PW, T.int64(PW * 2)))
                    else:   # the last keys' rows clamped (P is 0 there)
                        for r in range(32):
                            for c in T.vectorized(32):
                                v_pad[r, c] = kv[(V_BASE + vg * DP) // PW + cp,
                                                 key_row(vb, kt * 32 + r, True), c]
                        T.evaluate(T.call_extern(
                            "int32", TRANSPOSE_32_I16, vt.data,
                            T.Cast("int64", t) * (DP * 32) + cp * 32 * 32, T.int64(64),
                            v_pad.data, T.int64(0), T.int64(64)))
        for task in T.parallel(B * H * NQ):
            csr = T.decl_buffer((1,), "int32")
            if flush:
                csr[0] = T.call_extern("int32", denormals.ENTER)
            if AMX:   # this thread's tile configuration, for this task (amx.py)
                T.evaluate(T.call_extern("int32", amx.CONFIG))
            q_t = T.decl_buffer((1 if QT_PAIRS else d, MQ), "float32")
            q_t32 = T.decl_buffer((d // 2 if QT_PAIRS else 1, MQ), "int32")
            k_pad = T.decl_buffer((d // CW if AMX else 1, MR if AMX else 1, CW if AMX else 1),
                                  "bfloat16")
            p32 = T.decl_buffer((KB // 2 if QT_PAIRS else 1, MQ), "int32")
            v32 = T.decl_buffer((KB // 2 if PAIRS else 1, DP if PAIRS else 1), "int32")
            s_buf = T.decl_buffer((KB, MQ), "float32")
            o_buf = T.decl_buffer(O_SHAPE, "float32")     # O, or O^T on AMX tiles
            o_rows = T.decl_buffer((MQ if AMX else 1, DP if AMX else 1), "float32")
            m_buf = T.decl_buffer((MQ,), "float32")
            l_buf = T.decl_buffer((MQ,), "float32")
            m_new = T.decl_buffer((MQ,), "float32")
            alpha = T.decl_buffer((MQ,), "float32")
            acc = T.alloc_buffer((1 if AMX else MR, NR), "float32", scope="local",
                                 annotations=ON_STACK)
            acc_o = T.alloc_buffer((OR, NV), "float32", scope="local", annotations=ON_STACK)
            vec = T.alloc_buffer((4, LN), "float32", scope="local", annotations=ON_STACK)
            b, h, qt = T.meta_var(task_tile(task, B, H, NQ, rules.lengths))
            g = h // GROUP
            q0 = qt * MQ
            qkv32 = T.decl_buffer((NP, M, PW // 2), "int32", data=qkv.data)
            q_dst = T.meta_var(q_t32 if QT_PAIRS else q_t)   # words: pairs of bfloat16, or
            q_src = T.meta_var(qkv32 if QT_PAIRS else qkv)   # floats
            if QT_SHUFFLE:   # blocks of LN x LN words transposed in registers, scaled after
                for c16 in range(NB // LN):
                    for i16 in range(MQ // LN):
                        if q0 + i16 * LN + LN <= S:
                            T.evaluate(T.call_extern(
                                "int32", QT_TRANSPOSE, q_dst.data,
                                T.int64(c16 * LN * MQ + i16 * LN), T.int64(MQ * 4), q_src.data,
                                (T.Cast("int64", (Q_BASE + h * DP + c16 * LN * QW) // PW)
                                 * T.Cast("int64", M) + T.Cast("int64", b * S + q0 + i16 * LN))
                                * (PW // QW) + (Q_BASE + h * DP + c16 * LN * QW) % PW // QW,
                                T.int64(PW // QW * 4)))
                        else:   # the last queries' rows clamped
                            for c in range(LN):
                                for i in T.vectorized(LN):
                                    q_dst[c16 * LN + c, i16 * LN + i] = q_word(
                                        q_src, h, c16 * LN + c,
                                        b * S + T.min(q0 + i16 * LN + i, S - 1), False)
                if not QT_PAIRS:
                    for c in range(NB):
                        for i in T.vectorized(MQ):
                            q_t[c, i] = q_t[c, i] * c_log2e
            if NW > NB:   # the words past the blocks (all of them without QT_SHUFFLE)
                for ct in range(NW - NB):
                    for i in T.vectorized(MQ):
                        q_dst[NB + ct, i] = q_word(q_src, h, NB + ct,
                                                   b * S + T.min(q0 + i, S - 1), True)
            for i in T.vectorized(MQ):
                m_buf[i] = neg_inf
                l_buf[i] = zero
            for i in range(O_SHAPE[0]):
                for j in T.vectorized(O_SHAPE[1]):
                    o_buf[i, j] = zero
            for kb in range(NK):
                state = rules.block_state(blocks[tb(b), th(h), qt, kb], lens, b, kb * KB, KB)
                if state == FULL:
                    key_block(False, False, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf, m_new,
                              alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32, q_t32,
                              p32, v32, k_pad, vt)
                elif state == PARTIAL:
                    if kb * KB + KB <= KV_LEN:
                        key_block(True, False, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf,
                                  m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32,
                                  q_t32, p32, v32, k_pad, vt)
                    else:
                        key_block(True, True, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf,
                                  m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32,
                                  q_t32, p32, v32, k_pad, vt)
            if AMX:   # O^T's rows of queries into rows of head columns
                for c16 in range(DP // 16):
                    for q16 in range(MQ // 16):
                        T.evaluate(T.call_extern("int32", TRANSPOSE_16_I32, o_rows.data,
                                                 q16 * 16 * DP + c16 * 16, T.int64(DP * 4),
                                                 o_buf.data, c16 * 16 * MQ + q16 * 16,
                                                 T.int64(MQ * 4)))
            o_final = T.meta_var(o_rows if AMX else o_buf)
            for i in range(MQ):
                if q0 + i < S:
                    vec[0, 0] = T.Select(l_buf[i] > zero, T.float32(1) / l_buf[i], zero)
                    for j in range(d):
                        out[b * S + q0 + i, h * d + j] = o_final[i, j] * vec[0, 0]
            if AMX:
                T.evaluate(T.call_extern("int32", amx.RELEASE))
            if flush:
                T.evaluate(T.call_extern("int32", denormals.EXIT, csr[0]))

    func = attention_entry(body, rules, (NP, M, PW), (TB, TH, NQT, NKB), B, (MA, HD),
                           kv_shape=KV_SHAPE, dtype=QKV_DTYPE, out_dtype="float32")
    # LLVM IR linked into the kernel: the dot product (bf16_dot.py), the MXCSR helpers
    return with_llvm_ir(func, (HELPERS if QT_PAIRS else "") + (EXP2_HELPER if AVX512 else "")
                        + (amx.HELPERS if AMX else "")
                        + (transpose(QT_TRANSPOSE, LN, "i32", "i64") if QT_SHUFFLE else "")
                        + (denormals.HELPERS if flush else ""))
