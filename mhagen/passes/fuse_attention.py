"""Fuse a multi-head attention graph into qkv_projection -> attention -> output_projection.

Recognised: output_projection(concat_heads(o_0..o_H-1)) where each o_h is
weighted_sum(softmax([mask]([score_mod]([scale](scores(q_h, k_h))))), v_h), every q/k/v is
a head_projection of one input (q and k optionally through a rotary node: then every Q and
K head has one, with the same base and rotary_dim, recorded as the attention's `rotary`),
all heads share head_dim, scale, score modifier and mask expression (they may differ through
`head` in them: ALiBi slopes), and no other node reads the intermediates. The fused graph computes the same function:
  - one packed GEMM for every head's Q, K and V (K/V heads shared by query heads once),
  - one attention node that never builds [B, heads, S, S] (see the attention templates),
  - the concat is free: attention writes each head at its concat offset, where W_O reads it.
Cross-attention (Q heads project one input, K/V heads another, the context): two packed
GEMMs instead of one, qkv_projection(x) with the Q heads and qkv_projection(context) named
"kv" with the K/V heads; the attention node reads both (inputs qkv, kv[, lengths]; attr
cross) and its k/v offsets are columns of kv.
Anything else is left alone and compiles through the unfused path; `reason` says why.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from mhagen.ir.graph import Graph


@dataclass
class FusionResult:
    graph: Graph
    fused: bool
    reason: str


class _NoMatch(Exception):
    pass


def _need(cond, reason):
    if not cond:
        raise _NoMatch(reason)


def fuse_attention(graph: Graph) -> FusionResult:
    try:
        return FusionResult(_fuse(graph), True, "fused: qkv_projection + attention")
    except _NoMatch as why:
        return FusionResult(graph, False, f"not fused: {why}")


# the optional nodes between scores and softmax, nearest the softmax first: kind -> attribute
SCORE_CHAIN = (("mask", "mask"), ("score_mod", "expr"), ("scale", "factor"))


def _score_chain(nodes, uses, cur, h, matched):
    """((mask, score modifier, scale) of head h, the node under them), walking up from the
    softmax's input through the optional mask, score_mod and scale nodes."""
    found = {"mask": None, "score_mod": None, "scale": 1.0, "lengths": None,
             "mod_positions": None}
    for kind, attr in SCORE_CHAIN:
        if cur.kind != kind:
            continue
        _need(uses[cur.name] == 1, f"{cur.name!r} has more than one reader")
        if "head" in cur.attrs:
            _need(cur.attrs["head"] == h, f"{kind} {cur.name!r} is for head "
                                          f"{cur.attrs['head']} but feeds head {h}")
        found[kind] = cur.attrs[attr]
        if kind == "mask" and len(cur.inputs) > 1:   # the lengths node the mask reads
            found["lengths"] = cur.inputs[1]
            matched.add(cur.inputs[1])
        if kind == "score_mod":    # a decoding layer's positions, or none
            found["mod_positions"] = cur.inputs[1] if len(cur.inputs) > 1 else None
        matched.add(cur.name)
        cur = nodes[cur.inputs[0]]
    return (found["mask"], found["score_mod"], found["scale"], found["lengths"],
            found["mod_positions"]), cur


def _fuse(g: Graph) -> Graph:
    """g fused (inputs, qkv_projection(s), [lengths,] attention, output_projection), or
    _NoMatch saying why not: the pattern matched head by head, then what the heads share."""
    g.shapes()
    m = _Matcher(g)
    out, concat = m.output_nodes()
    heads = [m.head(h, o_name) for h, o_name in enumerate(concat.inputs)]
    scale, lengths, rotation, cache = _shared_attributes(m)
    x, context, d = _projected_inputs(m, heads, rotation, cache)
    order = _column_order(m, heads, cache)
    f, packed = _fused_graph(g, m, heads, order, x, context, d)
    attrs = _attention_attrs(heads, order, d, scale, rotation, cache, context.name != x.name)
    lens = () if lengths is None else (f.add(m.nodes[lengths].kind, (), lengths,
                                             **m.nodes[lengths].attrs),)
    att = f.add("attention", packed + lens, "attention", **attrs)
    f.set_output(f.add("output_projection", (att,), out.name, **out.attrs))
    f.shapes()
    return f


