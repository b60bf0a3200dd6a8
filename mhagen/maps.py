"""Attention maps out of a compiled layer: each head's probabilities softmax(...) [B, H, S, T].

The fused kernels never hold them (that is their point), so `Module.attention_maps(x)` runs a
second, unfused program: the layer's own nodes up to every head's softmax, the heads side by
side (concat_heads) as its output. It is compiled on first use for the module's target and
shape, with the module's weights; the numbers are those of the layer's (masked, modified)
scores, not a re-derivation.
"""
from __future__ import annotations

from mhagen.errors import GraphError
from mhagen.ir.graph import Graph
from mhagen.ir.unfuse import unfuse


def head_softmaxes(graph) -> list:
    """The softmax node of each head, in concat order (output projection -> concat_heads ->
    weighted_sum(softmax, v) per head; a graph holding the fused kinds: of its head-by-head
    form)."""
    graph = unfuse(graph)
    nodes = {n.name: n for n in graph.nodes}
    out = nodes[graph.output]
    concat = nodes.get(out.inputs[0]) if out.inputs else None
    if out.kind != "output_projection" or concat is None or concat.kind != "concat_heads":
        raise GraphError(f"graph {graph.name!r} has no output_projection(concat_heads(...)): "
                         "attention maps need the heads' weighted sums side by side")
    found = []
    for o in concat.inputs:
        ws = nodes[o]
        p = nodes.get(ws.inputs[0]) if ws.kind == "weighted_sum" else None
        if p is None or p.kind != "softmax":
            raise GraphError(f"head {o!r} is not weighted_sum(softmax(...), v): no attention "
                             "map to show")
        found.append(p.name)
    return found


def maps_graph(graph, batch: int, seq_len: int) -> Graph:
    """A graph whose output is every head's attention probabilities side by side
    [batch, seq_len, H * T], with only the nodes they need (its dims bound: the heads'
    key lengths add up to a number)."""
    if graph.cache_lens_input is not None:
        raise GraphError("attention maps of decoding layers (kv_cache=) are not available; "
                         "run the same layer without kv_cache= on the whole sequence")
    graph = unfuse(graph)     # a graph holding the fused kinds: its head-by-head form
    probs = head_softmaxes(graph)
    nodes = {n.name: n for n in graph.nodes}
    need, stack = set(), list(probs)
    while stack:
        name = stack.pop()
        if name not in need:
            need.add(name)
            stack.extend(nodes[name].inputs)
    # float32 storage: probabilities are not rounded (a half layer's x and weights are
    # rounded before they reach it: Module.attention_maps)
    options = {k: v for k, v in graph.options.items() if k != "dtype"}
    g = Graph(f"{graph.name}_maps", "float32", dict(options, attention_maps=True))
    dims = graph.dims(batch, seq_len)
    for n in graph.nodes:
        if n.name in need:
            attrs = dict(n.attrs)
            if n.kind == "input":
                attrs["shape"] = [dims.get(d, d) for d in attrs["shape"]]
            if n.kind == "lengths":
                attrs["batch"] = dims.get(attrs["batch"], attrs["batch"])
            g.add(n.kind, n.inputs, n.name, **attrs)
    return g.set_output(g.concat_heads(probs, name="attention_maps"))
