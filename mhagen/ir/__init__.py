"""The graph IR: node kinds, the Graph builder, mask expressions and the verifier."""
from mhagen.ir.expr import Expr, batch, causal, head, kv_idx, kv_len, q_idx, q_len, sliding_window
from mhagen.ir.graph import Graph, Node, WeightSpec
from mhagen.ir.kinds import KINDS
from mhagen.ir.verify import verify

__all__ = ["Expr", "Graph", "KINDS", "Node", "WeightSpec", "batch", "causal", "head", "kv_idx",
           "kv_len", "q_idx", "q_len", "sliding_window", "verify"]
