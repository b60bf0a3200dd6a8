"""Import stage 1, pattern matching: find each attention core of an ONNX graph, the projection
paths that feed its Q, K and V, and the output projection after it.

Works on the graph's structure only (no tensor values): what needs values -- masks, scale,
head counts, which tensors bound a layer -- is read later from probe values (spec.py, and
find_blocks() at the end of this file).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from mhagen.onnx._common import OnnxError, node_attrs

SHAPE_OPS = {"Shape", "Size"}
LAYOUT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast"}
PATH_OPS = LAYOUT_OPS | {"Gather", "Slice", "Split", "Expand", "Tile", "Mul", "Div", "Add",
                         "Sub", "Neg", "Concat"}
SCORE_OPS = {"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity", "Tanh", "Reshape"}
PROB_OPS = {"Identity", "Cast", "Dropout", "Where", "Reshape"}
# Reshape among them: BLOOM's export moves the scores between [batch*heads, q, k] and
# [batch, heads, q, k] (checked on probe values to keep q, k and the batch-head order)
UNSUPPORTED = {
    "Attention": "com.microsoft.Attention packs the QKV projection weights into the operator",
    "GroupQueryAttention": "com.microsoft.GroupQueryAttention (KV cache, rotary) is not "
                           "supported",
    "PackedAttention": "packed (padding-removed) attention is not supported",
    "PackedMultiHeadAttention": "packed (padding-removed) attention is not supported",
    "DecoderMaskedMultiHeadAttention": "decoder attention with a KV cache is not supported",
    "DecoderAttention": "decoder attention with a KV cache is not supported",
    "QAttention": "quantized attention is not supported",
    "LongformerAttention": "Longformer attention is not supported",
    "SparseAttention": "sparse attention is not supported",
    "PagedAttention": "paged attention (KV cache) is not supported",
}


class NotAttention(Exception):
    """A Softmax that is not the centre of an attention (not an error: skipped)."""


class ModelIndex:
    """An ONNX model indexed for matching: producers, consumers, which tensors are computed
    from the model inputs' values (`dep`), the opsets."""

    def __init__(self, proto):
        g = proto.graph
        self.proto = proto
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = [i for i in g.input if i.name not in self.inits]
        self.outputs = {o.name for o in g.output}
        self.producer, self.consumers = {}, defaultdict(list)
        for n in self.nodes:
            self.producer.update((o, n) for o in n.output if o)
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        self.dep = self._value_dependent()
        self.opset = {o.domain or "": o.version for o in proto.opset_import}

    def _value_dependent(self):
        """Tensors whose values depend on a model input (Shape/Size only read shapes)."""
        dep = {i.name for i in self.inputs}
        for n in self.nodes:
            if n.op_type not in SHAPE_OPS and any(i in dep for i in n.input if i):
                dep.update(o for o in n.output if o)
        return dep

    @staticmethod
    def label(n):
        return (f"{n.op_type} node {n.name!r}" if n.name
                else f"{n.op_type} node (output {n.output[0]!r})")

    def users(self, t):
        return [n for n in self.consumers.get(t, []) if n.op_type not in SHAPE_OPS]

    def input_sources(self, t):
        """The model inputs whose values tensor t depends on."""
        seen, todo, found = set(), [t], set()
        names = {i.name for i in self.inputs}
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if cur in names:
                found.add(cur)
            n = self.producer.get(cur)
            if n is not None and n.op_type not in SHAPE_OPS:
                todo.extend(i for i in n.input if i)
        return sorted(found)

    def nodes_between(self, sources, target):
        """The nodes on value paths from any of `sources` to `target`, in model order
        (shape computations are not on value paths)."""
        fwd, todo = set(sources), list(sources)
        while todo:
            for n in self.users(todo.pop()):
                for o in n.output:
                    if o and o not in fwd:
                        fwd.add(o)
                        todo.append(o)
        picked, todo = {}, [target]
        while todo:
            t = todo.pop()
            n = None if t in sources else self.producer.get(t)
            if n is None or id(n) in picked or not any(o in fwd for o in n.output):
                continue
            picked[id(n)] = n
            todo.extend(i for i in n.input if i)
        return [n for n in self.nodes if id(n) in picked]


