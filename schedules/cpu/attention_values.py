"""The CPU attention template's P V stage: O = O alpha + P V over a key block's keys.

value_macros   the stage's TVMScript macros for a kernel layout:
  zip_values     bfloat16 pairs: the block's V rows zipped into pairs of keys (ZIP)
  pv_tile        a register tile of queries x NV head columns, rescaled as it is loaded:
                 FMAs of P broadcasts and V rows (read straight from qkv), or one vdpbf16ps
                 per pair of keys
  add_values     the whole P V: PV_TILES tiles of at most OR queries a column step, or on AMX
                 tiles O^T = O^T alpha + V^T P^T (amx.PV)
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.schedules.x86 import amx
from mhagen.schedules.x86.bf16_dot import DOT, ZIP


def value_macros(k, rules):
    """(zip_values, add_values) for layout k (KernelLayout) and the workload's ScoreRules."""
    return zip_values_macro(k, rules), add_values_macro(k, rules)


def pv_tile_macro(k, rules):
    """pv_tile: one P V register tile."""
    key_row, v_lane = rules.key_row, k.v_lane
    LN, NV, PAIRS = k.LN, k.NV, k.PAIRS

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
                        acc_o[ii, cc] = acc_o[ii, cc] + s_buf[j, r0 + ii] * v_lane(
                            kv, g, co, key_row(b, k0 + j, False), cc)
        for ii in T.unroll(rows):
            for cc in T.vectorized(NV):
                o_buf[r0 + ii, co * NV + cc] = acc_o[ii, cc]

    return pv_tile


def zip_values_macro(k, rules):
    """zip_values: bfloat16 pairs of V rows."""
    key_row = rules.key_row
    DP, PW, LN, V_BASE = k.DP, k.PW, k.LN, k.V_BASE

    @T.macro
    def zip_values(cut, n_zipped, kv32, v32, b, g, k0):
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

    return zip_values


def add_values_macro(k, rules):
    """add_values: the block's P V, on AMX tiles or in PV_TILES register tiles."""
    pv_tile = pv_tile_macro(k, rules)
    MQ, DP, NV, G, NKT, AMX = k.MQ, k.DP, k.NV, k.G, k.NKT, k.AMX
    PV_TILES, PV_ROWS, PV_BIG = k.PV_TILES, k.PV_ROWS, k.PV_BIG

    @T.macro
    def add_values(n_keys, n_pairs, n_rows, kv, s_buf, o_buf, alpha, acc_o, b, g, k0, p32,
                   v32, vt):
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

    return add_values
