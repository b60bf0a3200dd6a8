"""Block tables: which (query tile, key block) pairs a mask hides entirely (no TVM).

Like FlexAttention's BlockMask, computed once at build time by evaluating the mask
expression: 0 = skip (nothing visible), 1 = partial (apply the mask per score), 2 = full.
Keys past the sequence (block padding) count as hidden, so a block crossing the end is partial.
"""
from __future__ import annotations

import functools

import numpy as np

from mhagen.ir import expr as ex
from mhagen.ir.numpy_ops import NUMPY_OPS

SKIP, PARTIAL, FULL = 0, 1, 2
KEY_PADDING = ex.kv_idx < ex.kv_len   # with key lengths given per call: skipped at run time


def conjuncts(mask) -> list:
    """The top-level `&` operands of a mask."""
    if isinstance(mask, ex.BinOp) and mask.op == "&":
        return conjuncts(mask.lhs) + conjuncts(mask.rhs)
    return [mask]


def split_lengths(mask, symbolic=False):
    """For a layer with per-call key lengths: (the mask without the parts that read kv_len,
    whether it had the plain padding part kv_idx < kv_len (the kernels skip blocks past
    the length at run time), whether other parts read kv_len (no block is FULL then)).
    symbolic: the lengths are given per call (seq_len=None), so parts that read q_len
    count as parts that read kv_len."""
    if mask is None:
        return None, False, False
    dynamic = {"kv_len", "q_len"} if symbolic else {"kv_len"}
    parts = conjuncts(mask)
    static = [p for p in parts if not dynamic & ex.variables(p)]
    padding = any(p == KEY_PADDING for p in parts)
    others = any(dynamic & ex.variables(p) and p != KEY_PADDING for p in parts)
    rest = None
    for p in static:
        rest = p if rest is None else rest & p
    return rest, padding, others


def table_dims(mask, batch, heads):
    """(batch, heads) extents of the table: 1 where the mask does not depend on them."""
    used = ex.variables(mask) if mask is not None else set()
    return (batch if "batch" in used else 1), (heads if "head" in used else 1)


def block_table(mask, batch, heads, seq, q_tile, kv_block, lengths=False,
                symbolic=False, kv_seq=None) -> np.ndarray:
    """The table of a mask; with key lengths per call (lengths=True), of the parts that do not
    read kv_len (the kernels apply the length at run time, see split_lengths). symbolic: for
    every call length up to seq (positions are absolute, so a tile's state at seq holds for
    the rows and keys of a shorter call; parts that read q_len or kv_len are left to the
    kernel, and the kernel cuts the key blocks at the call's length). kv_seq: the keys'
    length when it differs from the queries' (cross-attention)."""
    kv_seq = seq if kv_seq is None else kv_seq
    if lengths or symbolic:
        static, _, others = split_lengths(mask, symbolic)
        table = block_table(static, batch, heads, seq, q_tile, kv_block, kv_seq=kv_seq)
        if others:
            table = np.where(table == FULL, PARTIAL, table).astype(np.int32)
        return table
    try:
        hash(mask)
    except TypeError:       # an unhashable mask: evaluated, not kept
        return _evaluated_table.__wrapped__(mask, batch, heads, seq, q_tile, kv_block, kv_seq)
    return _evaluated_table(mask, batch, heads, seq, q_tile, kv_block, kv_seq)


@functools.lru_cache(maxsize=16)
def _evaluated_table(mask, batch, heads, seq, q_tile, kv_block, kv_seq) -> np.ndarray:
    """block_table of a mask without per-call lengths, kept (read-only): a build asks for
    the same table in the attention's default config and again in the lowering (a sliding
    window at seq 16384 in 32 x 32 tiles: 0.6 s a table)."""
    tb, th = table_dims(mask, batch, heads)
    n_q, n_kv = -(-seq // q_tile), -(-kv_seq // kv_block)
    table = np.empty((tb, th, n_q, n_kv), np.int32)
    keys = np.arange(n_kv * kv_block)[None, :]
    for b in range(tb):
        for h in range(th):
            for qt in range(n_q):
                rows = np.arange(qt * q_tile, min((qt + 1) * q_tile, seq))[:, None]
                vis = keys < kv_seq
                if mask is not None:
                    env = {"batch": b, "head": h, "q_idx": rows, "kv_idx": keys,
                           "q_len": seq, "kv_len": kv_seq}
                    vis = vis & ex.evaluate(mask, env, NUMPY_OPS)
                vis = np.broadcast_to(vis, (len(rows), keys.shape[1]))
                blocks = vis.reshape(len(rows), n_kv, kv_block)
                any_ = blocks.any(axis=(0, 2))
                all_ = blocks.all(axis=(0, 2))
                table[b, h, qt] = np.where(all_, FULL, np.where(any_, PARTIAL, SKIP))
    table.flags.writeable = False
    return table