# -- what was found around one attention ---------------------------------------------------
@dataclass
class ProjectionPath:
    """From a Q/K/V tensor back to the tensor its projection reads."""
    role: str
    proj: object                 # MatMul/Gemm node, or None (no projection)
    candidates: list             # tensors from the projection's input back through layout ops
    factors: list                # [(tensor, exponent)] constant factors after the bias
    has_bias: bool
    target: str = ""             # the Q/K/V tensor the core reads
    nodes: list = field(default_factory=list)   # from the projection's output to `target`
    #   (a rotary embedding stands in as an Identity node: the weights trace through it)
    rotary: tuple | None = None  # (input, output) of rotary embeddings on the path


@dataclass
class OutputPath:
    proj: object                 # MatMul/Gemm node of the output projection, or None
    candidates: list             # tensors that may end the layer, nearest first
    has_bias: bool


@dataclass
class Core:
    """One attention centre (operator or Softmax) and what feeds it."""
    source: str
    node: object
    label: str
    q: str
    k: str
    v: str
    o: str
    layout: str                  # "lead" (decomposed), "op" (Attention / MHA operators)
    q_heads: int | None = None
    kv_heads: int | None = None
    scale: float | None = None
    score_factors: list = field(default_factory=list)   # [(tensor, exponent)]
    adds: list = field(default_factory=list)            # [(tensor, sign, at, scores)]: added
    #   when `at` score factors had been applied (the later ones scale it: a finite bias);
    #   `scores`: the score tensor it is added to (its shape: the form it broadcasts to)
    tanh_at: int | None = None   # softcap: Tanh after this many score factors
    wheres: list = field(default_factory=list)   # [(cond, other, keep_when_true, scores)]
    bool_masks: list = field(default_factory=list)      # attn_mask: bool keep or float add
    causal: bool = False
    zero_rows: list = field(default_factory=list)  # [(cond, zeros, zero_when_true, probs)]
    reshapes: list = field(default_factory=list)        # [(label, input, output)]: Reshapes
    #   of the scores or probabilities
    nan_guards: list = field(default_factory=list)      # Where(IsNaN(P), zeros, P): zeros
    qkv_bias: str | None = None
    paths: dict = field(default_factory=dict)           # "q"/"k"/"v" -> ProjectionPath
    out: OutputPath | None = None
    softmax_axis: int | None = None
    softmax_input: str | None = None

    def probe_names(self):
        """Every tensor whose probe values reading this core needs."""
        names = [self.q, self.k, self.v, self.o] + self.out.candidates
        for p in self.paths.values():
            names += p.candidates + [t for t, _ in p.factors] + list(p.rotary or ())
        names += [t for t, _ in self.score_factors] + [a[0] for a in self.adds]
        names += self.bool_masks + [t for w in self.wheres for t in w[:2]]
        names += [t for z in self.zero_rows for t in z[:2]] + self.nan_guards
        names += [a[3] for a in self.adds if a[3]] + [w[3] for w in self.wheres]
        names += [z[3] for z in self.zero_rows] + [t for r in self.reshapes for t in r[1:]]
        names += [self.softmax_input] if self.softmax_input else []
        return names + ([self.qkv_bias] if self.qkv_bias else [])


def trace_names(m, core):
    """The constant and shape tensors that reading core's weights from initializers needs
    (the non-value inputs of the nodes around its projections)."""
    nodes = []
    for p in core.paths.values():
        if p.proj is not None:
            nodes += [p.proj] + p.nodes + [m.producer[t] for t in p.candidates[:-1]]
    out = core.out
    if out.proj is not None:
        nodes += [out.proj] + m.nodes_between({core.o}, out.proj.input[0])
        nodes += m.nodes_between({out.proj.output[0]}, out.candidates[-1])
    return [i for n in nodes for i in n.input if i and i not in m.dep]


