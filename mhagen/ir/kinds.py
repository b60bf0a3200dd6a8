"""The vocabulary of node kinds: the one place that lists what a graph may contain.

Each kind has a shape rule (mhagen/ir/verify.py), reference semantics (mhagen/reference.py)
and a TE lowering (mhagen/lower/te.py); a new kind touches those three places and this table.

Shape legend: B batch, S query length, T key/value length, D model width, d head width.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class KindSpec:
    """What a node kind takes: its number of inputs (None: one or more) and its attributes."""
    arity: int | None
    required: tuple = ()
    optional: tuple = ()
    doc: str = ""


KINDS = {
    "input": KindSpec(0, ("shape",), (), "a graph input, shape [B, S, D] with named symbolic dims"),
    "head_projection": KindSpec(
        1, ("weight", "head", "out_features"), ("bias",),
        "[B,S,D] @ weight[head] ([D,d]) (+ bias[head]) -> [B,S,d]: one head's Q, K or V"),
    "scores": KindSpec(2, (), (), "q [B,S,d], k [B,T,d] -> q @ k^T [B,S,T]"),
    "scale": KindSpec(1, ("factor",), (), "[B,S,T] * factor"),
    "mask": KindSpec(
        1, ("mask", "head"), (),
        "[B,S,T] where mask(batch, head, q_idx, kv_idx) else -inf (mask is a boolean expression)"),
    "softmax": KindSpec(1, (), (), "softmax over the last axis; a fully masked row gives zeros"),
    "weighted_sum": KindSpec(2, (), (), "p [B,S,T], v [B,T,d] -> p @ v [B,S,d]"),
    "concat_heads": KindSpec(None, (), (), "[B,S,d_0], [B,S,d_1], ... -> [B,S,sum d_i]"),
    "output_projection": KindSpec(
        1, ("weight", "out_features"), ("bias",), "[B,S,C] @ weight ([C,D]) (+ bias [D]) -> [B,S,D]"),
}

SUPPORTED_DTYPES = ("float32",)
