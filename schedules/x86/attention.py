"""Fused attention template for CPUs with wide vectors (flash-style online softmax).

One parallel task per (batch, head, query tile of q_tile rows). For each key block of
kv_block keys that the block table does not skip:
    S = Q K^T * scale (register tiles of tile_rows x tile_cols), masked only if the block is
        partially visible;
    online softmax per row: m' = max(m, max S), P = exp(S - m'), l = l e^(m-m') + sum P,
        O = O e^(m-m');
    O += P V (register tiles).
Finally out = O / l (a row that saw no key gives 0). Memory per task: q_tile x (kv_block +
head_dim) floats; the [S, S] score matrix never exists. The block table (built at build
time from the mask expression, like FlexAttention's BlockMask) marks each (query tile, key
block) as 0 skip, 1 partial (apply the mask), 2 full (no mask work): causal masks skip about
half the blocks.
"""
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from mhagen.lower.program import round_up
from mhagen.lower.te import mask_to_tir
from mhagen.schedules.x86.fast_math import exp2, f32

SKIP, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class AttentionConfig:
    q_tile: int
    """query rows per task (a multiple of tile_rows)."""
    kv_block: int
    """keys per block of the online softmax (a multiple of tile_cols)."""
    tile_rows: int
    """rows of a register tile (unrolled)."""
    tile_cols: int
    """columns of a score register tile (vectorised; a multiple of the lanes)."""


class AttentionRule:
    name = "attention"

    def applies(self, stage, target):
        return stage.pattern == "attention_template"

    def default_config(self, workload, target):
        lanes = target.lanes
        seq = workload["seq"]
        q_tile = 64 if seq >= 256 else round_up(min(seq, 32), 8)
        kv_block = 128 if seq >= 128 else round_up(seq, 2 * lanes)
        return AttentionConfig(q_tile=q_tile, kv_block=kv_block, tile_rows=8,
                               tile_cols=2 * lanes)

    def make_config(self, values: dict, target) -> AttentionConfig:
        """A config from a tuning record, checked against the template's constraints."""
        cfg = AttentionConfig(**{k: int(values[k]) for k in
                                 ("q_tile", "kv_block", "tile_rows", "tile_cols")})
        lanes = target.lanes
        if (cfg.q_tile % cfg.tile_rows or cfg.kv_block % cfg.tile_cols or cfg.tile_cols % lanes
                or min(cfg.q_tile, cfg.kv_block, cfg.tile_rows) < 1):
            raise ValueError(f"{cfg} breaks the template's tiling constraints")
        return cfg

    def candidates(self, workload, target) -> list:
        """Configs worth measuring for a workload (the tuning space of this template)."""
        seq, lanes = workload["seq"], target.lanes
        out = []
        for q_tile in (32, 64, 128):
            for kv_block in (64, 128, 256):
                if q_tile > 2 * seq or kv_block > 2 * max(seq, 2 * lanes):
                    continue
                out.append(AttentionConfig(q_tile, kv_block, 8, 2 * lanes))
        default = self.default_config(workload, target)
        return [default] + [c for c in out if c != default]

    def build(self, w, cfg, target):
        return build_attention(w, cfg, target.lanes, target.vector_registers)