def need_constant(m, t, what, core_label):
    if t in m.dep:
        raise OnnxError(f"{core_label}: {what} {t!r} depends on the values of model input(s) "
                        f"{m.input_sources(t)} (a padding mask?); mhagen masks are functions "
                        "of positions only -- only constant masks can be imported")


# -- the attention operators ---------------------------------------------------------------
def core_attention(m, n):
    """The standard Attention operator (opset 23+)."""
    label, a = m.label(n), node_attrs(n)
    q, k, v, mask, past_k, past_v, nonpad = (list(n.input) + [""] * 7)[:7]
    if past_k or past_v:
        raise OnnxError(f"{label}: past_key/past_value (a KV cache) are not supported: mhagen "
                        "layers attend within one sequence; export the model without a cache")
    if nonpad:
        raise OnnxError(f"{label}: nonpad_kv_seqlen (an external KV cache) is not supported")
    if a.get("softcap", 0.0):
        raise OnnxError(f"{label}: softcap={a['softcap']} is not supported by mhagen")
    _no_extra_outputs(m, n, label, ("present_key", "present_value", "qk_matmul_output"))
    core = Core("Attention", n, label, q, k, v, n.output[0], "op",
                q_heads=a.get("q_num_heads"), kv_heads=a.get("kv_num_heads"),
                scale=a.get("scale") or None, causal=bool(a.get("is_causal", 0)))
    if mask:
        need_constant(m, mask, "attn_mask", label)
        core.bool_masks.append(mask)
    return core


def core_ms_mha(m, n):
    """com.microsoft.MultiHeadAttention with separate query, key and value."""
    label, a = m.label(n), node_attrs(n)
    ins = list(n.input) + [""] * 10
    query, key, value, bias, kpm, attn_bias, past_k, past_v = ins[:8]
    if not key or not value:
        raise OnnxError(f"{label}: packed QKV (no separate key/value inputs) is not supported; "
                        "give the operator separate query, key and value")
    if kpm:
        raise OnnxError(f"{label}: key_padding_mask is not supported: mhagen masks are "
                        "functions of positions only")
    if past_k or past_v or any(ins[8:10]):
        raise OnnxError(f"{label}: past_key/past_value (a KV cache) are not supported")
    _no_extra_outputs(m, n, label, ("present_key", "present_value", "qk"))
    core = Core("com.microsoft.MultiHeadAttention", n, label, query, key, value, n.output[0],
                "op", q_heads=a.get("num_heads"), kv_heads=a.get("num_heads"),
                scale=a.get("scale") or None, causal=bool(a.get("unidirectional", 0)))
    if not core.q_heads:
        raise OnnxError(f"{label}: the num_heads attribute is missing")
    if bias:
        need_constant(m, bias, "bias", label)
        core.qkv_bias = bias
    if attn_bias:
        need_constant(m, attn_bias, "attention_bias", label)
        core.adds.append((attn_bias, 1.0, 0, None))
    return core


def _no_extra_outputs(m, n, label, names):
    for name, t in zip(names, list(n.output)[1:]):
        if t and (m.consumers.get(t) or t in m.outputs):
            raise OnnxError(f"{label}: its output {name} ({t!r}) is used; mhagen layers "
                            "compute only the attention output")


# -- MatMul -> [scale, masks] -> Softmax -> MatMul -----------------------------------------
def search_back(m, start, found, limit=12):
    """Nodes from a producer matching `found` to `start`, nearest path (producer order)."""
    prev, depth = {start: None}, {start: 0}
    todo = deque([start])
    while todo:
        t = todo.popleft()
        n = m.producer.get(t)
        if n is None:
            continue
        if found(n):
            chain, cur = [], t
            while prev[cur] is not None:
                cur, node = prev[cur]
                chain.append(node)
            return n, chain        # chain: nodes from just after `n` up to `start`
        if depth[t] >= limit or n.op_type in ("MatMul", "Gemm", "Softmax", "Attention"):
            continue
        for i in n.input:
            if i and i in m.dep and i not in prev:
                prev[i], depth[i] = (t, n), depth[t] + 1
                todo.append(i)
    return None, None


