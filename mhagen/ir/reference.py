"""The float64 numpy oracle: interprets any graph node by node (no fusion, no tricks); the
reference semantics of the node kinds, beside them (Graph.reference() runs it; the public
path is mhagen.reference).

Every compiled path is compared against this. Semantics per node kind (rotary: mhagen/ir/rope.py):
softmax of a fully masked row (all -inf) is zeros, not NaN.
"""
from __future__ import annotations

import numpy as np

from mhagen.dtypes import numpy_dtype, to_storage
from mhagen.errors import InputError
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.numpy_ops import NUMPY_OPS
from mhagen.call_checks import (check_cache, check_context, check_cu_seqlens, check_input,
                                check_lengths)
from mhagen.kvcache import KVCache
from mhagen.packed import check_packed
from mhagen.paged_cache import PagedKVCache
from mhagen.weights import check_weights


def positions(batch: int, q_len: int, kv_len: int, lengths=None, offsets=None) -> dict:
    """The index variables of a [batch, q_len, kv_len] score grid. `lengths` ([batch] key
    lengths given at call time) is what masks read as kv_len; `offsets` ([batch], a decoding
    layer's cache_lens) puts query t at q_idx = offsets[b] + t with kv_len = offsets[b] +
    q_len keys (the cached ones and the new ones)."""
    env = {"batch": np.arange(batch)[:, None, None], "head": 0,
           "q_idx": np.arange(q_len)[None, :, None], "kv_idx": np.arange(kv_len)[None, None, :],
           "q_len": q_len, "kv_len": kv_len}
    if lengths is not None:
        env["kv_len"] = np.asarray(lengths).reshape(-1, 1, 1)
    if offsets is not None:
        off = np.asarray(offsets).reshape(-1, 1, 1)
        env["q_idx"] = env["q_idx"] + off
        env["kv_len"] = off + q_len
    return env


def mask_grid(mask: ex.Expr, batch: int, head: int, q_len: int, kv_len: int,
              lengths=None, offsets=None) -> np.ndarray:
    """The boolean [batch, q_len, kv_len] grid of a mask expression for one head (see
    positions() for lengths and offsets; with offsets, keys past kv_len are never kept)."""
    env = dict(positions(batch, q_len, kv_len, lengths, offsets), head=head)
    grid = ex.evaluate(mask, env, NUMPY_OPS)
    if offsets is not None:
        grid = grid & (env["kv_idx"] < env["kv_len"])
    return np.broadcast_to(grid, (batch, q_len, kv_len)).astype(bool)


def apply_score_mod(mod: ex.Expr, s: np.ndarray, head: int, offsets=None) -> np.ndarray:
    """A score modifier applied to scaled scores s [batch, q_len, kv_len] of one head."""
    env = dict(positions(*s.shape, offsets=offsets), head=head, score=s)
    return np.broadcast_to(ex.evaluate(mod, env, NUMPY_OPS), s.shape).astype(s.dtype)