class _Matcher:
    """Walks the graph up from its output through the pattern, recording every node it
    covers (matched) and what the heads use, to be checked alike across heads."""

    def __init__(self, g: Graph):
        self.nodes = {n.name: n for n in g.nodes}
        self.output = g.output
        self.uses = Counter(i for n in g.nodes for i in n.inputs)
        self.matched = set()
        self.scales, self.masks, self.mods, self.lengths = set(), set(), set(), set()
        self.rotations = set()      # (base, rotary_dim) of each Q and K head, None: unrotated
        self.positions = set()      # the positions node each rotary and score_mod node reads
        self.caches = set()         # (cache_lens, max_len, dtype) of each K/V head, or None
        self.cache_heads = {"k": {}, "v": {}}   # cache node -> its head, in first-read order

    def output_nodes(self):
        """(the output projection, the concat_heads it reads)."""
        nodes, uses = self.nodes, self.uses
        out = nodes[self.output]
        _need(out.kind == "output_projection", "the output is not an output_projection")
        concat = nodes[out.inputs[0]]
        _need(concat.kind == "concat_heads", "the output projection does not read concat_heads")
        _need(uses[concat.name] == 1, "the concat has other readers")
        self.matched |= {out.name, concat.name}
        return out, concat

    def head(self, h, o_name):
        """(q, k, v projection names, mask, score modifier) of head h, whose output is o_name."""
        o = self.single_use(o_name, "weighted_sum")
        p = self.single_use(o.inputs[0], "softmax")
        cur = self.nodes[p.inputs[0]]
        self.matched |= {o.name, p.name}
        (mask, mod, scale, lens, mod_positions), cur = _score_chain(self.nodes, self.uses, cur,
                                                                    h, self.matched)
        self.lengths.add(lens)
        if mod is not None:
            self.positions.add(mod_positions)
        _need(cur.kind == "scores",
              f"head {h}: expected scores -> [scale] -> [score_mod] -> [mask] -> softmax")
        _need(self.uses[cur.name] == 1, f"{cur.name!r} has more than one reader")
        self.matched.add(cur.name)
        self.scales.add(float(scale))
        self.masks.add(mask)    # Exprs compare by structure (repr abbreviates tables)
        self.mods.add(mod)
        q, q_rot = self.unrotated(cur.inputs[0], single=True)
        k, k_rot = self.unrotated(self.uncached(cur.inputs[1], "k"), single=False)
        v = self.uncached(o.inputs[1], "v")
        self.rotations.update({q_rot, k_rot})
        return q, k, v, mask, mod

    def single_use(self, name, kind):
        node = self.nodes[name]
        _need(node.kind == kind, f"{name!r} is a {node.kind}, expected {kind}")
        _need(self.uses[name] == 1, f"{name!r} has more than one reader")
        return node

    def unrotated(self, name, single):
        """(the projection under an optional rotary node, the rotary's params or None)."""
        node = self.nodes[name]
        if node.kind != "rotary":
            return name, None
        # a K rotary feeds every query head of its group; a Q rotary feeds one head
        _need(not single or self.uses[name] == 1, f"{name!r} has more than one reader")
        self.matched.add(name)
        self.positions.add(node.inputs[1] if len(node.inputs) > 1 else None)
        return node.inputs[0], (float(node.attrs["base"]), int(node.attrs["rotary_dim"]))

    def uncached(self, name, which):
        """The K or V under an optional cache node (recorded in caches)."""
        node = self.nodes[name]
        if node.kind != "cache":
            self.caches.add(None)
            return name
        _need(node.attrs["cache"] == f"{which}_cache", f"{name!r} caches a {which.upper()} "
              f"head in {node.attrs['cache']}")
        self.matched.add(name)
        self.caches.add((node.inputs[1], node.attrs["max_len"],
                         node.attrs.get("dtype", "float32")))
        if name not in self.cache_heads[which]:
            self.cache_heads[which][name] = node.attrs["head"]
        return node.inputs[0]


def _shared_attributes(m: _Matcher):
    """(scale, lengths node, rotation, cache) that every head shares, or _NoMatch."""
    _need(len(m.scales) == 1, "heads use different scales")
    _need(len(m.masks) == 1, "heads use different masks")
    _need(len(m.lengths) == 1, "heads read different key lengths (or only some do)")
    lengths = next(iter(m.lengths))
    _need(len(m.mods) == 1, "heads use different score modifiers (write one expression that "
                            "reads `head`, e.g. a table of per-head values)")

    _need(len(m.rotations) == 1, "rotary embeddings on only some Q/K heads, or with different "
          "base/rotary_dim (the fused kernels rotate every Q and K head alike)")
    rotation = next(iter(m.rotations))
    _need(len(m.caches) == 1, "only some K/V heads go through a cache, or caches of different "
          "lengths or dtypes")
    cache = next(iter(m.caches))
    if cache is not None:   # a decoding layer: positions come from its cache_lens everywhere
        _need(lengths == cache[0], "a decoding layer's mask must read its cache_lens (kv_len "
              "and positions)")
        _need(m.positions <= {cache[0]}, "rotary or score_mod nodes of a decoding layer must "
              "read its cache_lens (positions)")
    else:
        _need(m.positions <= {None}, "rotary or score_mod nodes read positions (cache_lens) "
              "but no K/V head goes through a cache")
    return next(iter(m.scales)), lengths, rotation, cache