def core_softmax(m, sm):
    """The decomposed pattern around Softmax `sm`, or NotAttention."""
    label = m.label(sm)
    if sm.input[0] not in m.dep:
        raise NotAttention(f"{label}: its input is a constant")
    scores, chain = search_back(
        m, sm.input[0], lambda n: n.op_type == "MatMul" and all(i in m.dep for i in n.input))
    if scores is None:
        raise NotAttention(f"{label}: no MatMul of two computed tensors (Q @ K^T) before it")
    pv, post, guards = _probabilities_to_pv(m, sm, label)
    core = Core("MatMul-Softmax-MatMul", sm, label, scores.input[0], scores.input[1],
                pv.input[1], pv.output[0], "lead")
    core.nan_guards = guards
    core.softmax_axis = node_attrs(sm).get("axis", -1 if m.opset.get("", 13) >= 13 else 1)
    core.softmax_input = sm.input[0]
    t = scores.output[0]
    for n in chain:       # from the scores MatMul to the Softmax
        _read_score_op(m, core, n, t, f"{m.label(n)} between the scores ({m.label(scores)}) "
                                      f"and {label}")
        t = n.output[0]
    for n, t in post:     # from the Softmax to the P @ V MatMul
        _read_probability_op(m, core, n, t, f"{m.label(n)} between {label} and {m.label(pv)}")
    return core


def _probabilities_to_pv(m, sm, label):
    """The P @ V MatMul after Softmax `sm`, the [(node, its input)] between them, and the
    replacement values of NaN guards among them (PyTorch's exporter writes
    Where(IsNaN(P), 0, P) after the Softmax: fully masked rows give zeros, as in mhagen)."""
    pv, post, guards, t = None, [], [], sm.output[0]
    for _ in range(6):
        users = m.users(t)
        guard = _nan_guard(m, users, t)
        if guard is not None:
            guards.append(guard.input[1])
            t = guard.output[0]
            continue
        if len(users) != 1:
            break
        if users[0].op_type == "MatMul":
            pv = users[0]
            break
        post.append((users[0], t))
        t = users[0].output[0]
    if pv is None:
        raise NotAttention(f"{label}: no MatMul with V after it")
    if pv.input[0] != t:
        raise OnnxError(f"{label}: the probabilities are the right operand of {m.label(pv)}; "
                        "expected P @ V")
    if pv.input[1] not in m.dep:
        raise NotAttention(f"{label}: {m.label(pv)} multiplies by a constant, not by V")
    return pv, post, guards


def _nan_guard(m, users, t):
    """The Where node of Where(IsNaN(t), zeros, t), when `users` (t's users) are exactly
    that IsNaN and that Where with constant zeros; else None."""
    if len(users) != 2:
        return None
    isnan = next((n for n in users if n.op_type == "IsNaN"), None)
    where = next((n for n in users if n.op_type == "Where"), None)
    if isnan is None or where is None or list(isnan.input) != [t]:
        return None
    if list(where.input) != [isnan.output[0], where.input[1], t] or where.input[1] in m.dep:
        return None
    if m.users(isnan.output[0]) != [where]:
        return None
    return where


def _read_score_op(m, core, n, t, what):
    """Record one op between the scores and the Softmax: a scale factor or a mask."""
    if n.op_type not in SCORE_OPS:
        raise OnnxError(f"{what} is not supported: only scaling by a constant, additive "
                        "masks, linear distance biases (ALiBi), Where masks and softcapping "
                        "(Div, Tanh, Mul) are (a learned bias?)")
    if t not in n.input:
        raise OnnxError(f"{what}: unexpected wiring")
    if n.op_type == "Tanh":      # softcap: c * tanh(s / c), before any mask or bias
        if core.tanh_at is not None:
            raise OnnxError(f"{what}: a second Tanh; only one softcap is supported")
        if core.adds or core.wheres:
            raise OnnxError(f"{what}: a mask or bias before the softcap's Tanh; mhagen caps "
                            "the scaled score, then masks it")
        core.tanh_at = len(core.score_factors)
    if n.op_type in ("Mul", "Div", "Add", "Sub"):
        others = [i for i in n.input if i and i != t]
        other = others[0] if others else t
        need_constant(m, other, f"{n.op_type} operand", what)
        if n.input[0] != t and n.op_type in ("Div", "Sub"):
            verb = "divides by" if n.op_type == "Div" else "negates"
            raise OnnxError(f"{what} {verb} the scores; not supported")
        if n.op_type in ("Mul", "Div"):
            core.score_factors.append((other, 1 if n.op_type == "Mul" else -1))
        else:
            core.adds.append((other, 1.0 if n.op_type == "Add" else -1.0,
                              len(core.score_factors), t))
    elif n.op_type == "Where":
        need_constant(m, n.input[0], "mask condition", what)
        keep_when_true = n.input[1] == t
        other = n.input[2] if keep_when_true else n.input[1]
        need_constant(m, other, "masked value", what)
        core.wheres.append((n.input[0], other, keep_when_true, t))
    elif n.op_type == "Reshape":
        _read_reshape(m, core, n, t, what)


