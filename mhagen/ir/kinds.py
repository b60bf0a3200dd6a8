"""The vocabulary of node kinds: the one place that lists what a graph may contain.

Each kind has a shape rule (mhagen/ir/verify.py), reference semantics (mhagen/reference.py)
and a TE lowering (mhagen/lower/te.py); a new kind touches those three places and this table.

Shape legend: B batch, S query length, T key/value length, D model width, d head width.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSpec:
    """A named weight tensor. Per-head weights are stacked: shape[0] is the head index."""
    name: str
    shape: tuple
    role: str      # "weight" or "bias"
    fan_in: int    # input width of the projection it belongs to (for initialisation)
    fan_out: int


@dataclass(frozen=True)
class KindSpec:
    """What a node kind takes: its number of inputs (None: one or more) and its attributes."""
    arity: int | None
    required: tuple = ()
    optional: tuple = ()
    doc: str = ""


KINDS = {
    "input": KindSpec(0, ("shape",), (), "a graph input, shape [B, S, D] with named symbolic dims"),
    "lengths": KindSpec(
        0, ("batch",), (),
        "per-batch key lengths [B] (int32), given at call time: masks read them as kv_len "
        "(key padding without an S x S tensor)"),
    "cache_lens": KindSpec(
        0, ("batch",), (),
        "tokens already in the K/V cache per batch row [B] (int32), given at call time: a "
        "decoding layer's positions; the scores, masks, modifiers and rotary nodes that read "
        "it see q_idx = cache_lens[b] + t and kv_len = cache_lens[b] + S (mhagen/kvcache.py)"),
    "cache": KindSpec(
        2, ("cache", "head", "max_len"), ("dtype",),
        "new [B,S,d], cache_lens [B] -> [B,max_len,d]: K/V head `head` of the cache state "
        "`cache` (k_cache or v_cache [B, kv_heads, max_len, d]) after writing the S new rows "
        "at cache_lens[b] (in place; rounded to `dtype`, default float32); rows from "
        "cache_lens[b] + S on are never visible"),
    "head_projection": KindSpec(
        1, ("weight", "head", "out_features"), ("bias",),
        "[B,S,D] @ weight[head] ([D,d]) (+ bias[head]) -> [B,S,d]: one head's Q, K or V"),
    "rotary": KindSpec(
        None, ("base", "rotary_dim"), (),
        "[B,S,d] -> [B,S,d]: RoPE by position (token index along S), half-split pairs "
        "(x[i], x[i + rotary_dim/2]), angle pos * base^(-2i/rotary_dim); dims past rotary_dim "
        "unchanged (mhagen/ir/rope.py); a second input, a cache_lens node, starts the positions at "
        "cache_lens[b]"),
    "scores": KindSpec(2, (), (), "q [B,S,d], k [B,T,d] -> q @ k^T [B,S,T]"),
    "scale": KindSpec(1, ("factor",), (), "[B,S,T] * factor"),
    "mask": KindSpec(
        None, ("mask", "head"), (),
        "[B,S,T] where mask(batch, head, q_idx, kv_idx) else -inf (mask is a boolean expression); "
        "a second input, a lengths node, gives kv_len per batch (a cache_lens node: the "
        "positions of a decoding layer)"),
    "score_mod": KindSpec(
        None, ("expr", "head"), (),
        "[B,S,T] -> expr(score, batch, head, q_idx, kv_idx) per score (a numeric expression: "
        "ALiBi, softcap, ...), applied to the scaled scores before the mask; a second input, a cache_lens node, "
        "gives the positions"),
    "softmax": KindSpec(1, (), (), "softmax over the last axis; a fully masked row gives zeros"),
    "weighted_sum": KindSpec(2, (), (), "p [B,S,T], v [B,T,d] -> p @ v [B,S,d]"),
    "concat_heads": KindSpec(None, (), (), "[B,S,d_0], [B,S,d_1], ... -> [B,S,sum d_i]"),
    "output_projection": KindSpec(
        1, ("weight", "out_features"), ("bias",), "[B,S,C] @ weight ([C,D]) (+ bias [D]) -> [B,S,D]"),
    # Fused kinds: made by mhagen/passes from the kinds above, never needed in user graphs
    # (a graph holding them compiles as its builder form: mhagen/ir/unfuse.py).
    "qkv_projection": KindSpec(
        1, ("segments",), (),
        "[B,S,D] -> [B,S,N]: every head's Q/K/V projection side by side; segments lists "
        "{weight, head, bias, width} in column order"),
    "attention": KindSpec(
        None, ("head_dim", "q_offsets", "k_offsets", "v_offsets", "scale"),
        ("mask", "score_mod", "rotary", "cache", "cross"),
        "qkv [B,S,N] -> [B,S,H*d]: per query head h, softmax(mask(score_mod(Q_h K_h^T * scale))) "
        "V_h with "
        "Q_h, K_h, V_h the head_dim columns of qkv at q/k/v_offsets[h]; heads side by side; "
        "rotary {base, rotary_dim}: RoPE on every Q_h and K_h first; cache {max_len}: K/V "
        "appended to the caches and read from them (second input: cache_lens)"),
}

FUSED_KINDS = ("qkv_projection", "attention")

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")   # storage; compute is float32