def _projected_inputs(m: _Matcher, heads, rotation, cache):
    """(x, context, head_dim): the inputs the Q and the K/V heads project (the same node
    unless cross-attention), and the heads' width."""
    nodes = m.nodes
    projections = [nodes[name] for hd in heads for name in hd[:3]]
    _need(all(p.kind == "head_projection" for p in projections),
          "q, k and v must all be head_projection nodes")
    q_sources = {nodes[hd[0]].inputs[0] for hd in heads}
    kv_sources = {nodes[name].inputs[0] for hd in heads for name in hd[1:3]}
    _need(len(q_sources) == 1 and len(kv_sources) == 1,
          "the Q heads (or the K/V heads) project different inputs")
    widths = {p.attrs["out_features"] for p in projections}
    _need(len(widths) == 1, "heads have different widths")
    d = widths.pop()
    x, context = nodes[q_sources.pop()], nodes[kv_sources.pop()]
    _need(x.kind == "input" and context.kind == "input",
          "q, k and v do not project graph inputs")
    cross = context.name != x.name
    _need(not (cross and (rotation is not None or cache is not None)),
          "cross-attention with rotary embeddings or a K/V cache")
    m.matched |= {x.name, context.name}
    return x, context, d


def _column_order(m: _Matcher, heads, cache):
    """The projections in packed column order: all Q, then K, then V (shared K/V heads
    once); checks that the pattern covers the whole graph."""
    order = []
    for role in range(3):
        for hd in heads:
            if hd[role] not in order:
                order.append(hd[role])
    _need(len(order) == len(set(order)), "a projection is used as two of q/k/v")
    m.matched |= set(order)
    _need(m.matched == set(m.nodes), "the graph has nodes outside the attention pattern: "
                                     f"{sorted(set(m.nodes) - m.matched)}")
    if cache is not None:   # cache head g holds the g-th K/V head query heads read
        for which in ("k", "v"):
            _need(list(m.cache_heads[which].values()) ==
                  list(range(len(m.cache_heads[which]))),
                  f"{which.upper()} cache heads are not numbered in the order query heads "
                  "first read them")
    return order


def _q_heads(heads) -> int:
    return len(dict.fromkeys(hd[0] for hd in heads))


def _column_offsets(heads, order, d, cross) -> dict:
    """Each projection's first column in the packed qkv (cross: Q columns in qkv, K/V
    columns in kv, each from 0)."""
    q_heads = _q_heads(heads)
    return {name: (i - q_heads if cross and i >= q_heads else i) * d
            for i, name in enumerate(order)}


def _fused_graph(g: Graph, m: _Matcher, heads, order, x, context, d) -> tuple:
    """(the fused graph with its inputs and packed projection(s), the names of those
    projections: (qkv,), or (qkv, kv) for cross-attention)."""
    q_heads = _q_heads(heads)
    segments = [{"weight": m.nodes[n].attrs["weight"], "head": m.nodes[n].attrs["head"],
                 "bias": m.nodes[n].attrs.get("bias"), "width": d} for n in order]
    f = Graph(g.name, g.dtype, dict(g.options, fused=True))
    xi = f.add("input", (), x.name, **x.attrs)
    if context.name != x.name:
        ci = f.add("input", (), context.name, **context.attrs)
        qkv = f.add("qkv_projection", (xi,), "qkv", segments=segments[:q_heads])
        return f, (qkv, f.add("qkv_projection", (ci,), "kv", segments=segments[q_heads:]))
    return f, (f.add("qkv_projection", (xi,), "qkv", segments=segments),)


def _attention_attrs(heads, order, d, scale, rotation, cache, cross) -> dict:
    offset = _column_offsets(heads, order, d, cross)
    attrs = {"head_dim": d, "q_offsets": [offset[hd[0]] for hd in heads],
             "k_offsets": [offset[hd[1]] for hd in heads],
             "v_offsets": [offset[hd[2]] for hd in heads], "scale": scale}
    if heads[0][3] is not None:
        attrs["mask"] = heads[0][3]
    if heads[0][4] is not None:
        attrs["score_mod"] = heads[0][4]
    if rotation is not None:
        attrs["rotary"] = {"base": rotation[0], "rotary_dim": rotation[1]}
    if cache is not None:
        attrs["cache"] = {"max_len": cache[1], **({"dtype": cache[2]}
                                                  if cache[2] != "float32" else {})}
    if cross:
        attrs["cross"] = True
    return attrs