def _read_probability_op(m, core, n, t, what):
    """Record one op between the Softmax and P @ V (only zeroing fully masked rows counts)."""
    if n.op_type not in PROB_OPS:
        raise OnnxError(f"{what} is not supported (only Identity, Cast, Dropout and "
                        "zeroing fully masked rows with Where)")
    if n.op_type == "Where":
        need_constant(m, n.input[0], "row condition", what)
        zero_when_true = n.input[2] == t
        zeros = n.input[1] if zero_when_true else n.input[2]
        need_constant(m, zeros, "replacement", what)
        core.zero_rows.append((n.input[0], zeros, zero_when_true, t))
    elif n.input[0] != t:
        raise OnnxError(f"{what}: unexpected wiring")
    elif n.op_type == "Reshape":
        _read_reshape(m, core, n, t, what)


def _read_reshape(m, core, n, t, what):
    """A Reshape of the scores or probabilities: its shape must be a constant (what it does
    to the axes is checked on probe values: spec.check_reshapes)."""
    if n.input[0] != t:
        raise OnnxError(f"{what}: unexpected wiring")
    need_constant(m, n.input[1], "target shape", what)
    core.reshapes.append((m.label(n), t, n.output[0]))


def find_cores(m):
    """Every attention core in model order, with its projection paths; and why Softmax nodes
    were skipped."""
    cores, skipped = [], []
    for n in m.nodes:
        dom = n.domain or ""
        if dom in ("", "ai.onnx") and n.op_type == "Attention":
            cores.append(core_attention(m, n))
        elif dom == "com.microsoft" and n.op_type == "MultiHeadAttention":
            cores.append(core_ms_mha(m, n))
        elif dom == "com.microsoft" and n.op_type in UNSUPPORTED:
            raise OnnxError(f"{m.label(n)} (com.microsoft.{n.op_type}): "
                            f"{UNSUPPORTED[n.op_type]}; export the model with the standard "
                            "Attention operator or as plain MatMul/Softmax ops")
    for n in m.nodes:
        if n.op_type == "Softmax" and (n.domain or "") in ("", "ai.onnx"):
            try:
                cores.append(core_softmax(m, n))
            except NotAttention as why:
                skipped.append(str(why))
    for c in cores:
        c.paths = {r: projection_path(m, getattr(c, r), r.upper(), c) for r in ("q", "k", "v")}
        c.out = output_path(m, c.o)
    return cores, skipped


