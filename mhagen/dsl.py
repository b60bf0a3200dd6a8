"""The one-line constructor of the standard multi-head attention layer."""
from __future__ import annotations

import math

import numpy as np

from mhagen.checks import positive_int
from mhagen.errors import GraphError
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.graph import Graph
from mhagen.ir.heads import kv_head_map
from mhagen.ir.verify import check_dtype, check_head_tables


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def mha(d_model: int = 512, num_heads: int = 8, *, head_dim: int | None = None,
        kv_heads: int | None = None, causal: bool = False, mask: ex.Expr | None = None,
        score_mod=None, rotary=None, key_padding: bool = False, kv_cache: int | None = None,
        cross: bool = False, kv_dim: int | None = None, bias: bool = True,
        scale: float | None = None, dtype: str = "float32", cache_dtype: str | None = None,
        name: str = "mha") -> Graph:
    """The standard multi-head attention layer as a graph, head by head.

    Each query head h owns W_Q[h]; each K/V head g owns W_K[g], W_V[g] ([d_model, head_dim]);
    query head h reads K/V head h // (num_heads // kv_heads). Per head:
    softmax(mask(score_mod(Q K^T * scale))) V with scale 1/sqrt(head_dim) unless given; the
    heads are concatenated and projected by W_O ([num_heads * head_dim, d_model]).

    Args:
        d_model: model width D of the input and the output.
        num_heads: number of query heads H.
        head_dim: width d of each head; default d_model // num_heads (must divide then).
        kv_heads: number of K/V heads (grouped/multi-query attention); default num_heads.
            Must divide num_heads; 1 is multi-query attention.
        causal: query i sees keys 0..i.
        mask: any boolean mask expression of (batch, head, q_idx, kv_idx), e.g.
            `mhagen.sliding_window(128)`; combined with `causal` by & when both are given.
        score_mod: a score modifier (a numeric expression of score, batch, head, q_idx,
            kv_idx; e.g. `mhagen.alibi(num_heads)`, `mhagen.softcap(30.0)`) or a list of
            them, applied in order to the scaled score before the mask.
        rotary: rotary position embeddings on every Q and K head after its projection
            (bias included), before the scores: `mhagen.rotary(base=10000.0,
            rotary_dim=None)`, or True for those defaults (LLaMA's half-split layout; see
            mhagen/ir/rope.py). Values are not rotated.
        key_padding: the layer takes per-batch key lengths at call time (`kv_lens`, int32
            [batch]): query rows see keys kv_idx < kv_lens[b] only (combined with the other
            masks by &); a row with no visible key gives zeros. No S x S mask is built.
        kv_cache: a decoding layer with a K/V cache of kv_cache tokens per sequence
            (mhagen/kvcache.py): each call takes S new tokens and a `mhagen.KVCache`, writes
            their K/V rows into it after the cached ones, attends over both and advances the
            cache. Positions are absolute: new token t of row b is at q_idx = lens[b] + t (so
            `causal` is bottom-right aligned, and rotary, ALiBi and windows see true
            positions), kv_len = lens[b] + S. Not with key_padding.
        cross: cross-attention: queries from x [batch, seq, D], keys and values from a
            second input `context` [batch, kv_seq, kv_dim] of its own length (an encoder's
            output); masks see q_idx < seq, kv_idx < kv_seq (q_len = seq, kv_len = kv_seq;
            `causal` is then top-left: query i sees keys 0..i), key_padding pads the
            context. Not with rotary or kv_cache.
        kv_dim: the context's width (cross only); default d_model.
        bias: add biases to every projection (as torch.nn.MultiheadAttention does).
        scale: the factor on every score Q K^T, before score_mod and the mask; default
            1/sqrt(head_dim). T5 uses 1.0, Gemma 2 query_pre_attn_scalar ** -0.5. A positive
            finite number: zero and negative scales are refused (no model uses them, and
            ONNX's Attention operator cannot carry them); a graph built node by node
            (`add_heads`, `Graph.scale`) takes any finite factor.
        dtype: storage dtype of x, the output and the weights: "float32", "float16" or
            "bfloat16" (mhagen/dtypes.py: kernels compute in float32 and round the output).
            A half-precision module takes arrays of its dtype (ml_dtypes.bfloat16 for
            bfloat16) and returns that dtype; float32 arrays are rounded on the way in and
            the result comes back as float32.
        cache_dtype: what a decoding layer's K/V cache stores: "float32" (default), "float16"
            or "bfloat16" (half the bytes a step reads from the cache; the new K/V rows are
            rounded to it, nearest even, and read back as float32). Any layer dtype.

    Weights (see `Graph.init_weights`): w_q [H, D, d], w_k, w_v [kv_heads, D, d] (cross:
    [kv_heads, kv_dim, d]), w_o [H*d, D], and with bias b_q [H, d], b_k, b_v [kv_heads, d],
    b_o [D]. Input x: [batch, seq, D] (cross: and context [batch, kv_seq, kv_dim]); output
    [batch, seq, D].
    """
    head_dim, kv_heads = _head_sizes(d_model, num_heads, head_dim, kv_heads)
    scale = _checked_scale(scale, head_dim)
    _check_mask_and_flags(mask, causal, bias)
    score_mod = _checked_score_mod(score_mod, num_heads)
    rotary = _checked_rotary(rotary, head_dim)
    cache_dtype = _checked_cache(kv_cache, cache_dtype, key_padding)
    kv_dim = _checked_cross(cross, kv_dim, d_model, rotary, kv_cache)
    full_mask = _full_mask(causal, mask, key_padding, kv_cache)
    options = _graph_options(d_model=d_model, num_heads=num_heads, head_dim=head_dim,
                             kv_heads=kv_heads, causal=causal, bias=bias, mask=mask,
                             score_mod=score_mod, rotary=rotary, key_padding=key_padding,
                             kv_cache=kv_cache, cache_dtype=cache_dtype, cross=cross,
                             kv_dim=kv_dim, scale=scale, dtype=dtype)
    g = Graph(name, dtype=dtype, options=options)
    x = g.input("x", d_model)
    context = g.input("context", kv_dim, seq="kv_seq") if cross else None
    lengths = g.lengths("kv_lens") if key_padding else None
    if kv_cache is not None:
        lengths = g.cache_lens("cache_lens")
    g.set_output(add_heads(g, x, [scale] * num_heads,
                           [full_mask] * num_heads, kv_heads, head_dim, d_model, bias,
                           score_mod=score_mod,
                           rotary=None if rotary is None else rotary.attrs(head_dim),
                           lengths=lengths, max_len=kv_cache, context=context,
                           cache_dtype=cache_dtype))
    g.shapes()
    return g