def softmax_rows(s: np.ndarray) -> np.ndarray:
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def run_reference(graph, x, weights, return_all: bool = False, kv_lens=None, cache=None,
                  context=None, rounded_to: str | None = None, cu_seqlens=None, seqs=None):
    """Evaluate `graph` on x with `weights` in float64; the output, or every node's value.
    kv_lens: the per-batch key lengths of a graph with a lengths input; cache: the KVCache of
    a decoding graph (its new K/V rows are written and lens advanced, as a module call does);
    context: a cross-attention graph's second input (its keys and values).
    A half-precision graph (graph.dtype float16/bfloat16) is evaluated on x, context and
    weights rounded to its dtype (what its module computes with), still in float64.
    rounded_to ("float16", "bfloat16"): also round every node's value to that dtype, as a
    framework computing in half precision would (the yardstick of half-precision
    tolerances, mhagen/tolerances.py).
    Decoding graphs: cu_seqlens gives each cache row its own number of new tokens (x [1,
    total, d_model] packed, the output likewise), and cache may be a PagedKVCache with seqs
    its sequences the call's rows are (decode_rows)."""
    if cu_seqlens is not None or seqs is not None or isinstance(cache, PagedKVCache):
        if return_all:
            raise InputError("return_all=True takes a call of one shape: run each row alone")
        return decode_rows(graph, x, weights, cache, cu_seqlens, seqs, rounded_to)
    if len(graph.inputs) > 2 or (len(graph.inputs) == 2 and graph.context_input is None):
        raise InputError("run_reference takes x (and a cross-attention layer's context); "
                         f"this graph has {len(graph.inputs)} inputs")
    x = _stored(graph, check_input(graph, x))
    context = check_context(graph, context, x.shape[0])
    context = None if context is None else _stored(graph, context)
    kv_seq = x.shape[1] if context is None else context.shape[1]
    lens = check_lengths(graph, kv_lens, x.shape[0], kv_seq)
    cache = check_cache(graph, cache, x.shape[0], x.shape[1])
    w = {k: _stored(graph, v) for k, v in check_weights(graph, weights).items()}
    rnd = (lambda v: v) if rounded_to is None else (
        lambda v: v if isinstance(v, Positions) or not np.issubdtype(v.dtype, np.floating)
        else v.astype(numpy_dtype(rounded_to)).astype(np.float64))
    graph.shapes(**graph.dims(*x.shape[:2], kv_seq))
    vals = {}
    for n in graph.nodes:
        a = [vals[i] for i in n.inputs]
        if context is not None and n is graph.context_input:
            vals[n.name] = context.astype(np.float64)
        elif n.kind == "lengths":
            vals[n.name] = lens
        elif n.kind == "cache_lens":
            vals[n.name] = cache.lens.copy().view(Positions)
        elif n.kind == "cache" or (n.kind == "attention" and n.attrs.get("cache")):
            vals[n.name] = _EVAL[n.kind](n, a, w, cache)
        else:
            vals[n.name] = _EVAL[n.kind](n, a, w, x)
        vals[n.name] = rnd(vals[n.name])
    if cache is not None:
        cache.lens += x.shape[1]
    return vals if return_all else vals[graph.output]


def decode_rows(graph, x, weights, cache, cu_seqlens, seqs, rounded_to=None):
    """A decoding call whose rows add their own numbers of new tokens (cu_seqlens [rows +
    1], x [1, total, d_model] packed; without it x [rows, S, d_model]), on a KVCache (rows:
    its batch) or a PagedKVCache (rows: seqs): row by row, each a batch-1 call of the same
    semantics on that row's cache (a paged sequence's gathered into a contiguous one, its
    new K/V rows then written back into the blocks the pool reserved for them)."""
    if graph.cache_lens_input is None:
        raise InputError(f"cu_seqlens and seqs are for decoding layers (kv_cache=); "
                         f"graph {graph.name!r} keeps no K/V cache")
    paged = isinstance(cache, PagedKVCache)
    if paged and seqs is None:
        raise InputError("a PagedKVCache call names its rows' sequences: seqs=[ids]")
    if not paged and seqs is not None:
        raise InputError("seqs= names the sequences of a PagedKVCache; a KVCache's rows are "
                         "the call's rows")
    if not paged and not isinstance(cache, KVCache):
        raise InputError(f"cache= takes a mhagen.KVCache or PagedKVCache, got "
                         f"{type(cache).__name__}")
    rows = len(seqs) if paged else cache.batch
    x = check_input(graph, x)
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise InputError(f"with cu_seqlens, x holds the rows' tokens packed: [1, total, "
                             f"d_model], got {x.shape}")
        cu = check_cu_seqlens(cu_seqlens, x.shape[1], sequences=rows).tolist()
        tokens = x[0]
    else:
        if x.shape[0] != rows:
            raise InputError(f"x has {x.shape[0]} rows; the call runs {rows}")
        cu = [b * x.shape[1] for b in range(rows + 1)]
        tokens = x.reshape(-1, x.shape[2])
    counts = [hi - lo for lo, hi in zip(cu, cu[1:])]
    if paged:
        cache.reserve(seqs, counts)       # refuses a full pool before anything is written
    outs = []
    for b, n in enumerate(counts):
        if n == 0:
            continue
        part = tokens[cu[b]:cu[b + 1]][None]
        if paged:
            seq = seqs[b]
            held = cache.lens(seq)
            row = cache.to_contiguous([seq])
            outs.append(run_reference(graph, part, weights, cache=row, rounded_to=rounded_to))
            cache.write(seq, held, row.k[0, :, held:held + n], row.v[0, :, held:held + n])
            cache.advance([seq], [n])
        else:     # views of row b: written and advanced in place
            row = KVCache(cache.k[b:b + 1], cache.v[b:b + 1], cache.lens[b:b + 1])
            outs.append(run_reference(graph, part, weights, cache=row, rounded_to=rounded_to))
    out = np.concatenate(outs, axis=1) if outs else np.zeros((1, 0, 0))
    return out if cu_seqlens is not None else out.reshape(rows, x.shape[1], -1)