# -- the projections around an attention ---------------------------------------------------
def projection_path(m, t, role, core):
    """Walk back from core input t to the MatMul/Gemm that projects the layer input."""
    factors, seen_bias, nodes, target, rotary = [], False, [], t, None
    while True:
        n = m.producer.get(t)
        if n is None or len(nodes) >= 64:      # a model input, projected by the identity
            return ProjectionPath(role, None, [t], factors, seen_bias, target, nodes[::-1],
                                  rotary)
        dep_in = [i for i in n.input if i and i in m.dep]
        what = f"{core.label}: {m.label(n)} on the {role} path"
        if n.op_type in ("MatMul", "Gemm") and len(dep_in) == 1 and dep_in[0] == n.input[0]:
            has_bias = seen_bias or (n.op_type == "Gemm" and len(n.input) > 2 and bool(n.input[2]))
            return ProjectionPath(role, n, layout_back(m, dep_in[0]), factors, has_bias,
                                  target, nodes[::-1], rotary)
        found = rotary_parts(m, n) if rotary is None and len(dep_in) >= 2 else None
        if found is not None:   # checked against probe values later (spec.read_rotary)
            rotary, t = found, found[0]
            nodes.append(_identity_node(m, found[0], n))
            continue
        _check_path_op(n, dep_in, what)
        if n.op_type in ("Mul", "Div") and not seen_bias:
            other = [i for i in n.input if i and i != dep_in[0]]
            if other:
                factors.append((other[0], 1 if n.op_type == "Mul" else -1))
        seen_bias = seen_bias or n.op_type in ("Add", "Sub")
        nodes.append(n)
        t = dep_in[0]


def rotary_parts(m, n):
    """(input, output) when node n ends rotary embeddings, else None. The structure only
    (the angles are read from probe values: spec.read_rotary), in the two forms met:
      Hugging Face: Add(x * cos, rotate_half(x) * sin), rotate_half(x) = Concat(-x2, x1);
      mhagen's export: Concat(a cos - b sin, b cos + a sin[, pass]) of Slices a, b[, pass]
      of x; cos and sin independent of the input values."""
    def dep_factor(mul):   # the input-dependent factor of a Mul by a constant
        if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
            return None
        dep = [i for i in mul.input if i in m.dep]
        return dep[0] if len(dep) == 1 else None

    def producers(node):
        return [m.producer.get(i) for i in node.input if i]
    if n.op_type == "Add" and len(n.input) == 2:
        facs = [dep_factor(p) for p in producers(n)]
        for x, turned in (facs, facs[::-1]):
            cat = m.producer.get(turned) if turned else None
            if x and cat is not None and cat.op_type == "Concat" and len(cat.input) == 2:
                neg, first = producers(cat)
                second = m.producer.get(neg.input[0]) if neg is not None and \
                    neg.op_type == "Neg" else None
                if all(s is not None and s.op_type == "Slice" and s.input[0] == x
                       for s in (first, second)):
                    return x, n.output[0]
    if n.op_type == "Concat" and len(n.input) in (2, 3):
        parts = producers(n)
        if len(parts) == len(n.input) and [p.op_type for p in parts[:2]] == ["Sub", "Add"]:
            slices = [m.producer.get(dep_factor(mul)) for p in parts[:2]
                      for mul in producers(p) if dep_factor(mul)] + parts[2:]
            sources = {s.input[0] for s in slices if s is not None and s.op_type == "Slice"}
            if len(slices) == 4 + len(parts[2:]) and len(sources) == 1 and all(
                    s is not None and s.op_type == "Slice" for s in slices):
                return sources.pop(), n.output[0]
    return None


def _identity_node(m, x, n):
    """An Identity from x to node n's output, named after n (the weights' tracer passes
    through it)."""
    from onnx import helper
    return helper.make_node("Identity", [x], [n.output[0]],
                            name=f"{n.name or n.output[0]} (rotary)")


def _check_path_op(n, dep_in, what):
    if n.op_type not in PATH_OPS:
        raise OnnxError(f"{what} is not supported: between a projection and the attention "
                        "only reshapes, transposes, slices and constant scaling or bias are")
    if len(dep_in) != 1:
        raise OnnxError(f"{what} combines several tensors computed from the model input "
                        "(rotary embeddings? cross-attention?); not supported")
    if n.op_type == "Concat" and len([i for i in n.input if i]) != 1:
        raise OnnxError(f"{what} joins the projection with other tensors (a KV cache's past "
                        "keys?); only a Concat of one tensor (GPT-2's empty cache) is read")
    if n.op_type == "Div" and n.input[0] != dep_in[0]:
        raise OnnxError(f"{what} divides by the projection; not affine")
    if n.op_type not in ("Mul", "Div", "Add", "Sub", "Neg") and dep_in[0] != n.input[0]:
        raise OnnxError(f"{what} uses the projection as an index or shape; not supported")


