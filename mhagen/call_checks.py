"""The checks of a call's arguments against a graph (x, the context, key lengths, a KV
cache), shared by the compiled modules and the float64 oracle: shapes, lengths and cache
room, each array read through the one input policy (mhagen/inputs.py)."""
from __future__ import annotations

import numpy as np

from mhagen.errors import InputError
from mhagen.inputs import LENGTHS, argument
from mhagen.kvcache import KVCache


def check_input(graph, x, dtype=None) -> np.ndarray:
    """Check x against the graph's input [batch, seq, d_model]; return it as a numpy array
    (mhagen/inputs.py: converted or refused; dtype: what it is converted to, as there)."""
    d_model = graph.inputs[0].attrs["shape"][2]
    x = argument(x, "x", dtype=dtype, expects=f"[batch, seq, {d_model}]")
    if x.ndim != 3 or x.shape[2] != d_model:
        raise InputError(f"x has shape {x.shape}; graph {graph.name!r} takes "
                         f"[batch, seq, {d_model}]")
    return x


def check_context(graph, context, batch: int, dtype=None):
    """The context of a cross-attention graph ([batch, kv_seq, kv_dim], as a numpy array:
    mhagen/inputs.py, dtype as there), or None for other graphs (which must not get one)."""
    node = graph.context_input
    if node is None:
        if context is not None:
            raise InputError(f"graph {graph.name!r} has one input; context= is for "
                             "cross-attention layers (mhagen.mha(..., cross=True))")
        return None
    if context is None:
        raise InputError(f"graph {graph.name!r} is a cross-attention layer: pass context= "
                         f"(keys and values come from it), [batch, kv_seq, "
                         f"{node.attrs['shape'][2]}]")
    width = node.attrs["shape"][2]
    context = argument(context, "context", dtype=dtype, expects=f"[batch, kv_seq, {width}]")
    if context.ndim != 3 or context.shape[0] != batch or context.shape[2] != width \
            or context.shape[1] < 1:
        raise InputError(f"context has shape {context.shape}; this layer takes [batch, "
                         f"kv_seq, {width}] with batch {batch} (x's) and kv_seq >= 1")
    return context


def check_lengths(graph, kv_lens, batch: int, seq: int):
    """The call-time key lengths of a graph with a lengths input: int32 [batch], each in
    [0, seq]; None for other graphs (which must not get any)."""
    if graph.lengths_input is None:
        if kv_lens is not None:
            raise InputError(f"graph {graph.name!r} takes no key lengths; build the layer with "
                             "mhagen.mha(..., key_padding=True) to pass kv_lens")
        return None
    if kv_lens is None:
        raise InputError(f"graph {graph.name!r} pads keys by length: pass kv_lens (int, "
                         f"[batch] = [{batch}], each in 0..{seq})")
    lens = argument(kv_lens, "kv_lens", need=LENGTHS, expects=f"of shape ({batch},)")
    if lens.shape != (batch,):
        raise InputError(f"kv_lens must be integers of shape ({batch},), got {lens.dtype} "
                         f"{lens.shape}")
    check_length_range(lens, seq)
    return np.ascontiguousarray(lens)


def check_length_range(lens, seq: int) -> None:
    """Raise InputError unless every key length lies in 0..seq (a module's call and a
    prepared run check each call)."""
    held = lens.tolist()
    if held and (min(held) < 0 or max(held) > seq):
        raise InputError(f"kv_lens must lie in 0..{seq} (the sequence length), got {held}")


def check_cache(graph, cache, batch: int, seq: int, dtype=None, spec=None):
    """The KVCache of a decoding graph, checked for [batch, seq new tokens]; None for other
    graphs (which must not get one). spec: the graph's cache_shape, if known."""
    if graph.cache_lens_input is None:
        if cache is not None:
            raise InputError(f"graph {graph.name!r} keeps no K/V cache; build the layer with "
                             "mhagen.mha(..., kv_cache=max_len) to pass cache=")
        return None
    if cache is None:
        raise InputError(f"graph {graph.name!r} decodes with a K/V cache: pass "
                         "cache=mhagen.KVCache.empty(layer_or_module, batch)")
    if not isinstance(cache, KVCache):
        raise InputError(f"cache= takes a mhagen.KVCache, got {type(cache).__name__}")
    cache.check(graph, batch, seq, dtype, spec)
    return cache


def check_cu_seqlens(cu_seqlens, total: int, name: str = "cu_seqlens",
                     sequences: int | None = None) -> np.ndarray:
    """The offsets of packed sequences (FlashAttention's varlen form): int32 [n + 1],
    starting at 0, never decreasing, ending at `total` (the packed tokens); sequence i is
    tokens cu[i]:cu[i+1]. sequences: the n it must describe, when known (a cache's rows)."""
    cu = argument(cu_seqlens, name, need=LENGTHS, expects="[0, end of sequence 0, ...]")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise InputError(f"{name} must be a 1-D list of offsets [0, end of sequence 0, ..., "
                         f"{total}] (n + 1 entries for n sequences), got shape {cu.shape}")
    if sequences is not None and cu.shape[0] != sequences + 1:
        raise InputError(f"{name} has {cu.shape[0]} entries; {sequences} sequences need "
                         f"{sequences + 1} (0, then where each one ends)")
    held = cu.tolist()
    if held[0] != 0 or held[-1] != total:
        raise InputError(f"{name} must start at 0 and end at {total} (the packed tokens), "
                         f"got {held[0]} .. {held[-1]}")
    steps = np.diff(cu)
    if (steps < 0).any():
        where = int(np.argmax(steps < 0))
        raise InputError(f"{name} must never decrease: entry {where + 1} ({held[where + 1]}) "
                         f"is below entry {where} ({held[where]})")
    return np.ascontiguousarray(cu, dtype=np.int32)
