"""The graph IR: nodes in definition order, a builder API, JSON round trip and printing.

A Graph is also the user's "layer": `init_weights`, `reference` and `weight_specs` live here
so that `layer = mhagen.mha(...)` is all a user needs before `mhagen.build(layer, ...)`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from mhagen.errors import GraphError, InputError
from mhagen.ir import expr as ex
from mhagen.ir.kinds import KINDS, WeightSpec
from mhagen.ir.reference import run_packed_reference, run_reference
from mhagen.ir.verify import check_dtype, infer_shapes, verify, weight_specs
from mhagen.weights import init_weights

GRAPH_FORMAT = "mhagen.graph"
GRAPH_VERSION = 1


@dataclass
class Node:
    name: str
    kind: str
    inputs: tuple = ()
    attrs: dict = field(default_factory=dict)

    def to_json(self):
        attrs = {k: ({"$expr": v.to_json()} if isinstance(v, ex.Expr) else v)
                 for k, v in self.attrs.items()}
        return {"name": self.name, "kind": self.kind, "inputs": list(self.inputs), "attrs": attrs}

    @staticmethod
    def from_json(data) -> "Node":
        if not isinstance(data, dict):
            raise GraphError(f"bad node in graph JSON {data!r}: expected an object with "
                             "'name', 'kind', 'inputs' and 'attrs'")
        inputs, attrs = data.get("inputs", []), data.get("attrs", {})
        wrong = [f"{key!r} must be {what}" for key, ok, what in (
            ("name", isinstance(data.get("name"), str), "a string"),
            ("kind", isinstance(data.get("kind"), str), "a string"),
            ("inputs", isinstance(inputs, list) and all(isinstance(i, str) for i in inputs),
             "a list of node names"),
            ("attrs", isinstance(attrs, dict), "an object")) if not ok]
        if wrong:
            raise GraphError(f"bad node in graph JSON {data!r}: {'; '.join(wrong)}; each node "
                             "needs 'name', 'kind', 'inputs' and 'attrs' as Graph.to_json() "
                             "writes them")
        try:
            attrs = {k: (ex.from_json(v["$expr"]) if isinstance(v, dict) and "$expr" in v else v)
                     for k, v in attrs.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise GraphError(f"bad node {data['name']!r} in graph JSON: {err}; write "
                             "expressions as Graph.to_json() does") from None
        return Node(data["name"], data["kind"], tuple(inputs), attrs)


class Graph:
    """An attention layer as a graph of nodes, built node by node.

        g = Graph("tiny")
        x = g.input("x", d_model=16)
        q = g.head_projection(x, "w_q", head=0, bias="b_q")
        ...
        g.set_output(g.output_projection(c, "w_o"))

    Every builder method returns the new node's name; nodes may only read earlier nodes.
    `options` records how a constructor such as `mha()` made the graph (for printing and
    for passes that want to know); the nodes alone define what the graph computes.
    """

    def __init__(self, name: str = "graph", dtype: str = "float32", options: dict | None = None):
        check_dtype(dtype)
        self.name = name
        self.dtype = dtype
        self.options = dict(options or {})
        self.nodes: list[Node] = []
        self.output: str | None = None
        self._names: set = set()

    # -- builder -------------------------------------------------------------------------
    def add(self, kind: str, inputs=(), name: str | None = None, **attrs) -> str:
        if kind not in KINDS:
            raise GraphError(f"unknown node kind {kind!r}; use one of: {', '.join(KINDS)}")
        name = name or self._fresh(kind)
        if name in self._names:
            raise GraphError(f"node name {name!r} is used twice; give each node its own name")
        self.nodes.append(Node(name, kind, tuple(inputs), attrs))
        self._names.add(name)
        return name

    def _fresh(self, kind):
        i = 0
        while f"{kind}{i}" in self._names:
            i += 1
        return f"{kind}{i}"

    def input(self, name: str = "x", d_model: int = 512, batch: str = "batch",
              seq: str = "seq") -> str:
        """A [batch, seq, d_model] input; batch and seq are symbolic, bound at build time."""
        return self.add("input", (), name, shape=[batch, seq, d_model])

    def head_projection(self, x, weight, head, out_features, bias=None, name=None) -> str:
        """Head `head`'s projection: x @ weight[head] (+ bias[head]), out_features wide."""
        return self.add("head_projection", (x,), name, weight=weight, head=head,
                        out_features=out_features, **({"bias": bias} if bias else {}))

    def rotary(self, x, base: float = 10000.0, rotary_dim: int | None = None,
               name=None, positions=None) -> str:
        """RoPE on a Q or K head [B,S,d] (mhagen/ir/rope.py); rotary_dim None: all of d;
        positions (a cache_lens node, decoding layers): token t is at cache_lens[b] + t."""
        if rotary_dim is None:
            rotary_dim = self.shapes_partial(x)[-1]
        return self.add("rotary", (x,) + ((positions,) if positions else ()), name,
                        base=float(base), rotary_dim=rotary_dim)

    def shapes_partial(self, name) -> list:
        """The shape of node `name` from the nodes defined so far (no output needed)."""
        return infer_shapes(self)[name]

    def scores(self, q, k, name=None) -> str:
        return self.add("scores", (q, k), name)

    def scale(self, s, factor, name=None) -> str:
        return self.add("scale", (s,), name, factor=float(factor))

    def lengths(self, name: str = "kv_lens", batch: str = "batch") -> str:
        """Per-batch key lengths [batch] (int32), given at call time; masks that read them
        (`mask(..., lengths=)`) see kv_len = lengths[batch]."""
        return self.add("lengths", (), name, batch=batch)

    def cache_lens(self, name: str = "cache_lens", batch: str = "batch") -> str:
        """Tokens already in the K/V cache per batch row [batch] (int32), given at call time:
        the positions of a decoding layer's new tokens start there (mhagen/kvcache.py)."""
        return self.add("cache_lens", (), name, batch=batch)

    def cache(self, x, lens, cache: str, head: int, max_len: int, name=None,
              dtype: str = "float32") -> str:
        """K or V head `head` [B,S,d] appended to the cache state `cache` ("k_cache" or
        "v_cache") at lens[b]: the whole cache [B, max_len, d] for the scores to read.
        dtype: what the cache stores ("float16", "bfloat16": the new rows rounded to it,
        nearest even; read back as float32)."""
        extra = {} if dtype == "float32" else {"dtype": dtype}
        return self.add("cache", (x, lens), name, cache=cache, head=head, max_len=max_len,
                        **extra)

    def mask(self, s, mask: ex.Expr, head: int, name=None, lengths=None) -> str:
        return self.add("mask", (s,) + ((lengths,) if lengths else ()), name, mask=mask,
                        head=head)

    def score_mod(self, s, expr: ex.Expr, head: int, name=None, positions=None) -> str:
        """Modify scaled scores per element (see mhagen.ir.expr: alibi, softcap, ...);
        positions: a cache_lens node (decoding layers)."""
        return self.add("score_mod", (s,) + ((positions,) if positions else ()), name,
                        expr=expr, head=head)

    def softmax(self, s, name=None) -> str:
        return self.add("softmax", (s,), name)

    def weighted_sum(self, p, v, name=None) -> str:
        return self.add("weighted_sum", (p, v), name)

    def concat_heads(self, heads, name=None) -> str:
        return self.add("concat_heads", tuple(heads), name)

    def output_projection(self, c, weight, out_features, bias=None, name=None) -> str:
        """The output projection W_O: c @ weight (+ bias), out_features wide (d_model)."""
        return self.add("output_projection", (c,), name, weight=weight,
                        out_features=out_features, **({"bias": bias} if bias else {}))

    def set_output(self, name: str) -> "Graph":
        self.output = name
        return self

    # -- queries -------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise GraphError(f"graph {self.name!r} has no node {name!r}")

    def _of_kind(self, kind: str) -> list[Node]:
        """The nodes of `kind`, in order. The index is rebuilt when nodes were added (a
        module call asks for the inputs several times: a scan of a 16-head graph's ~200
        nodes took ~2.5 us each time)."""
        stamp = (id(self.nodes), len(self.nodes))
        if getattr(self, "_kinds_stamp", None) != stamp:
            kinds = {}
            for n in self.nodes:
                kinds.setdefault(n.kind, []).append(n)
            self._kinds, self._kinds_stamp = kinds, stamp
        return self._kinds.get(kind, [])

    @property
    def inputs(self) -> list[Node]:
        return list(self._of_kind("input"))

    @property
    def lengths_input(self):
        """The lengths node (per-batch key lengths given at call time), or None."""
        return next(iter(self._of_kind("lengths")), None)

    @property
    def cache_lens_input(self):
        """The cache_lens node of a decoding layer (mhagen.mha(..., kv_cache=N)), or None."""
        return next(iter(self._of_kind("cache_lens")), None)

    def dims(self, batch: int, seq_len: int, kv_seq_len: int | None = None) -> dict:
        """The inputs' symbolic dims bound to numbers, e.g. {"batch": 2, "seq": 97}; a
        cross-attention layer's context adds its length (kv_seq_len, default seq_len)."""
        shape = self.inputs[0].attrs["shape"]
        dims = {d: int(v) for d, v in zip(shape[:2], (batch, seq_len)) if isinstance(d, str)}
        for extra in self.inputs[1:]:
            d = extra.attrs["shape"][1]
            if isinstance(d, str) and d not in dims:
                dims[d] = int(seq_len if kv_seq_len is None else kv_seq_len)
        return dims

    @property
    def context_input(self):
        """The second input of a cross-attention layer (K/V project it), or None."""
        return self.inputs[1] if len(self.inputs) > 1 else None

    def shapes(self, **dims) -> dict:
        """Verify the graph; return node name -> shape (symbolic dims bound from `dims`)."""
        return verify(self, **dims)

    def weight_specs(self) -> list[WeightSpec]:
        return weight_specs(self)

    def init_weights(self, seed: int = 0) -> dict:
        """Random float32 weights in the per-head layout (Xavier-uniform; biases +-0.1)."""
        return init_weights(self, seed)

    def reference(self, x, weights, kv_lens=None, cache=None,
                  context=None, rounded_to=None, cu_seqlens=None, cu_seqlens_k=None,
                  seqs=None) -> "numpy.ndarray":  # noqa: F821
        """The float64 numpy oracle of this graph: returns the output as float64 (kv_lens:
        the per-batch key lengths of a layer with key padding; cache: a decoding layer's
        mhagen.KVCache or PagedKVCache, written and advanced in place as a module call does;
        context: the second input of a cross-attention layer; rounded_to: a half-precision
        yardstick, every value rounded to that dtype: mhagen.reference.run_reference).
        cu_seqlens: of a prefill layer (and a cross-attention's cu_seqlens_k), a packed call,
        each sequence run alone: mhagen.reference.run_packed_reference; of a decoding layer,
        each cache row's own new tokens, x packed, with seqs a paged cache's sequences."""
        if self.cache_lens_input is None and (cu_seqlens is not None
                                              or cu_seqlens_k is not None):
            if cu_seqlens is None:
                raise InputError("cu_seqlens_k goes with cu_seqlens (the queries' offsets)")
            if seqs is not None:
                raise InputError("seqs= names the sequences of a paged K/V cache: for "
                                 "decoding layers (kv_cache=)")
            return run_packed_reference(self, x, weights, cu_seqlens, cu_seqlens_k,
                                        context=context, kv_lens=kv_lens, cache=cache,
                                        rounded_to=rounded_to)
        if cu_seqlens_k is not None:
            raise InputError("cu_seqlens_k= is a packed cross-attention call's context "
                             "offsets; a decoding layer's cu_seqlens= gives each cache row's "
                             "new tokens")
        return run_reference(self, x, weights, kv_lens=kv_lens, cache=cache, context=context,
                             rounded_to=rounded_to, cu_seqlens=cu_seqlens, seqs=seqs)

    # -- serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": GRAPH_FORMAT, "version": GRAPH_VERSION, "name": self.name,
                           "dtype": self.dtype, "options": self.options,
                           "nodes": [n.to_json() for n in self.nodes], "output": self.output},
                          indent=1)

    @staticmethod
    def from_json(text) -> "Graph":
        try:
            data = json.loads(text) if isinstance(text, (str, bytes)) else text
        except json.JSONDecodeError as err:
            raise GraphError(f"graph JSON does not parse ({err}); pass the text written by "
                             "Graph.to_json()") from None
        if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
            raise GraphError("not an mhagen graph: expected a JSON object with "
                             f"\"format\": \"{GRAPH_FORMAT}\"")
        if data.get("version") != GRAPH_VERSION:
            raise GraphError(f"graph JSON version {data.get('version')} is not supported by this "
                             f"mhagen (reads version {GRAPH_VERSION}); upgrade mhagen or "
                             "re-export the graph")
        name, options, nodes = data.get("name", "graph"), data.get("options"), data.get("nodes", [])
        wrong = [f"{key!r} must be {what}" for key, ok, what in (
            ("name", isinstance(name, str), "a string"),
            ("dtype", isinstance(data.get("dtype", "float32"), str), "a string"),
            ("options", options is None or isinstance(options, dict), "an object"),
            ("nodes", isinstance(nodes, list), "a list of nodes"),
            ("output", data.get("output") is None or isinstance(data.get("output"), str),
             "a node name")) if not ok]
        if wrong:
            raise GraphError(f"bad graph JSON: {'; '.join(wrong)} (as Graph.to_json() writes it)")
        g = Graph(name, data.get("dtype", "float32"), options)
        for nd in nodes:
            node = Node.from_json(nd)
            g.add(node.kind, node.inputs, node.name, **node.attrs)
        g.output = data.get("output")
        return g

    def __eq__(self, other):
        return isinstance(other, Graph) and self.to_json() == other.to_json()

    def __str__(self):
        try:
            shapes = self.shapes()
        except GraphError as err:
            shapes, problem = {}, f"  # invalid: {err}"
        else:
            problem = ""
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        lines = [f"graph {self.name}({opts}) {self.dtype}" + problem]
        for n in self.nodes:
            args = ", ".join(f"%{i}" for i in n.inputs)
            attrs = []
            for k, v in n.attrs.items():
                if k == "shape":
                    continue
                if k == "weight" and "head" in n.attrs:
                    v = f"{v}[{n.attrs['head']}]"
                if k == "bias" and "head" in n.attrs:
                    v = f"{v}[{n.attrs['head']}]"
                if k in ("out_features", "shape") or (k == "head" and "weight" in n.attrs):
                    continue
                if k == "factor":
                    v = f"{v:.6g}"
                attrs.append(f"{k}={v}")
            shape = shapes.get(n.name)
            shape_txt = "[" + ", ".join(str(d) for d in shape) + "]" if shape else "?"
            call = f"{n.kind}({args})" + (" " + " ".join(attrs) if attrs else "")
            lines.append(f"  %{n.name:<8} = {call:<58} -> {shape_txt}")
        lines.append(f"  return %{self.output}")
        return "\n".join(lines)

    def __repr__(self):
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"<Graph {self.name}({opts}): {len(self.nodes)} nodes>"
