"""What the fused kinds (qkv_projection, attention) mean in the builder kinds: unfuse()
expands them back into head-level nodes.

A graph may hold the fused kinds: the fusion pass's output, saved as JSON and loaded again,
or written by hand. verify() and the reference accept any offsets; to compile, lower() first
turns such a graph into the builder form unfuse() writes, which the fusion pass then fuses
as it fuses mhagen.mha()'s graphs (the kernels' column layout always comes from the fusion
pass, never from the offsets given). So every Q, K and V offset must be where a segment of
head_dim columns starts; unfuse() says so otherwise.

Per head h the attention node becomes
  [rotary(q)] , [cache(rotary(k))] -> scores -> scale -> [score_mod] -> [mask] -> softmax
  -> weighted_sum(., [cache(v)])
and the heads' concat takes the attention node's name, so its readers are unchanged.
"""
from __future__ import annotations

from mhagen.errors import GraphError
from mhagen.ir.graph import Graph
from mhagen.ir.kinds import FUSED_KINDS


def has_fused_kinds(graph) -> bool:
    return any(n.kind in FUSED_KINDS for n in graph.nodes)


def unfuse(graph: Graph) -> Graph:
    """The same function with head_projection ... concat_heads nodes instead of the fused
    kinds (a graph without fused kinds comes back unchanged)."""
    if not has_fused_kinds(graph):
        return graph
    graph.shapes()
    readers = {i for n in graph.nodes if n.kind != "attention" for i in n.inputs}
    options = {k: v for k, v in graph.options.items() if k != "fused"}
    g = Graph(graph.name, graph.dtype, options)
    columns = {}    # qkv_projection name -> {first column: (head node, width)}
    for n in graph.nodes:
        if n.kind == "qkv_projection":
            columns[n.name], start, heads = {}, 0, []
            for i, seg in enumerate(n.attrs["segments"]):
                heads.append(g.head_projection(n.inputs[0], seg["weight"], seg["head"],
                                               seg["width"], bias=seg.get("bias"),
                                               name=f"{n.name}_{i}"))
                columns[n.name][start] = (heads[-1], seg["width"])
                start += seg["width"]
            if n.name in readers:   # read as a whole, not only by attention
                g.concat_heads(heads, name=n.name)
        elif n.kind == "attention":
            _attention_heads(g, n, columns)
        else:
            g.add(n.kind, n.inputs, n.name, **n.attrs)
    g.set_output(graph.output)
    g.shapes()
    return g


def _attention_heads(g, n, columns):
    """Add the per-head nodes of fused attention node n to g; their concat is named n."""
    a = n.attrs
    d = a["head_dim"]
    ins = list(n.inputs)
    qkv = ins.pop(0)
    kv = ins.pop(0) if a.get("cross") else qkv
    extra = ins[0] if ins else None    # a lengths or cache_lens node
    if extra is not None and a.get("mask") is None:
        raise GraphError(f"attention {n.name!r} reads {extra!r} but has no mask to use it; "
                         "give it a mask (e.g. kv_idx < kv_len) or drop that input")

    def head(source, offset, role, h):
        found = columns.get(source, {}).get(offset)
        if found is None or found[1] != d:
            raise GraphError(
                f"attention {n.name!r}: the {role} of head {h} (columns {offset}.."
                f"{offset + d - 1} of {source!r}) is not one qkv_projection segment of "
                f"head_dim {d} columns; to compile, each offset must start a segment of "
                "that width (the layout the fusion pass writes)")
        return found[0]

    positions = extra if a.get("cache") else None
    rotated, cached, outs = {}, {}, []

    def rotate(x):
        r = a.get("rotary")
        if r is None:
            return x
        if x not in rotated:
            rotated[x] = g.rotary(x, r["base"], r["rotary_dim"], positions=positions,
                                  name=f"{n.name}_rot_{x}")
        return rotated[x]

    def cache(x, which, k_offset):
        c = a.get("cache")
        if c is None:
            return x
        key = (which, k_offset)      # cache head: order of first use of a K offset
        if key not in cached:
            index = len({o for w, o in cached if w == which})
            cached[key] = g.cache(x, extra, f"{which}_cache", index, c["max_len"],
                                  name=f"{n.name}_{which}_cache{index}",
                                  dtype=c.get("dtype", "float32"))
        return cached[key]

    for h, (qo, ko, vo) in enumerate(zip(a["q_offsets"], a["k_offsets"], a["v_offsets"])):
        q = rotate(head(qkv, qo, "Q", h))
        k = cache(rotate(head(kv, ko, "K", h)), "k", ko)
        v = cache(head(kv, vo, "V", h), "v", ko)
        s = g.scale(g.scores(q, k, name=f"{n.name}_scores{h}"), a["scale"],
                    name=f"{n.name}_scaled{h}")
        if a.get("score_mod") is not None:
            s = g.score_mod(s, a["score_mod"], h, name=f"{n.name}_modified{h}",
                            positions=positions)
        if a.get("mask") is not None:
            s = g.mask(s, a["mask"], h, name=f"{n.name}_masked{h}", lengths=extra)
        p = g.softmax(s, name=f"{n.name}_p{h}")
        outs.append(g.weighted_sum(p, v, name=f"{n.name}_o{h}"))
    g.concat_heads(outs, name=n.name)