# -- mha()'s steps: each checks (and normalises) a group of options, in the order mha() asks --

def _head_sizes(d_model, num_heads, head_dim, kv_heads) -> tuple[int, int]:
    """(head_dim, kv_heads) with their defaults, checked against d_model and num_heads."""
    positive_int("d_model", d_model)
    positive_int("num_heads", num_heads)
    if head_dim is None:
        if d_model % num_heads:
            ok = [h for h in _divisors(d_model) if h <= 4 * num_heads]
            near = [m for m in (d_model - d_model % num_heads,
                                d_model + num_heads - d_model % num_heads) if m > 0]
            raise GraphError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}; use d_model in "
                f"{near}, num_heads in {ok[-6:]}, or pass head_dim= explicitly")
        head_dim = d_model // num_heads
    positive_int("head_dim", head_dim)
    kv_heads = num_heads if kv_heads is None else kv_heads
    positive_int("kv_heads", kv_heads)
    if num_heads % kv_heads:
        raise GraphError(f"kv_heads={kv_heads} does not divide num_heads={num_heads}; choose "
                         f"kv_heads in {_divisors(num_heads)}")
    return head_dim, kv_heads


def _default_scale(head_dim) -> float:
    return 1.0 / math.sqrt(head_dim)


def _checked_scale(scale, head_dim) -> float:
    """The score scale as a float: 1/sqrt(head_dim) for None, else a positive finite number."""
    if scale is None:
        return _default_scale(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                      np.floating)):
        raise GraphError(f"scale= takes a number (the factor on Q K^T, e.g. 1.0 for T5), got "
                         f"{scale!r}")
    if not (math.isfinite(float(scale)) and scale > 0):
        raise GraphError(f"scale= must be a positive finite number, got {scale!r}; leave it "
                         f"out for the default 1/sqrt(head_dim) = "
                         f"{_default_scale(head_dim):.6g}")
    default = _default_scale(head_dim)    # head_dim ** -0.5 may differ from it in the last bit
    return default if math.isclose(scale, default, rel_tol=1e-12) else float(scale)