def layout(w, cfg):
    """Padded sizes shared by the lowering (K/V layout kernel, block table) and the template."""
    seq, d = w["seq"], w["head_dim"]
    return {"n_q_tiles": -(-seq // cfg.q_tile), "n_kv_blocks": -(-seq // cfg.kv_block),
            "seq_padded": round_up(seq, cfg.kv_block), "head_dim_padded": round_up(d, 16)}


def output_tile_cols(head_dim_padded, tile_rows, lanes, registers):
    """Width (over head_dim) of the P V register tile: the widest of 32, 16, 8 that divides
    the padded head_dim and whose tile_rows x width accumulators leave 4 vector registers
    free. AVX-512 (16 lanes, 32 registers): 32; 256-bit SVE (8, 32): 16; NEON (4, 32): 8."""
    for width in (32, 16, 8):
        if head_dim_padded % width == 0 and tile_rows * width // lanes <= registers - 4:
            return width
    return 8


def build_attention(w, cfg, lanes, registers=32):
    """The attention PrimFunc for workload w (see mhagen/lower/fused.py for its fields)."""
    B, S, H, G, d = w["batch"], w["seq"], w["heads"], w["kv_heads"], w["head_dim"]
    L = layout(w, cfg)
    NQT, NKB, TP, DP = L["n_q_tiles"], L["n_kv_blocks"], L["seq_padded"], L["head_dim_padded"]
    MQ, KB, MR, NR = cfg.q_tile, cfg.kv_block, cfg.tile_rows, cfg.tile_cols
    NV = output_tile_cols(DP, MR, lanes, registers)   # output register tile width
    LN = lanes
    GROUP = H // G
    QKV_W, Q_BASE, HD = w["qkv_width"], w["q_base"], H * d
    TB, TH = w["table_batch"], w["table_heads"]
    c_log2e = f32(w["scale"] * 1.4426950408889634)
    neg_inf = f32(float("-inf"))
    mask = w.get("mask")
    M = B * S

    def visible(b, h, qi, kj):
        cond = kj < S
        if mask is not None:
            cond = tirx.all(cond, mask_to_tir(mask, b, h, qi, kj, S, S))
        return cond

    def tb(b):
        return b if TB > 1 else 0

    def th(h):
        return h if TH > 1 else 0

    @T.macro
    def online_softmax(masked, s_buf, o_buf, m_buf, l_buf, red, row):
        # per row i: m' = max(m, max_j s), p = 2^(c (s - m')), l = l 2^(c (m - m')) + sum p,
        # O *= 2^(c (m - m')), with c = scale * log2(e) (scores are stored unscaled).
        for i in range(MQ):
            for jj in T.vectorized(LN):
                red[jj] = neg_inf
            for jo in range(KB // LN):
                for jj in T.vectorized(LN):
                    red[jj] = T.max(red[jj], s_buf[i, jo * LN + jj])
            row[0] = m_buf[i]
            for jj in range(LN):
                row[0] = T.max(row[0], red[jj])
            row[1] = T.Select(row[0] == neg_inf, T.float32(0), row[0] * c_log2e)
            for jj in T.vectorized(LN):
                red[jj] = T.float32(0)
            for jo in range(KB // LN):
                for jj in T.vectorized(LN):
                    if masked:
                        s_buf[i, jo * LN + jj] = T.Select(
                            s_buf[i, jo * LN + jj] == neg_inf, T.float32(0),
                            exp2(s_buf[i, jo * LN + jj] * c_log2e - row[1]))
                    else:
                        s_buf[i, jo * LN + jj] = exp2(s_buf[i, jo * LN + jj] * c_log2e - row[1])
                    red[jj] = red[jj] + s_buf[i, jo * LN + jj]
            alpha = exp2(m_buf[i] * c_log2e - row[1])
            m_buf[i] = row[0]
            row[0] = T.float32(0)
            for jj in range(LN):
                row[0] = row[0] + red[jj]
            l_buf[i] = l_buf[i] * alpha + row[0]
            for j in T.vectorized(DP):
                o_buf[i, j] = o_buf[i, j] * alpha

    @T.prim_func
    def attention(qkv: T.Buffer((M, QKV_W), "float32"),
                  kt: T.Buffer((B, G, NKB, d, KB), "float32"),
                  vp: T.Buffer((B, G, TP, DP), "float32"),
                  blocks: T.Buffer((TB, TH, NQT, NKB), "int32"),
                  out: T.Buffer((M, HD), "float32")):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        for task in T.parallel(B * H * NQT):
            s_buf = T.decl_buffer((MQ, KB), "float32")
            o_buf = T.decl_buffer((MQ, DP), "float32")
            m_buf = T.decl_buffer((MQ,), "float32")
            l_buf = T.decl_buffer((MQ,), "float32")
            acc = T.decl_buffer((MR, NR), "float32", scope="local")
            acc_o = T.decl_buffer((MR, NV), "float32", scope="local")
            red = T.decl_buffer((LN,), "float32", scope="local")
            row = T.decl_buffer((2,), "float32", scope="local")
            b = task // (H * NQT)
            h = task // NQT % H
            qt = task % NQT
            g = h // GROUP
            q0 = qt * MQ
            for i in range(MQ):
                m_buf[i] = neg_inf
                l_buf[i] = T.float32(0)
                for j in T.vectorized(DP):
                    o_buf[i, j] = T.float32(0)
            for kb in range(NKB):
                state = blocks[tb(b), th(h), qt, kb]
                if state != SKIP:
                    k0 = kb * KB
                    for io in range(MQ // MR):
                        for jo in range(KB // NR):
                            for ii in T.unroll(MR):
                                for jj in T.vectorized(NR):
                                    acc[ii, jj] = T.float32(0)
                            for c in range(d):
                                for ii in T.unroll(MR):
                                    for jj in T.vectorized(NR):
                                        acc[ii, jj] = acc[ii, jj] + qkv[
                                            b * S + T.min(q0 + io * MR + ii, S - 1),
                                            Q_BASE + h * d + c] * kt[b, g, kb, c, jo * NR + jj]
                            if state == FULL:
                                for ii in T.unroll(MR):
                                    for jj in T.vectorized(NR):
                                        s_buf[io * MR + ii, jo * NR + jj] = acc[ii, jj]
                            else:
                                for ii in T.unroll(MR):
                                    for jj in T.vectorized(NR):
                                        s_buf[io * MR + ii, jo * NR + jj] = T.Select(
                                            visible(b, h, q0 + io * MR + ii, k0 + jo * NR + jj),
                                            acc[ii, jj], neg_inf)
                    if state == FULL:
                        online_softmax(False, s_buf, o_buf, m_buf, l_buf, red, row)
                    else:
                        online_softmax(True, s_buf, o_buf, m_buf, l_buf, red, row)
                    for io in range(MQ // MR):
                        for jo in range(DP // NV):
                            for ii in T.unroll(MR):
                                for jj in T.vectorized(NV):
                                    acc_o[ii, jj] = o_buf[io * MR + ii, jo * NV + jj]
                            for kk in range(KB):
                                for ii in T.unroll(MR):
                                    for jj in T.vectorized(NV):
                                        acc_o[ii, jj] = acc_o[ii, jj] + s_buf[
                                            io * MR + ii, kk] * vp[b, g, k0 + kk, jo * NV + jj]
                            for ii in T.unroll(MR):
                                for jj in T.vectorized(NV):
                                    o_buf[io * MR + ii, jo * NV + jj] = acc_o[ii, jj]
            for i in range(MQ):
                if q0 + i < S:
                    row[0] = T.Select(l_buf[i] > T.float32(0), T.float32(1) / l_buf[i],
                                      T.float32(0))
                    for j in range(d):
                        out[b * S + q0 + i, h * d + j] = o_buf[i, j] * row[0]

    return attention
