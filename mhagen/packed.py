"""Packed variable-length calls (FlashAttention's varlen form): a call's arguments checked,
and what its offsets become for the kernels. No TVM: the module's call path, the float64
oracle and the lowering read it; which layers take packed calls is a property of the graph
(mhagen/ir/reference.py: packed_refusal, beside the calls' float64 reference).

A packed call holds the tokens of n sequences one after the other, x [1, total, d_model],
sequence i being tokens cu_seqlens[i]:cu_seqlens[i+1] (cross-attention: its keys and values
context rows cu_seqlens_k[i]:cu_seqlens_k[i+1]). Its meaning is each sequence run alone: the
mask, score modifier and rotary positions count from the sequence's own first token, and
its own lengths are q_len and kv_len.

The attention kernel of such a call (schedules/cpu/attention_kernel.py, `varlen`) runs one
task per (head, entry of the tile table): a query tile of one sequence, whose key blocks
stop at that sequence's last key, so no tile crosses a sequence boundary.
"""
from __future__ import annotations

import numpy as np

from mhagen.call_checks import check_cache, check_context, check_cu_seqlens, check_input
from mhagen.errors import InputError
from mhagen.inputs import argument

# the tile table's columns, one row per query tile: the sequence's first query row and its
# length, its first key row and its number of keys, and the tile's index in the sequence
TILE_FIELDS = ("q_start", "q_len", "k_start", "k_len", "q_tile")


def query_tile_order(i, n):
    """The query tile of a sequence's i-th tile (of n): 0, n-1, 1, n-2, ... (as the padded
    kernel's query_tile_order: a causal mask's light tiles paired with heavy ones). numpy
    arrays or ints."""
    odd = i % 2
    return odd * (n - 1) + (1 - 2 * odd) * (i // 2)


def tile_table(cu_q, cu_k, q_tile: int) -> np.ndarray:
    """The tile table of a packed call: int32 [tiles, len(TILE_FIELDS)], each sequence's
    ceil(length / q_tile) query tiles in query_tile_order, sequences in order (an empty one
    has none). cu_q, cu_k: the checked offsets of the queries and of the keys."""
    cu_q = np.asarray(cu_q, np.int64)
    cu_k = np.asarray(cu_k, np.int64)
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    per_seq = -(-q_lens // q_tile)
    seq = np.repeat(np.arange(len(q_lens)), per_seq)
    first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    order = query_tile_order(np.arange(len(seq)) - first, per_seq[seq])
    table = np.stack([cu_q[seq], q_lens[seq], cu_k[seq], k_lens[seq], order], axis=1)
    return np.ascontiguousarray(table, dtype=np.int32).reshape(-1, len(TILE_FIELDS))


def token_positions(cu) -> np.ndarray:
    """Each packed token's position in its own sequence: int32 [total] (rotary angles)."""
    cu = np.asarray(cu, np.int64)
    lens = np.diff(cu)
    return (np.arange(cu[-1]) - np.repeat(cu[:-1], lens)).astype(np.int32)


def check_packed(graph, x, cu_seqlens, cu_seqlens_k=None, context=None, kv_lens=None,
                 cache=None, dtype=None) -> tuple:
    """(x, cu_seqlens, context, cu_seqlens_k) of a packed call, checked: x [1, total,
    d_model], the offsets (mhagen.call_checks.check_cu_seqlens) ending at its tokens; a
    cross-attention layer's context [1, total_kv, kv_dim] and its offsets cu_seqlens_k over
    the same sequences (self-attention: cu_seqlens_k is cu_seqlens). Arrays read through
    the input policy (dtype: what x and a context are converted to, as there). Refuses key
    lengths (a packed sequence has no padding) and a cache."""
    if kv_lens is not None:
        raise InputError("a packed call has no padding: each sequence's keys are its own "
                         "tokens (a cross-attention's: its context rows, cu_seqlens_k); "
                         "drop kv_lens")
    check_cache(graph, cache, 1, 0)
    x = check_input(graph, x, dtype)
    if x.shape[0] != 1:
        raise InputError(f"a packed call's x is [1, total_tokens, {x.shape[2]}] (every "
                         f"sequence's tokens one after the other, as cu_seqlens says), got "
                         f"{x.shape}")
    cu = check_cu_seqlens(cu_seqlens, x.shape[1])
    node = graph.context_input
    if node is None:
        if cu_seqlens_k is not None:
            raise InputError("cu_seqlens_k gives a cross-attention layer's context offsets; "
                             "a self-attention sequence attends to its own tokens: drop it")
        check_context(graph, context, 1)
        return x, cu, None, cu
    width = node.attrs["shape"][2]
    if context is None or cu_seqlens_k is None:
        raise InputError(f"graph {graph.name!r} is a cross-attention layer: a packed call "
                         f"takes context= (every sequence's context rows one after the other, "
                         f"[1, total_kv_tokens, {width}]) and cu_seqlens_k= (their offsets)")
    context = argument(context, "context", dtype=dtype,
                       expects=f"[1, total_kv_tokens, {width}]")
    if context.ndim != 3 or context.shape[0] != 1 or context.shape[2] != width:
        raise InputError(f"a packed call's context is [1, total_kv_tokens, {width}], got "
                         f"{context.shape}")
    cu_k = check_cu_seqlens(cu_seqlens_k, context.shape[1], "cu_seqlens_k",
                            sequences=len(cu) - 1)
    alone = np.flatnonzero((np.diff(cu) > 0) & (np.diff(cu_k) == 0))
    if alone.size:
        raise InputError(f"sequence {int(alone[0])} has queries but no context rows "
                         f"(cu_seqlens_k); a query needs at least one key, as a "
                         f"cross-attention call needs kv_seq >= 1")
    return x, cu, context, cu_k