def _check_mask_and_flags(mask, causal, bias) -> None:
    if mask is not None and not (isinstance(mask, ex.Expr) and mask.is_bool):
        raise GraphError("mask= takes a boolean mask expression, e.g. mhagen.sliding_window(64) "
                         "or (mhagen.kv_idx <= mhagen.q_idx)")
    for flag, value in (("causal", causal), ("bias", bias)):
        if not isinstance(value, (bool, np.bool_)):
            raise GraphError(f"{flag}= takes True or False, got {value!r}")


def _checked_score_mod(score_mod, num_heads) -> ex.Expr | None:
    """One score modifier (a list is combined in order) or None."""
    if isinstance(score_mod, (list, tuple)):
        bad = [m for m in score_mod if not ex.is_score_mod(m)]
        if bad:
            raise GraphError(f"score_mod= list item {bad[0]!r} is not a score modifier: each "
                             "is a numeric expression of mhagen.score (e.g. "
                             "mhagen.softcap(30.0), mhagen.alibi(num_heads))")
        score_mod = ex.combine(*score_mod) if score_mod else None
    if score_mod is not None and not ex.is_score_mod(score_mod):
        raise GraphError("score_mod= takes a numeric expression of mhagen.score (e.g. "
                         "mhagen.softcap(30.0), mhagen.alibi(num_heads)) or a list of them")
    if score_mod is not None:
        check_head_tables(score_mod, num_heads, "score_mod=")
    return score_mod


def _checked_rotary(rotary, head_dim) -> rope.Rotary | None:
    """A checked rope.Rotary (True: the defaults), or None (None or False)."""
    if rotary is True:
        rotary = rope.Rotary()
    if rotary is not None and rotary is not False and not isinstance(rotary, rope.Rotary):
        raise GraphError("rotary= takes mhagen.rotary(base=..., rotary_dim=...) or True, "
                         f"got {rotary!r}")
    if isinstance(rotary, rope.Rotary):   # built directly, not by mhagen.rotary(): check it
        rotary = rope.rotary(rotary.base, rotary.rotary_dim)
    rotary = rotary or None
    if rotary is not None:
        rope.check_attrs(rotary.attrs(head_dim), head_dim, "mha(rotary=...)")
    return rotary


def _checked_cache(kv_cache, cache_dtype, key_padding) -> str:
    """The K/V cache's dtype (default float32), kv_cache and cache_dtype checked."""
    if cache_dtype is not None:
        if kv_cache is None:
            raise GraphError("cache_dtype= is what a decoding layer's K/V cache stores: pass "
                             "kv_cache=N too, or drop cache_dtype")
        check_dtype(cache_dtype)
    if kv_cache is not None:
        positive_int("kv_cache", kv_cache)
        if key_padding:
            raise GraphError("kv_cache= and key_padding=True do not combine yet: a decoding "
                             "layer's keys are the cached ones (cache.lens says how many)")
    return cache_dtype or "float32"


def _checked_cross(cross, kv_dim, d_model, rotary, kv_cache) -> int | None:
    """The context's width of a cross-attention layer (default d_model); None otherwise."""
    if not isinstance(cross, (bool, np.bool_)):
        raise GraphError(f"cross= takes True or False, got {cross!r}")
    if kv_dim is not None and not cross:
        raise GraphError("kv_dim= is the context's width of a cross-attention layer: pass "
                         "cross=True too, or drop kv_dim")
    if cross:
        kv_dim = d_model if kv_dim is None else positive_int("kv_dim", kv_dim)
        for option, value in (("rotary", rotary), ("kv_cache", kv_cache)):
            if value is not None:
                raise GraphError(f"cross=True does not combine with {option}= yet (queries and "
                                 "keys come from two sequences); drop one")
    return kv_dim


