"""Block tables: which (query tile, key block) pairs a mask hides entirely (no TVM).

Like FlexAttention's BlockMask, computed once at build time by evaluating the mask
expression: 0 = skip (nothing visible), 1 = partial (apply the mask per score), 2 = full.
Keys past the sequence (block padding) count as hidden, so a block crossing the end is partial.
"""
from __future__ import annotations

import numpy as np

from mhagen.ir import expr as ex
from mhagen.reference import NUMPY_OPS

SKIP, PARTIAL, FULL = 0, 1, 2


def table_dims(mask, batch, heads):
    """(batch, heads) extents of the table: 1 where the mask does not depend on them."""
    used = ex.variables(mask) if mask is not None else set()
    return (batch if "batch" in used else 1), (heads if "head" in used else 1)


def block_table(mask, batch, heads, seq, q_tile, kv_block) -> np.ndarray:
    tb, th = table_dims(mask, batch, heads)
    n_q, n_kv = -(-seq // q_tile), -(-seq // kv_block)
    table = np.empty((tb, th, n_q, n_kv), np.int32)
    keys = np.arange(n_kv * kv_block)[None, :]
    for b in range(tb):
        for h in range(th):
            for qt in range(n_q):
                rows = np.arange(qt * q_tile, min((qt + 1) * q_tile, seq))[:, None]
                vis = keys < seq
                if mask is not None:
                    env = {"batch": b, "head": h, "q_idx": rows, "kv_idx": keys,
                           "q_len": seq, "kv_len": seq}
                    vis = vis & ex.evaluate(mask, env, NUMPY_OPS)
                vis = np.broadcast_to(vis, (len(rows), keys.shape[1]))
                blocks = vis.reshape(len(rows), n_kv, kv_block)
                any_ = blocks.any(axis=(0, 2))
                all_ = blocks.all(axis=(0, 2))
                table[b, h, qt] = np.where(all_, FULL, np.where(any_, PARTIAL, SKIP))
    return table
