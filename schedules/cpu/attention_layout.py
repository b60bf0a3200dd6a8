"""The CPU attention template's kernel layout: one typed, frozen record of every size, base
column and feature switch its stages read (as FlashAttention 3's one params struct), made
once a build from the workload, the config and the target's lanes.

kernel_layout   the record (KernelLayout) of workload w under cfg
KernelLayout    its fields, and the reads of qkv every stage shares: q_word (Q^T's copy),
                k_at / k_pair (K in S^T), score (an accumulator in the softmax's units)

The stages (attention_scores.py, attention_softmax.py, attention_values.py,
attention_kernel.py) unpack the fields they use into the short names of the template's
TIR, so the TVMScript reads as the kernel it writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.lower.te import LOG2E
from mhagen.schedules.x86 import amx
from mhagen.schedules.cpu.fast_math import f32
from mhagen.schedules.x86.transpose import transpose_words


@dataclass(frozen=True)
class KernelLayout:
    """Sizes in the template's short names (ints, or TIR expressions of the call's batch and
    seq in symbolic-length builds)."""
    # lengths and heads
    B: object            # batch rows (the call's where symbolic)
    S: object            # queries a batch row (the call's where symbolic)
    KV_LEN: object       # keys a batch row (the context's in cross-attention)
    H: int               # query heads
    G: int               # K/V heads; head h reads K/V head h // GROUP
    GROUP: int
    d: int               # head_dim
    DP: int              # columns a head in qkv (head_dim padded to the lanes)
    HD: int              # att's columns: H * d
    # qkv [NP, M, PW] and att [MA, HD]; K/V in kv [KV_SHAPE] in cross-attention
    PW: int
    NP: int
    M: object
    MA: object
    KV_SHAPE: tuple | None
    Q_BASE: int
    K_BASE: int
    V_BASE: int
    # block table extents [TB, TH, NQT, NKB]; the query tiles and key blocks a call runs
    TB: int
    TH: int
    NQT: int
    NKB: int
    NQ: object
    NK: object
    NKT: object          # AMX: tiles of 32 keys in V^T
    # tiles (the config's)
    MQ: int              # queries a task
    KB: int              # keys a block
    MR: int              # S^T register tile: keys
    NR: int              # S^T register tile: queries
    OR: int              # P V register tile: queries (at most)
    NV: int              # P V register tile: head columns
    PV_TILES: int        # P V tiles a query tile, PV_BIG of them PV_ROWS + 1 rows high
    PV_ROWS: int
    PV_BIG: int
    LN: int              # vector lanes
    # what the products run on
    PAIRS: bool          # bfloat16 pairs on vdpbf16ps (bf16_dot.py)
    AMX: bool            # AMX tiles (amx.py)
    QT_PAIRS: bool       # Q^T copied unscaled, as int32 pairs of head columns
    QKV_DTYPE: str
    AVX512: bool         # x86 with 512-bit vectors: EXP2_16's helpers
    K_PANELS: bool       # every K head starts a panel and fills whole ones
    CW: int              # head columns a step of the S^T loop's outer loop
    O_SHAPE: tuple       # the task's O: O^T on AMX tiles
    # Q^T's copy: words (floats, or pairs of bfloat16), NB of them through LN x LN transposes
    QW: int
    NW: int
    QT_SHUFFLE: bool
    QT_TRANSPOSE: str
    NB: int
    # the softmax's units
    c_log2e: object      # scale * log2(e)
    LATE_SCALE: bool     # scores unscaled until the softmax's exponent
    SOFTMAX_SCALE: object
    neg_inf: object
    zero: object
    flush: bool          # tasks run with denormals flushed to zero (x86: denormals.py)

    def q_word(self, src, h, c, row, scaled):
        """Q head h's word c (a head column, or a pair of them) at qkv's `row`, in log2
        units where scaled (floats; pairs stay unscaled: the S^T write-back scales)."""
        Q_BASE, DP, QW, PW = self.Q_BASE, self.DP, self.QW, self.PW
        word = src[(Q_BASE + h * DP + c * QW) // PW, row, (Q_BASE + h * DP + c * QW) % PW // QW]
        return word * self.c_log2e if scaled and not self.QT_PAIRS else word

    def k_at(self, kv, g, cp, ci, row):
        """K head g's column cp * CW + ci at `row` of kv (column panels of PW)."""
        K_BASE, DP, PW = self.K_BASE, self.DP, self.PW
        if self.K_PANELS:
            return kv[(K_BASE + g * DP) // PW + cp, row, ci]
        c = cp * self.CW + ci
        return kv[(K_BASE + g * DP + c) // PW, row, (K_BASE + g * DP + c) % PW]

    def k_pair(self, kv32, g, cp, ci2, row):
        """K head g's columns c, c + 1 (c = cp * CW + 2 ci2) at `row`: one 32-bit word of the
        int32 view kv32 of kv ([panels, rows, PW / 2])."""
        K_BASE, DP, PW = self.K_BASE, self.DP, self.PW
        if self.K_PANELS:
            return kv32[(K_BASE + g * DP) // PW + cp, row, ci2]
        c = cp * self.CW + 2 * ci2
        return kv32[(K_BASE + g * DP + c) // PW, row, (K_BASE + g * DP + c) % PW // 2]

    def v_lane(self, vv, g, co, row, cc):
        """Lane cc of P V's vector co (NV head columns) of V head g at `row` of vv (qkv or
        kv, column panels of PW), as float32. The attention core (schedules/cpu/core.py)
        reads its own value tensor instead."""
        col = self.V_BASE + g * self.DP + co * self.NV
        return T.Cast("float32", vv[col // self.PW, row, col % self.PW + cc])

    def out_value(self, value):
        """An output value (float32) as out stores it."""
        return value

    def score(self, x):
        """A tile's accumulator in log2 units, or unscaled (LATE_SCALE) (pairs, AMX: Q^T is
        not pre-scaled)."""
        return x * self.c_log2e if self.QT_PAIRS and not self.LATE_SCALE else x


def kernel_layout(w, cfg, lanes, flush, x86_helpers, rules, n_q_tiles, n_kv_blocks):
    """The layout of workload w (typed) under cfg; flush: tasks flush denormals; x86_helpers:
    x86 LLVM IR helpers may be linked (EXP2_16, Q^T's register transposes); rules: its
    ScoreRules (the call's lengths in symbolic builds); n_q_tiles, n_kv_blocks: the block
    table's extents."""
    H, G, d, DP = w.heads, w.kv_heads, w.head_dim, w.head_dim_padded
    MQ, KB, MR, NR = cfg.q_tile, cfg.kv_block, cfg.tile_rows, cfg.tile_cols
    OR, NV = cfg.out_rows, cfg.out_cols               # P V register tile
    # P V covers the query tile in as few tiles of at most OR rows as it can, their heights
    # one apart: AVX2's 6-row tiles cover 64 queries as 9 x 6 + 2 x 5, 32 as 2 x 6 + 4 x 5
    # (not 10 x 6 + 4, 5 x 6 + 2: a 2-row tile reuses each V load twice, and LLVM unrolled
    # and spilled its short loop)
    PV_TILES = -(-MQ // OR)
    PW = w.panel                                      # qkv is [columns / PW, M, PW]
    # K/V in kv [kv_width / PW, kv_rows, PW] in cross-attention, else in qkv
    KV_SHAPE = (w.kv_width // PW, w.kv_rows, PW) if w.cross else None
    # a P V vector (NV columns of one V head) must lie inside one panel
    assert PW % NV == 0 and w.v_base % NV == 0 and DP % NV == 0, (PW, NV, w.v_base, DP)
    # qkv rows and att rows: batch*seq padded to whole GEMM tiles (rows past batch*seq are
    # never read)
    M, MA = w.rows, w.att_rows
    # bfloat16 pairs (AVX-512 BF16, bf16_dot.py): qkv (and kv) hold bfloat16; S^T = K Q^T
    # multiplies pairs of head columns, P V pairs of keys (P rounded to bfloat16, as
    # FlashAttention does), both with vdpbf16ps and float32 accumulators; the softmax stays
    # float32. Q^T is copied unscaled (rounding Q * scale again would add an error): the
    # write-back scales the tile.
    PAIRS, AMX = bool(w.pairs), bool(w.amx)
    # AMX tiles (amx.py): S^T = K Q^T on tiles of 32 keys x 32 queries (K straight from qkv,
    # Q^T as for pairs), the write-back (scale, mask, max) reads the stored tile; P V on
    # tiles of 32 queries x 32 head columns
    QT_PAIRS = PAIRS or AMX
    if PAIRS:
        assert d % 2 == 0 and lanes == 16 and NR % lanes == 0 and NV % lanes == 0, (
            d, lanes, NR, NV)
    B, S, KV_LEN = rules.batch, rules.seq, rules.kv_seq
    # every K head starts a panel and fills whole ones (head_dim 64 or 128): the S^T loop
    # then walks panels and columns, with no division per column
    K_PANELS = w.k_base % PW == 0 and DP % PW == 0 and d % PW == 0
    if AMX:   # whole AMX steps: K heads in whole panels of 32 columns, tiles of 32 x 32
        assert K_PANELS and PW == amx.DEPTH and MR == amx.ROWS and NR == amx.COLS, (
            K_PANELS, PW, MR, NR)
    NQ, NK = n_q_tiles, n_kv_blocks                   # query tiles and key blocks a call runs
    if rules.symbolic:
        NQ, NK = (S + MQ - 1) // MQ, (KV_LEN + KB - 1) // KB
        M = MA = (B * S + w.row_tile - 1) // w.row_tile * w.row_tile
        if w.cross:   # the context's rows, padded as its GEMM's
            KV_SHAPE = (KV_SHAPE[0], (B * KV_LEN + w.row_tile - 1) // w.row_tile
                        * w.row_tile, PW)
    # pairs and AMX without a score modifier: scores stay unscaled until the softmax, whose
    # exponent is then one multiply-add, s * scale - m * scale (the running max is unscaled
    # too: the scale is positive); the S^T write-back loses its multiply (AMX: a full block's
    # write-back then only reads the stored tile for the max)
    c_log2e = f32(w.scale * LOG2E)
    LATE_SCALE = QT_PAIRS and rules.score_mod is None
    return KernelLayout(
        B=B, S=S, KV_LEN=KV_LEN, H=H, G=G, GROUP=H // G, d=d, DP=DP, HD=H * d, PW=PW,
        NP=w.qkv_width // PW, M=M, MA=MA, KV_SHAPE=KV_SHAPE, Q_BASE=w.q_base, K_BASE=w.k_base,
        V_BASE=w.v_base, TB=w.table_batch, TH=w.table_heads, NQT=n_q_tiles, NKB=n_kv_blocks,
        NQ=NQ, NK=NK, NKT=(KV_LEN + 31) // 32, MQ=MQ, KB=KB, MR=MR, NR=NR, OR=OR, NV=NV,
        PV_TILES=PV_TILES, PV_ROWS=MQ // PV_TILES, PV_BIG=MQ % PV_TILES, LN=lanes,
        PAIRS=PAIRS, AMX=AMX, QT_PAIRS=QT_PAIRS,
        QKV_DTYPE="bfloat16" if QT_PAIRS else "float32",
        AVX512=x86_helpers and lanes == 16, K_PANELS=K_PANELS, CW=PW if K_PANELS else d,
        O_SHAPE=(DP, MQ) if AMX else (MQ, DP), c_log2e=c_log2e, LATE_SCALE=LATE_SCALE,
        SOFTMAX_SCALE=c_log2e if LATE_SCALE else f32(1.0), neg_inf=f32(float("-inf")),
        zero=f32(0.0), flush=flush, **query_copy(w, lanes, x86_helpers, QT_PAIRS, d, DP, PW))


def query_copy(w, lanes, x86_helpers, qt_pairs, d, DP, PW):
    """Q^T's copy: its words (int32 pairs of head columns, or floats), on x86 LN x LN blocks
    of them through registers (transpose.py), where a strided copy became one scalar insert
    per element (benchmarks/PERFORMANCE.md, Schedule decisions)."""
    QW = 2 if qt_pairs else 1
    NW = d // QW                      # words a query
    QT_SHUFFLE = (x86_helpers and lanes in (8, 16) and PW % (lanes * QW) == 0
                  and w.q_base % (lanes * QW) == 0 and DP % (lanes * QW) == 0)
    return dict(QW=QW, NW=NW, QT_SHUFFLE=QT_SHUFFLE, QT_TRANSPOSE=transpose_words(lanes),
                NB=NW // lanes * lanes if QT_SHUFFLE else 0)