def _full_mask(causal, mask, key_padding, kv_cache) -> ex.Expr | None:
    """causal & mask & (kv_idx < kv_len when keys have lengths), or None."""
    full_mask = ex.causal() if causal else None
    if mask is not None:
        full_mask = mask if full_mask is None else (full_mask & mask)
    if key_padding or kv_cache is not None:
        padding = ex.kv_idx < ex.kv_len
        full_mask = padding if full_mask is None else (full_mask & padding)
    return full_mask


def _graph_options(*, d_model, num_heads, head_dim, kv_heads, causal, bias, mask, score_mod,
                   rotary, key_padding, kv_cache, cache_dtype, cross, kv_dim, scale,
                   dtype) -> dict:
    """The options the graph records (Graph.options): the defaults left out."""
    options = {"d_model": d_model, "num_heads": num_heads, "head_dim": head_dim,
               "kv_heads": kv_heads, "causal": bool(causal), "bias": bool(bias)}
    if mask is not None:
        options["mask"] = repr(mask)
    if score_mod is not None:
        options["score_mod"] = repr(score_mod)
    if rotary is not None:
        options["rotary"] = rotary.attrs(head_dim)
    if key_padding:
        options["key_padding"] = True
    if kv_cache is not None:
        options["kv_cache"] = kv_cache
    if cache_dtype != "float32":
        options["cache_dtype"] = cache_dtype
    if cross:
        options.update(cross=True, kv_dim=kv_dim)
    if scale != _default_scale(head_dim):
        options["scale"] = scale
    if dtype != "float32":
        options["dtype"] = dtype
    return options

def add_heads(g: Graph, x: str, scales, masks, kv_heads: int, head_dim: int, d_out: int,
              bias: bool, score_mod=None, rotary: dict | None = None, lengths=None,
              max_len: int | None = None, context: str | None = None,
              cache_dtype: str = "float32") -> str:
    """Add multi-head attention over input node x to g; return the output projection's name.

    Query head h (len(scales) of them) computes softmax(masks[h](Q_h K^T * scales[h])) V with
    K/V head h // (heads // kv_heads); masks[h] may be None; score_mod (optional) modifies
    every head's scaled scores before the mask; rotary ({base, rotary_dim}, optional) adds
    a rotary node after every Q and K projection; lengths (a lengths node, optional) feeds
    every mask its kv_len per batch; max_len (with lengths a cache_lens node) makes a
    decoding layer: K/V heads go through caches of max_len rows, and the rotary, score_mod
    and mask nodes read the positions (cache_dtype: what the caches store); context (an
    input node, optional) is what K and V
    project (cross-attention), else x. Heads are concatenated and projected to d_out. Node
    and weight names are those of mha().
    """
    positions = lengths if max_len is not None else None
    kv_of = kv_head_map(len(scales), kv_heads)

    def proj(w, i):
        source = x if w == "q" or context is None else context
        return g.head_projection(source, f"w_{w}", i, head_dim,
                                 bias=f"b_{w}" if bias else None, name=f"{w}{i}")

    def rotated(name):
        return name if rotary is None else g.rotary(name, name=f"r{name}", **rotary,
                                                     positions=positions)

    def cached(name, which, i):
        return name if max_len is None else g.cache(name, lengths, f"{which}_cache", i,
                                                     max_len, name=f"{which}_cache{i}",
                                                     dtype=cache_dtype)

    keys = [cached(rotated(proj("k", i)), "k", i) for i in range(kv_heads)]
    values = [cached(proj("v", i), "v", i) for i in range(kv_heads)]
    outs = []
    for h, (scale, mask) in enumerate(zip(scales, masks)):
        s = g.scores(rotated(proj("q", h)), keys[kv_of[h]], name=f"s{h}")
        s = g.scale(s, scale, name=f"scaled{h}")
        if score_mod is not None:
            s = g.score_mod(s, score_mod, head=h, name=f"modified{h}", positions=positions)
        if mask is not None:
            s = g.mask(s, mask, head=h, name=f"masked{h}", lengths=lengths)
        outs.append(g.weighted_sum(g.softmax(s, name=f"p{h}"), values[kv_of[h]],
                                   name=f"o{h}"))
    c = g.concat_heads(outs, name="concat")
    return g.output_projection(c, "w_o", d_out, bias="b_o" if bias else None, name="y")
