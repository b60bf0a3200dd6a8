"""RoPE in place on the fused path's qkv temporary (CPUs): one pass over the Q and K columns.

The fused program runs this kernel between the packed QKV GEMM and the attention template
(mhagen/lower/fused.py), so the attention kernels read rotated Q and K where they always do.
One parallel task per block of ROW_BLOCK rows of batch * seq; it walks the Q and K heads,
each head down its rows: per row, the head's first rotary_dim columns are loaded in whole
vectors (a head starts on a vector boundary and a vector never straddles a GEMM column
panel), rotated with the position's cos/sin (a constant table [2, seq, rotary_dim / 2]
built at build time in float64) and stored back. A head's columns lie in a few column
panels, each a contiguous [rows, panel] array, so a task streams those panels down (and the
block's cos/sin rows stay in L1 from head to head); a task per row, across every head, had
jumped a panel's rows x 128 bytes from one head to the next, 32 KiB at 256 rows on AVX-512,
every access in one L1 set (see benchmarks/PERFORMANCE.md, Schedule decisions). Cost: read
and write rotary_dim columns of each of heads + kv_heads heads per row, a small share of the
QKV GEMM's memory traffic and nothing next to its flops; no extra temporary.
A packed call's kernel (w.varlen, mhagen/packed.py) reads each token's position in its own
sequence from a `positions` array the call writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.lower.te import call_scalars
from mhagen.schedules.attention_common import with_scalars
from mhagen.schedules.cpu.decode_params import sequence_of_macro


ROW_BLOCK = 32   # rows per task


@dataclass(frozen=True)
class RotaryConfig:
    lanes: int
    """columns per vector load/store (the target's float32 lanes)."""


def rotary_layout(w):
    """(first column, heads to rotate, padded head width, rotary_dim, half) of workload w.
    Q heads then K heads sit side by side in qkv (the fusion pass orders them so)."""
    H, G, DP = w.heads, w.kv_heads, w.head_dim_padded
    assert w.k_base == w.q_base + H * DP, (w.q_base, w.k_base, H, DP)
    rd = w.rotary["rotary_dim"]
    return w.q_base, H + G, DP, rd, rd // 2


class RotaryRule:
    name = "rotary"

    def applies(self, stage, target):
        return stage.pattern == "rotary_template"

    def default_config(self, workload, target):
        return RotaryConfig(lanes=target.lanes)

    def build(self, w, cfg, target):
        return build_rotary(w, cfg)


def build_rotary(w, cfg):
    B, S = w.batch, w.seq
    BASE, SLOTS, DP, RD, HALF = rotary_layout(w)
    LN = cfg.lanes
    PW = w.panel
    NP, M = w.qkv_width // PW, w.rows
    assert DP % LN == 0 and PW % LN == 0 and BASE % LN == 0, (DP, PW, BASE, LN)
    NCH = -(-RD // LN)          # vectors covering the rotated columns
    TAIL = NCH * LN - RD        # columns of the last vector that pass unchanged

    P = w.cache or S       # table rows: positions up to the cache length (decoding)
    CB = B                 # decoding: the cache's rows (a packed call's scalar batch is 1)
    scalars = ()
    if w.symbolic:         # the call's batch and seq: parameters, rows dense b*seq + t
        scalars = B, S = call_scalars()
        M = (B * S + w.row_tile - 1) // w.row_tile * w.row_tile
    RB = ROW_BLOCK if scalars else max(1, min(ROW_BLOCK, B * S))   # a decode step: 1 row
    NRB = (B * S + RB - 1) // RB

    @T.macro
    def body(qkv, rope, slot, row, pos):
        x = T.decl_buffer((NCH * LN,), "float32")
        y = T.decl_buffer((NCH * LN,), "float32")
        if row < B * S:
            for ch in range(NCH):
                for ln in T.vectorized(LN):
                    x[ch * LN + ln] = qkv[(BASE + slot * DP + ch * LN) // PW, row,
                                          (BASE + slot * DP + ch * LN) % PW + ln]
            for i in T.vectorized(HALF):
                y[i] = x[i] * rope[0, pos, i] - x[i + HALF] * rope[1, pos, i]
                y[i + HALF] = x[i + HALF] * rope[0, pos, i] + x[i] * rope[1, pos, i]
            for i in T.vectorized(TAIL + 1):
                if i < TAIL:
                    y[RD + i] = x[RD + i]
            for ch in range(NCH):
                for ln in T.vectorized(LN):
                    qkv[(BASE + slot * DP + ch * LN) // PW, row,
                        (BASE + slot * DP + ch * LN) % PW + ln] = y[ch * LN + ln]

    if w.cache and w.packed:
        return packed_rotary(w, body, scalars, (NP, M, PW), CB, P, HALF, SLOTS, B * S)

    if w.cache:
        @T.prim_func(check_well_formed=False)   # free scalars: see below
        def rotary(qkv: T.Buffer((NP, M, PW), "float32"),
                   cache_lens: T.Buffer((B,), "int32"),
                   rope: T.Buffer((2, P, HALF), "float32")):
            T.func_attr({"global_symbol": "rotary", "tirx.noalias": True})
            for rb in T.parallel(NRB):
                for slot in range(SLOTS):
                    for r in range(RB):      # token t of row b is at cache_lens[b] + t
                        row = rb * RB + r
                        body(qkv, rope, slot, row,
                             T.min(cache_lens[T.min(row, B * S - 1) // S] + row % S, P - 1))
        return with_scalars(rotary, scalars)

    if w.varlen:
        @T.prim_func(check_well_formed=False)   # free scalars: see below
        def rotary(qkv: T.Buffer((NP, M, PW), "float32"),
                   positions: T.Buffer((B * S,), "int32"),
                   rope: T.Buffer((2, P, HALF), "float32")):
            T.func_attr({"global_symbol": "rotary", "tirx.noalias": True})
            for rb in T.parallel(NRB):
                for slot in range(SLOTS):
                    for r in range(RB):      # a packed token: its sequence's own position
                        row = rb * RB + r
                        body(qkv, rope, slot, row, positions[T.min(row, B * S - 1)])
        return with_scalars(rotary, scalars)

    @T.prim_func(check_well_formed=False)   # free scalar vars: see below
    def rotary(qkv: T.Buffer((NP, M, PW), "float32"),
               rope: T.Buffer((2, P, HALF), "float32")):
        T.func_attr({"global_symbol": "rotary", "tirx.noalias": True})
        for rb in T.parallel(NRB):
            for slot in range(SLOTS):
                for r in range(RB):
                    row = rb * RB + r
                    body(qkv, rope, slot, row, row % S)

    return with_scalars(rotary, scalars)


def packed_rotary(w, body, scalars, qkv_shape, batch, positions, half, slots, tokens):
    """The rotary kernel of a packed decoding call (qkv, cache_lens, cu_seqlens, rope): row m
    is token m - cu_seqlens[b] of the batch row b whose tokens hold it, at position
    cache_lens[b] + m - cu_seqlens[b]; a task's rows find theirs once, then every head."""
    RB = ROW_BLOCK
    NRB = (tokens + RB - 1) // RB
    sequence_of = sequence_of_macro(batch)

    @T.prim_func(check_well_formed=False)   # free scalars until with_scalars
    def rotary(qkv: T.Buffer(qkv_shape, "float32"),
               cache_lens: T.Buffer((batch,), "int32"),
               cu_seqlens: T.Buffer((batch + 1,), "int32"),
               rope: T.Buffer((2, positions, half), "float32")):
        T.func_attr({"global_symbol": "rotary", "tirx.noalias": True})
        for rb in T.parallel(NRB):
            pos = T.decl_buffer((RB,), "int32")
            found = T.decl_buffer((1,), "int32")
            for r in range(RB):
                sequence_of(cu_seqlens, rb * RB + r, found)
                pos[r] = T.min(cache_lens[found[0]] + rb * RB + r - cu_seqlens[found[0]],
                               positions - 1)
            for slot in range(slots):
                for r in range(RB):
                    body(qkv, rope, slot, rb * RB + r, pos[r])

    return with_scalars(rotary, scalars)
