"""The graph IR: node kinds, the Graph builder, mask and score expressions and the verifier."""
from mhagen.ir.expr import (Expr, alibi, alibi_slopes, batch, causal, combine, exp, head, kv_idx,
                            kv_len, maximum, minimum, q_idx, q_len, relative_bias, score,
                            sliding_window, softcap, table, tanh, where)
from mhagen.ir.graph import Graph, Node, WeightSpec
from mhagen.ir.kinds import KINDS
from mhagen.ir.rope import Rotary, rotary
from mhagen.ir.verify import verify

__all__ = ["Expr", "Graph", "KINDS", "Node", "WeightSpec", "alibi", "alibi_slopes", "batch",
           "causal", "combine", "exp", "head", "kv_idx", "kv_len", "maximum", "minimum", "q_idx",
           "q_len", "Rotary", "relative_bias", "rotary", "score", "sliding_window", "softcap",
           "table", "tanh", "verify", "where"]
