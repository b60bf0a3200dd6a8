"""verify(graph): checks kinds, names, attributes and shapes; every error says how to fix it.

Shapes are lists of dims; a dim is an int or a symbolic name ("batch", "seq") that
`verify(graph, batch=2, seq=97)` binds to a number.
"""
from __future__ import annotations

import math

import numpy as np

from mhagen.checks import positive_int
from mhagen.errors import GraphError
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.kinds import KINDS, SUPPORTED_DTYPES, WeightSpec
from mhagen.ir.numpy_ops import NUMPY_OPS


def _fmt(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _few(values, most=8):
    """A list for a message, cut after `most` items."""
    return str(values) if len(values) <= most else str(values[:most])[:-1] + ", ...]"


def _is_index(v) -> bool:
    """An int the kernels can hold (head indices, offsets: 32-bit)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ELEMENTS


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_tensors(n, ins, names=None, numeric_width=True):
    """ins (the shapes of `names`, default n's inputs) must be activations [B, S, F]; F a
    number unless numeric_width is False (attention weights [B, S, T]: T a key length)."""
    for name, s in zip(n.inputs if names is None else names, ins):
        if len(s) != 3 or (numeric_width and not isinstance(s[-1], int)):
            raise GraphError(f"{n.kind} {n.name!r}: input {name!r} is {_fmt(s)}; it must be "
                             "a [batch, seq, features] tensor (a projection, head or "
                             "attention output)")


def _check_attrs(node):
    spec = KINDS[node.kind]
    missing = [a for a in spec.required if a not in node.attrs]
    if missing:
        raise GraphError(f"node {node.name!r} ({node.kind}) lacks attribute(s) {missing}; "
                         f"{node.kind} needs {list(spec.required)}")
    unknown = [a for a in node.attrs if a not in spec.required + spec.optional]
    if unknown:
        raise GraphError(f"node {node.name!r} ({node.kind}) has unknown attribute(s) {unknown}; "
                         f"allowed: {list(spec.required + spec.optional)}")
    if spec.arity is not None and len(node.inputs) != spec.arity:
        raise GraphError(f"node {node.name!r} ({node.kind}) takes {spec.arity} input(s), "
                         f"got {len(node.inputs)}: {list(node.inputs)}")
    if spec.arity is None and not node.inputs:
        raise GraphError(f"node {node.name!r} ({node.kind}) needs at least one input")
    cross = node.kind == "attention" and node.attrs.get("cross")   # and a kv input
    if node.kind in ("mask", "attention", "rotary", "score_mod") and \
            len(node.inputs) > 2 + bool(cross):
        raise GraphError(f"node {node.name!r} ({node.kind}) takes one tensor and "
                         f"optionally a lengths or cache_lens node, got {list(node.inputs)}")


def weight_specs(graph) -> list:
    """The graph's weights (name, shape, role), checked for consistent use across nodes."""
    return _collect_weights(graph, verify(graph))


def _collect_weights(graph, shapes) -> list:
    found = {}  # name -> dict(heads, d_in, d_out, per_head, role)

    def record(name, role, per_head, head, d_in, d_out, node):
        if not isinstance(name, str) or not name:
            raise GraphError(f"node {node.name!r}: {role} name must be a non-empty string")
        info = found.setdefault(name, {"heads": set(), "d_in": d_in, "d_out": d_out,
                                       "per_head": per_head, "role": role, "node": node.name})
        if (info["d_in"], info["d_out"], info["per_head"], info["role"]) != (
                d_in, d_out, per_head, role):
            raise GraphError(
                f"weight {name!r} is used with different shapes or roles: by node "
                f"{info['node']!r} as a {info['role']} [{info['d_in']}x{info['d_out']}] and by "
                f"{node.name!r} as a {role} [{d_in}x{d_out}]; give each its own weight name")
        if per_head:
            if head in info["heads"]:
                raise GraphError(f"weight {name!r}[{head}] is used by two nodes; heads own their "
                                 "projections: give each head its own index")
            info["heads"].add(head)

    for n in graph.nodes:
        if n.kind == "qkv_projection":
            d_in = shapes[n.inputs[0]][-1]
            for seg in n.attrs["segments"]:
                record(seg["weight"], "weight", True, seg["head"], d_in, seg["width"], n)
                if seg.get("bias"):
                    record(seg["bias"], "bias", True, seg["head"], d_in, seg["width"], n)
        if n.kind in ("head_projection", "output_projection"):
            d_in = shapes[n.inputs[0]][-1]
            d_out = shapes[n.name][-1]
            per_head = n.kind == "head_projection"
            head = n.attrs.get("head")
            record(n.attrs["weight"], "weight", per_head, head, d_in, d_out, n)
            if n.attrs.get("bias"):
                record(n.attrs["bias"], "bias", per_head, head, d_in, d_out, n)
    specs = []
    for name, info in sorted(found.items()):
        if info["per_head"]:
            count = max(info["heads"]) + 1
            if len(info["heads"]) != count:
                gaps = [h for h in range(min(count, len(info["heads"]) + 8))
                        if h not in info["heads"]]
                raise GraphError(f"weight {name!r} has heads {_few(sorted(info['heads']))} but "
                                 f"not {_few(gaps)}; number heads 0..{len(info['heads']) - 1}")
            lead = (count,)
        else:
            lead = ()
        shape = lead + ((info["d_in"], info["d_out"]) if info["role"] == "weight"
                        else (info["d_out"],))
        specs.append(WeightSpec(name, shape, info["role"], info["d_in"], info["d_out"]))
    return specs


def check_dtype(dtype) -> None:
    """A graph's storage dtype must be one mhagen compiles (Graph() and verify ask)."""
    if dtype not in SUPPORTED_DTYPES:
        raise GraphError(f"dtype {dtype!r} is not supported; use one of "
                         f"{list(SUPPORTED_DTYPES)}")


def verify(graph, **dims) -> dict:
    """Check `graph`; return {node name: shape}. Raises GraphError saying how to fix problems."""
    check_dtype(graph.dtype)
    shapes = infer_shapes(graph)
    if graph.output is None:
        raise GraphError("the graph has no output; call graph.set_output(name)")
    if graph.output not in shapes:
        raise GraphError(f"the graph output {graph.output!r} is not a node; set_output() takes "
                         "the name a builder method returned")
    out_shape = shapes[graph.output]
    if any(n.name == graph.output and n.kind == "input" for n in graph.nodes):
        raise GraphError(f"the graph output {graph.output!r} is an input: it computes "
                         "nothing; set_output() takes the last node (the output projection)")
    if len(out_shape) != 3:
        raise GraphError(f"the graph output must be [batch, seq, features], got {_fmt(out_shape)}")
    specs = _collect_weights(graph, shapes)
    if dims:
        unknown = set(dims) - {d for s in shapes.values() for d in s if isinstance(d, str)}
        if unknown:
            raise GraphError(f"unknown dimension(s) {sorted(unknown)}; the graph's symbolic dims "
                             f"are {sorted({d for s in shapes.values() for d in s if isinstance(d, str)})}")
        for name, value in dims.items():
            positive_int(f"dimension {name}", value)
        shapes = {k: [dims.get(d, d) if isinstance(d, str) else d for d in s]
                  for k, s in shapes.items()}
    _check_sizes(specs, shapes)
    _check_int32(graph, shapes)
    for n in graph.nodes:
        new = shapes[n.inputs[0]][1] if n.kind == "cache" else None
        if isinstance(new, int) and new > n.attrs["max_len"]:
            raise GraphError(f"{new} new tokens per call do not fit the K/V cache of "
                             f"max_len {n.attrs['max_len']}; use seq_len <= max_len or build "
                             "the layer with a larger kv_cache=")
    return shapes


MAX_ELEMENTS = 2 ** 31 - 1   # the kernels index tensors with 32-bit integers


def _elements(shape) -> int:
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n


def _check_sizes(specs, shapes) -> None:
    """Every tensor (weights, and activations once dims are bound) must be indexable with
    32-bit integers."""
    for spec in specs:
        if _elements(spec.shape) > MAX_ELEMENTS:
            raise GraphError(f"weight {spec.name} {list(spec.shape)} has more than 2^31 - 1 "
                             "elements (32-bit indices); use a smaller d_model or head_dim")
    for name, shape in shapes.items():
        if _elements(shape) > MAX_ELEMENTS:
            raise GraphError(f"node {name!r} {list(shape)} has more than 2^31 - 1 elements "
                             "(32-bit indices); use a smaller batch or seq_len")


def infer_shapes(graph) -> dict:
    """{node name: shape} of the nodes defined so far, each checked (no output needed)."""
    if not graph.nodes:
        raise GraphError("the graph is empty; add an input and some nodes, or use mhagen.mha()")
    shapes: dict = {}
    for n in graph.nodes:
        if n.kind not in KINDS:
            raise GraphError(f"node {n.name!r} has unknown kind {n.kind!r}; use one of: "
                             f"{', '.join(KINDS)}")
        _check_attrs(n)
        for i in n.inputs:
            if i not in shapes:
                later = any(m.name == i for m in graph.nodes)
                hint = ("it is defined later: nodes may only read nodes defined before them"
                        if later else "no node has that name: check the spelling")
                raise GraphError(f"node {n.name!r} reads unknown node {i!r}; {hint}")
        ins = [shapes[i] for i in n.inputs]
        shapes[n.name] = _infer(n, ins, graph)
    return shapes


def _infer(n, ins, graph):
    """The shape of node n whose inputs have shapes ins, its attributes checked."""
    rule = _SHAPE_RULES.get(n.kind)
    if rule is None:   # unreachable: kinds are checked first
        raise GraphError(f"no shape rule for kind {n.kind!r}")
    return rule(n, ins, graph)


def _input_shape(n, ins, graph):
    shape = n.attrs["shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 3:
        raise GraphError(f"input {n.name!r} must have shape [batch, seq, d_model], got {shape}")
    for d in shape:
        if not (isinstance(d, str) and d.isidentifier()) and not (
                isinstance(d, int) and not isinstance(d, bool) and d > 0):
            raise GraphError(f"input {n.name!r}: dim {d!r} must be a positive int or a "
                             "symbolic name like 'batch'")
    if not isinstance(shape[2], int):
        raise GraphError(f"input {n.name!r}: the feature dim must be a number (d_model), "
                         f"got {shape[2]!r}")
    return list(shape)


def _projection_shape(n, ins, graph):
    """head_projection and output_projection: [B, S, out_features]."""
    _check_tensors(n, ins)
    (x,) = ins
    if n.kind == "head_projection":
        head = n.attrs["head"]
        if not _is_index(head):
            raise GraphError(f"node {n.name!r}: head must be an int >= 0 (32-bit), got "
                             f"{head!r}")
    d_out = _projection_width(n, graph, x[-1])
    return x[:-1] + [d_out]


def _without_lengths(n, ins, graph, kinds=("lengths", "cache_lens")):
    """ins less an optional last lengths (or cache_lens) input, that input checked."""
    if len(ins) != 2:
        return ins
    _check_lengths_input(n, graph, ins, kinds=kinds)
    return ins[:1]


def _rotary_shape(n, ins, graph):
    (x,) = _without_lengths(n, ins, graph, kinds=("cache_lens",))
    if len(x) != 3 or not isinstance(x[-1], int):
        raise GraphError(f"rotary {n.name!r} takes one head [B, S, d], got {_fmt(x)}")
    rope.check_attrs(dict(n.attrs), x[-1], f"rotary {n.name!r}")
    return list(x)


def _scores_shape(n, ins, graph):
    _check_tensors(n, ins)
    q, kk = ins
    if q[0] != kk[0] or q[-1] != kk[-1]:
        raise GraphError(f"scores {n.name!r}: q {_fmt(q)} and k {_fmt(kk)} must share batch "
                         "and head width; project Q and K to the same head_dim")
    return [q[0], q[1], kk[1]]


def _cache_shape(n, ins, graph):
    x, lens = ins
    _check_lengths_input(n, graph, ins, kinds=("cache_lens",))
    a = n.attrs
    if a["cache"] not in ("k_cache", "v_cache"):
        raise GraphError(f"cache {n.name!r}: cache must be 'k_cache' or 'v_cache', got "
                         f"{a['cache']!r}")
    for attr in ("head", "max_len"):
        v = a[attr]
        if not _is_index(v) or v < (attr == "max_len"):
            raise GraphError(f"cache {n.name!r}: {attr} must be an int >= "
                             f"{int(attr == 'max_len')}, got {v!r}")
    if a.get("dtype", "float32") not in SUPPORTED_DTYPES:
        raise GraphError(f"cache {n.name!r}: dtype must be one of {list(SUPPORTED_DTYPES)}, "
                         f"got {a['dtype']!r}")
    if len(x) != 3:
        raise GraphError(f"cache {n.name!r} takes one K or V head [B, S, d], got {_fmt(x)}")
    return [x[0], a["max_len"], x[2]]


def _lengths_shape(n, ins, graph):
    """lengths and cache_lens: one int32 per batch row."""
    if not (isinstance(n.attrs["batch"], str) and n.attrs["batch"].isidentifier()) and \
            not (isinstance(n.attrs["batch"], int) and n.attrs["batch"] > 0):
        raise GraphError(f"{n.kind} {n.name!r}: batch must be the input's batch dim")
    return [n.attrs["batch"]]


def _score_op_shape(n, ins, graph):
    """scale, mask, score_mod and softmax: scores [B, S, T] in, the same shape out."""
    k = n.kind
    if k == "score_mod":
        ins = _without_lengths(n, ins, graph, kinds=("cache_lens",))
    if k == "mask":
        ins = _without_lengths(n, ins, graph)
    (s,) = ins
    if len(s) != 3:
        raise GraphError(f"{k} {n.name!r} takes scores [B, S, T], got {_fmt(s)}")
    if k in ("mask", "score_mod") and not _is_index(n.attrs["head"]):
        raise GraphError(f"{k} {n.name!r}: head must be an int >= 0 (32-bit), got "
                         f"{n.attrs['head']!r}")
    if k == "score_mod":
        _check_score_mod(n.attrs["expr"], f"score_mod {n.name!r}")
        check_head_tables(n.attrs["expr"], n.attrs["head"] + 1, f"score_mod {n.name!r}",
                          at_least=True)
    if k == "scale" and not _is_finite(n.attrs["factor"]):
        raise GraphError(f"scale {n.name!r}: factor must be a finite number, got "
                         f"{n.attrs['factor']!r}")
    if k == "mask":
        _check_mask(n.attrs["mask"], f"mask {n.name!r}")
    return list(s)


def _weighted_sum_shape(n, ins, graph):
    _check_tensors(n, ins[:1], numeric_width=False)
    _check_tensors(n, ins[1:], names=n.inputs[1:])
    p, v = ins
    if p[0] != v[0] or p[2] != v[1]:
        raise GraphError(f"weighted_sum {n.name!r}: weights {_fmt(p)} and values {_fmt(v)} "
                         "must share batch and key length (p is [B,S,T], v is [B,T,d])")
    return [p[0], p[1], v[2]]


def _concat_heads_shape(n, ins, graph):
    _check_tensors(n, ins)
    first = ins[0]
    for i, s in zip(n.inputs, ins):
        if s[:-1] != first[:-1]:
            raise GraphError(f"concat_heads {n.name!r}: {i!r} is {_fmt(s)} but "
                             f"{n.inputs[0]!r} is {_fmt(first)}; heads must share batch "
                             "and seq")
    return first[:-1] + [sum(s[-1] for s in ins)]


def _qkv_projection_shape(n, ins, graph):
    _check_tensors(n, ins)
    (x,) = ins
    segs = n.attrs["segments"]
    if not isinstance(segs, list) or not segs or not all(
            isinstance(g, dict) and {"weight", "head", "width"} <= set(g) <= {
                "weight", "head", "width", "bias"} and _is_index(g["head"])
            and _is_index(g["width"]) and g["width"] > 0 for g in segs):
        raise GraphError(f"qkv_projection {n.name!r}: segments must be a non-empty list of "
                         "{weight, head, bias, width} (head an int >= 0, width a positive "
                         f"int), got {segs!r}")
    return x[:-1] + [sum(int(g["width"]) for g in segs)]


def _attention_shape(n, ins, graph):
    """attention: (qkv[, kv of cross-attention][, lengths or cache_lens]) -> [B, S, H*d]."""
    kv = None
    if n.attrs.get("cross"):   # (qkv, kv[, lengths]): K/V columns in kv
        if len(ins) < 2:
            raise GraphError(f"attention {n.name!r}: cross takes qkv and kv inputs")
        kv, ins = ins[1], ins[:1] + ins[2:]
    ins = _without_lengths(n, ins, graph)
    if n.attrs.get("cache") is not None:
        _check_attention_cache(n, graph)
    _check_tensors(n, ins + ([kv] if kv is not None else []))
    (qkv,) = ins
    d = positive_int(f"attention {n.name!r}: head_dim", n.attrs["head_dim"])
    if not _is_finite(n.attrs["scale"]):
        raise GraphError(f"attention {n.name!r}: scale must be a finite number, got "
                         f"{n.attrs['scale']!r}")
    offs = _checked_offsets(n, d, qkv, kv)
    if kv is not None and kv[0] != qkv[0]:
        raise GraphError(f"attention {n.name!r}: qkv {_fmt(qkv)} and kv {_fmt(kv)} must "
                         "share the batch")
    if n.attrs.get("mask") is not None:
        _check_mask(n.attrs["mask"], f"attention {n.name!r}")
    if n.attrs.get("score_mod") is not None:
        _check_score_mod(n.attrs["score_mod"], f"attention {n.name!r}")
        check_head_tables(n.attrs["score_mod"], len(offs[0]), f"attention {n.name!r}")
    if n.attrs.get("rotary") is not None:
        rope.check_attrs(n.attrs["rotary"], d, f"attention {n.name!r}")
    return qkv[:-1] + [d * len(offs[0])]


def _check_attention_cache(n, graph):
    c = n.attrs["cache"]
    if len(n.inputs) != 2 or not isinstance(c, dict) or not isinstance(
            c.get("max_len"), int) or c["max_len"] < 1 or c.get(
            "dtype", "float32") not in SUPPORTED_DTYPES or next(
            m for m in graph.nodes if m.name == n.inputs[1]).kind != "cache_lens":
        raise GraphError(f"attention {n.name!r}: cache must be {{'max_len': N}} (and "
                         "optionally a 'dtype' of the supported ones) with a cache_lens "
                         "node as the second input")


def _checked_offsets(n, d, qkv, kv):
    """[q_offsets, k_offsets, v_offsets] of an attention node, each head's columns inside
    the qkv (K/V of cross-attention: kv) input."""
    offs = [n.attrs[a] for a in ("q_offsets", "k_offsets", "v_offsets")]
    if not all(isinstance(o, list) and all(_is_index(i) for i in o) for o in offs) or len(
            {len(o) for o in offs}) != 1 or not offs[0]:
        raise GraphError(f"attention {n.name!r}: q/k/v_offsets must list one offset per "
                         f"head (ints >= 0), got {offs!r}")
    widths = (qkv[-1], (kv or qkv)[-1], (kv or qkv)[-1])
    if any(o < 0 or o + d > width for lst, width in zip(offs, widths) for o in lst):
        raise GraphError(f"attention {n.name!r}: an offset + head_dim {d} exceeds the qkv "
                         f"(or kv) width {widths}")
    return offs


_SHAPE_RULES = {
    "input": _input_shape,
    "head_projection": _projection_shape,
    "output_projection": _projection_shape,
    "qkv_projection": _qkv_projection_shape,
    "rotary": _rotary_shape,
    "scores": _scores_shape,
    "cache": _cache_shape,
    "lengths": _lengths_shape,
    "cache_lens": _lengths_shape,
    "scale": _score_op_shape,
    "mask": _score_op_shape,
    "score_mod": _score_op_shape,
    "softmax": _score_op_shape,
    "weighted_sum": _weighted_sum_shape,
    "concat_heads": _concat_heads_shape,
    "attention": _attention_shape,
}


def _check_lengths_input(n, graph, ins, kinds=("lengths", "cache_lens")):
    """A node's second input (a cross attention's third): the graph's lengths (key padding)
    or cache_lens (decoding positions) node, one per batch row."""
    source = next(m for m in graph.nodes if m.name == n.inputs[-1])
    if source.kind not in kinds:
        raise GraphError(f"{n.kind} {n.name!r}: its second input must be a "
                         f"{' or '.join(kinds)} node, got a {source.kind}")
    if ins[1][0] != ins[0][0]:
        raise GraphError(f"{n.kind} {n.name!r}: lengths {_fmt(ins[1])} and scores "
                         f"{_fmt(ins[0])} must share the batch dim")


def _check_mask(m, where):
    if not isinstance(m, ex.Expr) or not m.is_bool or not ex.is_integer(m):
        raise GraphError(f"{where}: mask must be a boolean expression of integers such as "
                         f"kv_idx <= q_idx (no score, floats or functions), got {m!r}; "
                         "use score_mod= to change scores")


def _check_score_mod(m, where):
    if not ex.is_score_mod(m):
        raise GraphError(f"{where}: a score modifier is a numeric expression of score, batch, "
                         f"head, q_idx, kv_idx (e.g. mhagen.softcap(30.0)), got {m!r}")
    for e in ex.subexpressions(m):
        # -inf hides a key (a where() branch, a table value added); +inf or inf * x would
        # make the softmax NaN: an edited table value of +inf did, silently
        if _infinite(e, positive=True) or (isinstance(e, ex.BinOp) and (
                (e.op in ("*", "/") and (_infinite(e.lhs) or _infinite(e.rhs)))
                or (e.op == "-" and _infinite(e.rhs)))):
            raise GraphError(f"{where}: {e!r} can make a score +inf or NaN; a score "
                             "modifier may give -inf to hide a key (where(cond, -inf, "
                             "score), or a table value added to the score), nothing else "
                             "infinite")
        # TVM's constant folding refuses x / 0
        if isinstance(e, ex.BinOp) and e.op == "/" and not ex.variables(e.rhs):
            with np.errstate(all="ignore"):
                if ex.evaluate(e.rhs, {}, NUMPY_OPS) == 0:
                    raise GraphError(f"{where}: {e!r} divides by the constant 0; write the "
                                     "value the modifier should give there (where(...))")


def _infinite(e, positive=False) -> bool:
    """Whether e is an infinite constant, or a table holding one (+inf only: positive)."""
    values = (e.value,) if isinstance(e, ex.Const) else e.values if isinstance(e, ex.Table) \
        else ()
    return any(math.isinf(v) and (v > 0 or not positive) for v in values)


def _check_int32(graph, shapes) -> None:
    """Masks and score modifiers whose integer parts can leave int32 at these sizes (the
    kernels compute them in int32, the reference in int64): refused. Every index variable
    is bounded by the largest size of the layer (sequence, cache, batch; the node count
    bounds the heads)."""
    sizes = [d for s in shapes.values() for d in s if isinstance(d, int)]
    sizes += [n.attrs["max_len"] for n in graph.nodes if n.kind == "cache"]
    bound = max(sizes + [len(graph.nodes)]) if all(
        isinstance(d, int) for s in shapes.values() for d in s) else None
    for n in graph.nodes:
        for attr in ("mask", "expr", "score_mod"):
            e = n.attrs.get(attr)
            found = ex.int_overflow(e, bound) if isinstance(e, ex.Expr) else None
            if found is not None:
                part, (lo, hi) = found
                sizes = " at these sizes" if bound is not None else ""
                raise GraphError(f"{n.kind} {n.name!r}: {part!r} ranges over [{lo}, {hi}]"
                                 f"{sizes}, beyond the 32-bit integers the kernels compute it "
                                 "in; use smaller constants")


def check_head_tables(m, heads, where, at_least=False):
    """Per-head tables (alibi(H), relative_bias) hold one value per head of the layer: a
    shorter one would give the last heads the last head's value (tables clamp their index).
    at_least: a one-head node (head heads - 1) of a graph whose head count it does not know."""
    for t in ex.head_tables(m):
        n = len(t.values)
        if n < heads or (n != heads and not at_least):
            has = f"head {heads - 1}" if at_least else f"{heads} heads"
            raise GraphError(f"{where}: a per-head table of the score modifier has {n} "
                             f"values, for {has}; build it for the layer's head count "
                             "(mhagen.alibi(num_heads), relative_bias with a row per head)")


def _projection_width(n, graph, d_in):
    w = n.attrs["out_features"]
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise GraphError(f"node {n.name!r}: out_features must be a positive int, got {w!r}")
    return w