def packed_refusal(graph) -> str | None:
    """Why `graph` takes no packed calls (cu_seqlens=: each sequence run alone, see
    run_packed_reference), or None where it does."""
    if graph.cache_lens_input is not None:
        return ("decoding layers (kv_cache=) take their cache rows' new tokens packed "
                "instead: cu_seqlens= with cache= (modules built with seq_len=None)")
    for node in graph.nodes:
        exprs = [node.attrs.get(k) for k in ("mask", "score_mod", "expr")]
        if node.kind in ("mask", "score_mod", "attention") and any(
                isinstance(e, ex.Expr) and "batch" in ex.variables(e) for e in exprs):
            return ("its mask or score modifier reads `batch`, which a packed sequence does "
                    "not have (each one runs as if alone)")
    return None


def run_packed_reference(graph, x, weights, cu_seqlens, cu_seqlens_k=None, context=None,
                         kv_lens=None, cache=None, rounded_to: str | None = None):
    """The float64 reference of a packed call (mhagen/packed.py): x [1, total, d_model]
    holds n sequences one after the other, sequence i tokens cu_seqlens[i]:cu_seqlens[i+1]
    (a cross-attention layer's context rows: cu_seqlens_k[i]:cu_seqlens_k[i+1] of context
    [1, total_kv, kv_dim]). It is each sequence run alone (run_reference at batch 1: its
    positions from 0, its own lengths as q_len and kv_len, a key-padding layer's kv_lens
    its whole length), the outputs one after the other: [1, total, out_features]."""
    why = packed_refusal(graph)
    if why is not None:
        raise InputError(f"graph {graph.name!r} takes no packed calls (cu_seqlens=): {why}")
    x, cu, context, cu_k = check_packed(graph, x, cu_seqlens, cu_seqlens_k, context,
                                        kv_lens, cache)
    outs = []
    for i in range(len(cu) - 1):
        if cu[i + 1] == cu[i]:
            continue
        kw = {}
        if context is not None:
            kw["context"] = context[:, cu_k[i]:cu_k[i + 1]]
        if graph.lengths_input is not None:
            kw["kv_lens"] = [int(cu_k[i + 1] - cu_k[i])]
        outs.append(run_reference(graph, x[:, cu[i]:cu[i + 1]], weights,
                                  rounded_to=rounded_to, **kw))
    if outs:
        return np.concatenate(outs, axis=1)
    check_weights(graph, weights)
    features = graph.shapes(**graph.dims(1, 1, 1 if context is not None else None))[
        graph.output][2]
    return np.zeros((1, 0, features))


def _stored(graph, a) -> np.ndarray:
    """A float input or weight as the graph's module holds it (rounded to a half-precision
    graph's dtype), in float64."""
    if graph.dtype != "float32":
        a = to_storage("an input", a, graph.dtype)
    return np.asarray(a, dtype=np.float64)


def _append(cache, name, head, new, offsets, dtype="float32"):
    """Write new [batch, S, d] rows of K/V head `head` at offsets[b] into cache.k or cache.v,
    rounded to what the graph's cache stores (`dtype`: a half-precision cache keeps the rows
    rounded, whatever the arrays given here hold); return that head's whole cache [batch,
    max_len, d] in float64."""
    if dtype != "float32":
        new = new.astype(numpy_dtype(dtype))
    store = getattr(cache, name[0])
    for b, o in enumerate(offsets):
        store[b, head, o:o + new.shape[1]] = new[b]
    return store[:, head].astype(np.float64)


def _projection(n, a, w, x):
    weight = w[n.attrs["weight"]]
    if n.kind == "head_projection":
        weight = weight[n.attrs["head"]]
    y = a[0] @ weight
    if n.attrs.get("bias"):
        b = w[n.attrs["bias"]]
        y = y + (b[n.attrs["head"]] if n.kind == "head_projection" else b)
    return y


