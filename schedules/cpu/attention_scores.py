"""The CPU attention template's scores stage: S^T = K Q^T, one row of register tiles at a
time (keys in rows, queries in the lanes), each tile written back through the mask stage.

score_macros   the stage's TVMScript macros for a kernel layout:
  s_tiles        one row of S^T tiles (MR keys from k0 + jo MR, every query tile)
  vector_tile    a tile in vector registers: FMAs of K broadcasts and Q^T vectors, or on
                 bfloat16 pairs one vdpbf16ps per pair of head columns (bf16_dot.py)
  amx_tile       a tile on AMX (amx.SCORES into s_buf), its write-back read back from s_buf
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.schedules.x86 import amx
from mhagen.schedules.cpu.attention_mask import mask_macros
from mhagen.schedules.x86.bf16_dot import DOT


def score_macros(k, rules):
    """s_tiles for layout k (KernelLayout) and the workload's ScoreRules."""
    vector_tile, amx_tile = vector_tile_macro(k, rules), amx_tile_macro(k, rules)
    MQ, NR, AMX = k.MQ, k.NR, k.AMX

    @T.macro
    def s_tiles(masked, clamp, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0, jo, kv32,
                q_t32, k_pad):
        # one row of S^T register tiles (MR keys from k0 + jo MR, every query tile):
        # S^T = K Q^T in log2 units; the write-back masks and takes the running max.
        # clamp: the tile runs past the last key (its key rows clamped, its scores masked)
        for io in range(MQ // NR):
            if AMX:
                amx_tile(masked, clamp, kv, lens, s_buf, m_new, b, h, g, q0, k0, jo, io,
                         q_t32, k_pad)
            else:
                vector_tile(masked, clamp, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0,
                            jo, io, kv32, q_t32)

    return s_tiles


def vector_tile_macro(k, rules):
    """vector_tile: an S^T register tile in vector registers."""
    masked_max = mask_macros(k, rules)
    key_row = rules.key_row
    k_at, k_pair = k.k_at, k.k_pair
    MR, NR, LN, d, CW, PAIRS, zero = k.MR, k.NR, k.LN, k.d, k.CW, k.PAIRS, k.zero

    @T.macro
    def vector_tile(masked, clamp, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0, jo, io,
                    kv32, q_t32):
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
                masked_max(masked, s_buf, m_new, acc[jj, ii], lens, b, h, q0, k0, jo, io, jj,
                           ii)

    return vector_tile


def amx_tile_macro(k, rules):
    """amx_tile: an S^T tile on AMX, written back from s_buf."""
    masked_max = mask_macros(k, rules)
    key_row = rules.key_row
    MQ, MR, NR, d, CW, K_BASE, DP, PW = k.MQ, k.MR, k.NR, k.d, k.CW, k.K_BASE, k.DP, k.PW
    LATE_SCALE = k.LATE_SCALE

    @T.macro
    def amx_tile(masked, clamp, kv, lens, s_buf, m_new, b, h, g, q0, k0, jo, io, q_t32,
                 k_pad):
        # the S^T tile into s_buf, then its write-back from there
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
                    masked_max(masked, s_buf, m_new, s_buf[jo * MR + jj, io * NR + ii], lens,
                               b, h, q0, k0, jo, io, jj, ii)
        else:   # the stored tile is the scores: its max only
            for jj in T.unroll(MR):
                for ii in T.vectorized(NR):
                    m_new[io * NR + ii] = T.max(m_new[io * NR + ii],
                                                s_buf[jo * MR + jj, io * NR + ii])

    return amx_tile
