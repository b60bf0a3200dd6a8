"""Import stage 4: the mhagen graph and weights of a matched, read layer.

A layer whose heads share one scale and one mask becomes ``mha(...)`` (``scale=`` given
when it is not 1/sqrt(head_dim); so it compares equal to the layer that was exported); any
other becomes a builder graph with one scale and mask per head (options carry
``imported="onnx"``).
"""
from __future__ import annotations

import math

import numpy as np

from mhagen.dsl import add_heads, mha
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.graph import Graph
from mhagen.onnx._common import OnnxError, first_query_heads


def layer_weights(rec, kv_heads, bias):
    """mhagen weights (float32, per head) from Recovered `rec`; K/V heads come from the
    first query head of each group."""
    first = first_query_heads(len(rec.q), kv_heads)
    weights = {"w_q": np.stack([w for w, _ in rec.q]),
               "w_k": np.stack([rec.k[h][0] for h in first]),
               "w_v": np.stack([rec.v[h][0] for h in first]),
               "w_o": rec.w_o}
    if bias:
        weights.update(b_q=np.stack([b for _, b in rec.q]),
                       b_k=np.stack([rec.k[h][1] for h in first]),
                       b_v=np.stack([rec.v[h][1] for h in first]),
                       b_o=rec.b_o)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}


def layer_graph(name, d_model, d_out, specs, kv_heads, bias):
    """The mhagen graph of a layer made of cores with CoreSpecs `specs`."""
    widths = {s.head_dim for s in specs}
    if len(widths) != 1:
        raise OnnxError(f"heads of different widths {sorted(widths)}; not supported")
    d = widths.pop()
    scales = [s.scale for s in specs for _ in range(s.n_heads)]
    bands = [b for s in specs for b in s.bands]
    score_mod = _score_mod(specs, len(scales))
    rotations = {s.rotary for s in specs}
    if len(rotations) > 1:
        raise OnnxError(f"the attention cores rotate Q and K differently "
                        f"({sorted(map(str, rotations))})")
    rotary = rotations.pop()
    scale = _shared_scale(scales, d)
    if scale is not False and all(b == bands[0] for b in bands) and d_out == d_model:
        causal, mask = bands[0]
        return mha(d_model, len(scales), head_dim=d, kv_heads=kv_heads, causal=causal,
                   mask=mask, bias=bias, score_mod=score_mod, scale=scale, name=name,
                   rotary=None if rotary is None else rope.rotary(*rotary))
    if rotary is not None:
        why = ("its output width differs from its input's" if d_out != d_model else
               "its heads have different masks" if scale is not False else
               f"its heads' score scales are {sorted(set(scales))} (mhagen's rotary layers "
               "take one positive scale)")
        raise OnnxError(f"rotary embeddings on a layer that mha() cannot describe: {why}")
    g = Graph(name, options={"d_model": d_model, "num_heads": len(scales), "head_dim": d,
                             "kv_heads": kv_heads, "bias": bias, "imported": "onnx"})
    x = g.input("x", d_model)
    masks = [_mask_expr(causal, other) for causal, other in bands]
    g.set_output(add_heads(g, x, scales, masks, kv_heads, d, d_out, bias, score_mod=score_mod))
    g.shapes()
    return g


def _score_mod(specs, heads):
    """The layer's score modifiers from its cores: a softcap (the same for every core), then
    a linear distance bias per head (mhagen.alibi when the slopes are ALiBi's) or a learned
    bias per head and distance; or None."""
    caps = {s.cap for s in specs}
    if len(caps) > 1:
        raise OnnxError(f"the attention cores have different softcaps {sorted(map(str, caps))}; "
                        "mhagen layers have one")
    cap = caps.pop()
    slopes = [v for s in specs for v in (s.slopes or [0.0] * s.n_heads)]
    mods = [] if cap is None else [ex.softcap(cap)]
    spans = {len(s.distances[0]) // 2 for s in specs if s.distances}
    if spans:   # a learned bias per distance (T5): every head's as values over distances
        span = spans.pop()
        d = np.arange(-span, span + 1)
        values = [row for s in specs for row in (
            s.distances or [list(slope * d) for slope in (s.slopes or [0.0] * s.n_heads)])]
        mods.append(ex.distance_bias(values, span))
    elif any(slopes):
        alibi = ex.alibi_slopes(heads)
        if np.allclose(slopes, alibi, rtol=1e-5, atol=1e-7):
            mods.append(ex.alibi(heads))
        else:
            mods.append(ex.score + ex.table(slopes, ex.head) * (ex.kv_idx - ex.q_idx))
    return None if not mods else mods[0] if len(mods) == 1 else mods


def _shared_scale(scales, d):
    """mha()'s scale= for heads scaled by `scales`: None for 1/sqrt(d) on every head (the
    default: the graph then equals the exported mha()), the one positive scale they share,
    or False (heads of different scales, or a scale mha() refuses)."""
    std = 1.0 / math.sqrt(d)
    if all(abs(s - std) <= 1e-5 * std for s in scales):
        return None
    first = scales[0]
    if first > 0 and math.isfinite(first) and all(abs(s - first) <= 1e-6 * first
                                                   for s in scales):
        return first
    return False


def _mask_expr(causal, other):
    if not causal:
        return other
    return ex.causal() if other is None else ex.causal() & other