class Positions(np.ndarray):
    """The value of a cache_lens node: where each batch row's new tokens start."""


def _second(a):
    """(lengths, offsets): what a node's optional second input gives (the key lengths of a
    lengths node, or the positions of a cache_lens node)."""
    if len(a) < 2:
        return None, None
    return (None, np.asarray(a[1])) if isinstance(a[1], Positions) else (a[1], None)


def _mask(n, a, w, x):
    s = a[0]
    lengths, offsets = _second(a)
    grid = mask_grid(n.attrs["mask"], s.shape[0], n.attrs["head"], s.shape[1], s.shape[2],
                     lengths, offsets)
    return np.where(grid, s, -np.inf)


def _qkv_projection(n, a, w, x):
    cols = []
    for seg in n.attrs["segments"]:
        y = a[0] @ w[seg["weight"]][seg["head"]]
        if seg.get("bias"):
            y = y + w[seg["bias"]][seg["head"]]
        cols.append(y)
    return np.concatenate(cols, axis=-1)


def _attention(n, a, w, cache):
    """The fused attention node; `cache` is the KVCache of a decoding layer (else unused)."""
    qkv, d = a[0], n.attrs["head_dim"]
    kv = qkv
    if n.attrs.get("cross"):     # (qkv, kv[, lengths]): K/V columns come from kv
        kv, a = a[1], a[:1] + a[2:]
    bsz, seq = qkv.shape[:2]
    lengths, offsets = _second(a)
    kv_heads = {}    # k offset -> K/V head index (in the caches) and its whole cache rows
    outs = []
    for h, (qo, ko, vo) in enumerate(zip(n.attrs["q_offsets"], n.attrs["k_offsets"],
                                         n.attrs["v_offsets"])):
        q, k, v = qkv[..., qo:qo + d], kv[..., ko:ko + d], kv[..., vo:vo + d]
        if n.attrs.get("rotary") is not None:
            r = n.attrs["rotary"]
            q, k = (rope.apply(t, r["rotary_dim"], r["base"], offsets) for t in (q, k))
        if n.attrs.get("cache"):
            if ko not in kv_heads:
                g = len(kv_heads)
                dtype = n.attrs["cache"].get("dtype", "float32")
                kv_heads[ko] = (_append(cache, "k_cache", g, k, offsets, dtype),
                                _append(cache, "v_cache", g, v, offsets, dtype))
            k, v = kv_heads[ko]
        s = q @ np.swapaxes(k, -1, -2) * n.attrs["scale"]
        if n.attrs.get("score_mod") is not None:
            s = apply_score_mod(n.attrs["score_mod"], s, h, offsets)
        if n.attrs.get("mask") is not None:
            s = np.where(mask_grid(n.attrs["mask"], bsz, h, seq, s.shape[2], lengths, offsets),
                         s, -np.inf)
        outs.append(softmax_rows(s) @ v)
    return np.concatenate(outs, axis=-1)


_EVAL = {
    "input": lambda n, a, w, x: x,
    "head_projection": _projection,
    "output_projection": _projection,
    "rotary": lambda n, a, w, x: rope.apply(a[0], n.attrs["rotary_dim"], n.attrs["base"],
                                            _second(a)[1]),
    "cache": lambda n, a, w, cache: _append(cache, n.attrs["cache"], n.attrs["head"], a[0],
                                            a[1], n.attrs.get("dtype", "float32")),
    "scores": lambda n, a, w, x: a[0] @ np.swapaxes(a[1], -1, -2),
    "scale": lambda n, a, w, x: a[0] * n.attrs["factor"],
    "mask": _mask,
    "score_mod": lambda n, a, w, x: apply_score_mod(n.attrs["expr"], a[0], n.attrs["head"],
                                                    _second(a)[1]),
    "softmax": lambda n, a, w, x: softmax_rows(a[0]),
    "weighted_sum": lambda n, a, w, x: a[0] @ a[1],
    "concat_heads": lambda n, a, w, x: np.concatenate(a, axis=-1),
    "qkv_projection": _qkv_projection,
    "attention": _attention,
}