def layout_back(m, t):
    """t and the tensors it is a pure layout change of, nearest first."""
    out = [t]
    while True:
        n = m.producer.get(t)
        if n is None or n.op_type not in LAYOUT_OPS or n.input[0] not in m.dep or any(
                i in m.dep for i in n.input[1:] if i):
            return out
        t = n.input[0]
        out.append(t)


def output_path(m, o):
    """Walk forward from core output o through layout ops and the output projection."""
    t, pre, post, proj, has_bias = o, [o], [], None, False
    for _ in range(64):
        users = m.users(t)
        if t in m.outputs or len(users) != 1:
            break
        n = users[0]
        if proj is None:
            if n.op_type in LAYOUT_OPS and n.input[0] == t or n.op_type == "Concat":
                t = n.output[0]
                pre.append(t)
                continue
            if n.op_type in ("MatMul", "Gemm") and n.input[0] == t and n.input[1] not in m.dep:
                proj, t = n, n.output[0]
                has_bias = n.op_type == "Gemm" and len(n.input) > 2 and bool(n.input[2])
                post.append(t)
                continue
            break
        if n.op_type in LAYOUT_OPS and n.input[0] == t and not any(
                i in m.dep for i in n.input[1:] if i):
            t = n.output[0]
        elif n.op_type == "Add" and len([i for i in n.input if i in m.dep]) == 1:
            t, has_bias = n.output[0], True
        else:
            break
        post.append(t)
    if proj is None:
        return OutputPath(None, pre, False)
    return OutputPath(proj, post, has_bias)


# -- layers: cores grouped by the tensors that bound them ----------------------------------
@dataclass
class Block:
    """One layer: input tensor x [batch, seq, D] (or seq-first), output y, its cores."""
    x: str
    y: str
    layout: str                  # "BSD" or "SBD"
    cores: list


def core_seq_len(core, vals):
    """The query sequence length of a core at the probe."""
    q = vals[core.q]
    if core.layout == "lead":
        return q.shape[-2]
    return q.shape[1] if q.ndim == 3 else q.shape[2]


def find_blocks(m, cores, vals):
    """Group cores into layers (model order), using probe values for shapes."""
    blocks = {}
    for c in cores:
        x, layout = _layer_input(c, vals)
        xs_shape = vals[x].shape
        ys = [t for t in c.out.candidates
              if vals[t].ndim == 3 and vals[t].shape[:2] == xs_shape[:2]]
        if not ys:
            raise OnnxError(f"{c.label}: no [batch, seq, features] tensor after it (its output "
                            f"{c.o!r} is {vals[c.o].shape}; expected an output projection "
                            "MatMul/Gemm by a constant weight)")
        blk = blocks.setdefault(ys[-1], Block(x, ys[-1], layout, []))
        if blk.x != x:
            raise OnnxError(f"{c.label} and {blk.cores[0].label} feed the same output "
                            f"{ys[-1]!r} but project different tensors ({x!r}, {blk.x!r})")
        blk.cores.append(c)
    order = {id(n): i for i, n in enumerate(m.nodes)}
    return sorted(blocks.values(), key=lambda b: min(order[id(c.node)] for c in b.cores))


def _layer_input(c, vals):
    """The [batch, seq, D] tensor Q, K and V all project, and its layout."""
    qp = c.paths["q"]
    xs = [t for t in qp.candidates if vals[t].ndim == 3]
    if not xs:
        raise OnnxError(f"{c.label}: the tensor Q projects is not [batch, seq, features] "
                        f"(shape {vals[qp.candidates[0]].shape})")
    x = xs[-1]
    for role in ("k", "v"):
        if x not in c.paths[role].candidates:
            raise OnnxError(
                f"{c.label}: Q projects {x!r} but {role.upper()} projects "
                f"{c.paths[role].candidates[-1]!r} (cross-attention); mhagen layers are "
                "self-attention: Q, K and V project the same tensor")
    s, shape = core_seq_len(c, vals), vals[x].shape
    return x, "SBD" if shape[0] == s and shape[1] != s else "BSD"
