"""Find attention in an ONNX model and turn it into mhagen graphs with their weights.

    for found in mhagen.onnx.import_onnx("model.onnx"):
        print(found)                       # which ONNX nodes, input/output tensors, notes
        kernel = mhagen.build(found.graph, batch=1, seq_len=128, weights=found.weights)

Recognised (self-attention: Q, K and V project the same tensor):
  * the standard ``Attention`` operator (opset 23+; 3D or 4D Q/K/V, grouped K/V, ``scale``,
    ``is_causal``, boolean or additive ``attn_mask``);
  * ``com.microsoft.MultiHeadAttention`` (separate 3D query/key/value, ``bias``,
    ``attention_bias``, ``unidirectional``, ``scale``);
  * the decomposed ``MatMul -> [scale, masks] -> Softmax -> MatMul`` pattern, as PyTorch
    exports ``nn.MultiheadAttention`` and as ``export_onnx(form="decomposed")`` writes it
    (heads in one Softmax or one Softmax per head; K/V heads broadcast or repeated).
Around each, the projections: MatMul/Gemm by a constant weight (+ a constant bias), reached
through reshapes, transposes, slices/gathers of packed QKV, and scaling by constants; after
it, the output projection. A ``[batch, seq, D]`` tensor before the projections and one after
the output projection bound the layer (``found.input``, ``found.output``).

How weights are found: the model is run in onnxruntime on random inputs, with the tensors
around each attention exposed as outputs; each projection is an affine map token by token,
solved by least squares in float64 (so any packing or layout of the weights works); scalar
factors applied to Q and K (PyTorch scales both by sqrt(scale)) are divided out into the
layer's scale. Masks are read from the constant (input-independent) tensors that feed the
scores -- additive (0 / -inf, or values <= -1e4 taken as -inf) or boolean -- and must be a band
``lo <= kv_idx - q_idx <= hi`` (no mask, causal, sliding window...), the same for every batch
element. Last, the imported layer's reference is compared with the ONNX model on a fresh
input (at another sequence length when that axis is dynamic); a mismatch is an error.

Limits (each an ``OnnxError`` naming the node and the reason): cross-attention, KV caches
(``past_key``...), padding masks computed from model inputs, additive biases other than
0/-inf (ALiBi, relative positions), softcap, rotary embeddings, heads of different widths, and
the packed ``com.microsoft`` operators (``Attention``, ``GroupQueryAttention``...). Masks are
read at the probe length (``seq_len=``, default 32, for a dynamic sequence axis): a window
wider than that reads as no window there, which the verification at another length catches.

Spec notes: ONNX's ``is_causal`` is bottom-right aligned with a KV cache offset; without a
cache (the only case imported) it is the square lower triangle, mhagen's top-left causal
mask. A fully masked row is zeros in mhagen and in the ``Attention`` operator, NaN in a plain
``Softmax`` (and in ``com.microsoft.MultiHeadAttention`` with a -inf bias): such rows are left
out of the fit and the verification, and noted.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mhagen.dsl import add_heads
from mhagen.ir import expr as ex
from mhagen.ir.graph import Graph
from mhagen.onnx._common import OnnxError, need_onnx, ort_session

SHAPE_OPS = {"Shape", "Size"}
LAYOUT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast"}
PATH_OPS = LAYOUT_OPS | {"Gather", "Slice", "Split", "Expand", "Tile", "Mul", "Div", "Add",
                         "Sub", "Neg"}
SCORE_OPS = {"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity"}
PROB_OPS = {"Identity", "Cast", "Dropout", "Where"}
NEG_LIMIT = -1e4          # additive mask values at or below this count as -inf
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
FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}


@dataclass
class ImportedAttention:
    """One attention layer found in an ONNX model.

    ``graph`` and ``weights`` are ready for ``mhagen.build`` (and unpack: ``for graph,
    weights in import_onnx(path)``). ``input``/``output`` name the ONNX tensors the layer maps
    between; ``layout`` is ``"BSD"`` or ``"SBD"`` (seq-first, as PyTorch's default
    ``batch_first=False``: transpose to [batch, seq, D] for mhagen). ``source`` is the ONNX
    form, ``nodes`` the ONNX nodes of the layer, ``notes`` anything worth knowing.
    """
    graph: Graph
    weights: dict
    source: str
    input: str
    output: str
    layout: str
    nodes: tuple
    notes: tuple = ()
    max_error: float = 0.0

    def __iter__(self):
        yield self.graph
        yield self.weights

    def __str__(self):
        lines = [f"{self.source}: {self.input!r} -> {self.output!r} ({self.layout}, "
                 f"{len(self.nodes)} ONNX nodes) as {self.graph!r}; max error vs the ONNX "
                 f"model {self.max_error:.1e}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class _NotAttention(Exception):
    pass


# -- the model, indexed --------------------------------------------------------------------
class _Model:
    def __init__(self, proto):
        g = proto.graph
        self.proto = proto
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.inputs = [i for i in g.input if i.name not in self.inits]
        self.outputs = {o.name for o in g.output}
        self.producer, self.consumers = {}, defaultdict(list)
        for n in self.nodes:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        # tensors whose *values* depend on a model input (Shape/Size only read shapes)
        self.dep = {i.name for i in self.inputs}
        for n in self.nodes:
            if n.op_type not in SHAPE_OPS and any(i in self.dep for i in n.input if i):
                self.dep.update(o for o in n.output if o)
        self.opset = {o.domain or "": o.version for o in proto.opset_import}

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


def _attrs(node):
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# -- what was found around one attention ---------------------------------------------------
@dataclass
class _Path:
    """From a Q/K/V tensor back to the tensor its projection reads."""
    role: str
    proj: object                 # MatMul/Gemm node, or None (no projection)
    candidates: list             # tensors from the projection's input back through layout ops
    factors: list                # [(tensor, exponent)] constant factors after the bias
    has_bias: bool


@dataclass
class _Out:
    proj: object
    candidates: list             # tensors that may end the layer, nearest first
    has_bias: bool


@dataclass
class _Core:
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
    adds: list = field(default_factory=list)            # [(tensor, sign)]
    wheres: list = field(default_factory=list)          # [(cond, other, keep_when_true)]
    bool_masks: list = field(default_factory=list)      # attn_mask: bool keep or float add
    causal: bool = False
    zero_rows: list = field(default_factory=list)       # [(cond, zeros, zero_when_true)]
    qkv_bias: str | None = None
    paths: dict = field(default_factory=dict)
    out: _Out | None = None
    softmax_axis: int | None = None


def _need_constant(m, t, what, core_label):
    if t in m.dep:
        raise OnnxError(f"{core_label}: {what} {t!r} depends on the values of model input(s) "
                        f"{m.input_sources(t)} (a padding mask?); mhagen masks are functions "
                        "of positions only -- only constant masks can be imported")


def _core_attention(m, n):
    label = m.label(n)
    a = _attrs(n)
    ins = list(n.input) + [""] * 7
    q, k, v, mask, past_k, past_v, nonpad = ins[:7]
    if past_k or past_v:
        raise OnnxError(f"{label}: past_key/past_value (a KV cache) are not supported: mhagen "
                        "layers attend within one sequence; export the model without a cache")
    if nonpad:
        raise OnnxError(f"{label}: nonpad_kv_seqlen (an external KV cache) is not supported")
    if a.get("softcap", 0.0):
        raise OnnxError(f"{label}: softcap={a['softcap']} is not supported by mhagen")
    _no_extra_outputs(m, n, label, ("present_key", "present_value", "qk_matmul_output"))
    core = _Core("Attention", n, label, q, k, v, n.output[0], "op",
                 q_heads=a.get("q_num_heads"), kv_heads=a.get("kv_num_heads"),
                 scale=a.get("scale") or None, causal=bool(a.get("is_causal", 0)))
    if mask:
        _need_constant(m, mask, "attn_mask", label)
        core.bool_masks.append(mask)
    return core


def _core_ms_mha(m, n):
    label = m.label(n)
    a = _attrs(n)
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
    core = _Core("com.microsoft.MultiHeadAttention", n, label, query, key, value, n.output[0],
                 "op", q_heads=a.get("num_heads"), kv_heads=a.get("num_heads"),
                 scale=a.get("scale") or None, causal=bool(a.get("unidirectional", 0)))
    if not core.q_heads:
        raise OnnxError(f"{label}: the num_heads attribute is missing")
    if bias:
        _need_constant(m, bias, "bias", label)
        core.qkv_bias = bias
    if attn_bias:
        _need_constant(m, attn_bias, "attention_bias", label)
        core.adds.append((attn_bias, 1.0))
    return core


def _no_extra_outputs(m, n, label, names):
    for name, t in zip(names, list(n.output)[1:]):
        if t and (m.consumers.get(t) or t in m.outputs):
            raise OnnxError(f"{label}: its output {name} ({t!r}) is used; mhagen layers "
                            "compute only the attention output")


def _search_back(m, start, found, limit=12):
    """Nodes from a producer matching `found` to `start`, nearest path (producer order)."""
    prev = {start: None}
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
        depth = sum(1 for _ in _walk_prev(prev, t))
        if depth >= limit or n.op_type in ("MatMul", "Gemm", "Softmax", "Attention"):
            continue
        for i in n.input:
            if i and i in m.dep and i not in prev:
                prev[i] = (t, n)
                todo.append(i)
    return None, None


def _walk_prev(prev, t):
    while prev.get(t) is not None:
        t = prev[t][0]
        yield t


def _core_softmax(m, sm):
    label = m.label(sm)
    if sm.input[0] not in m.dep:
        raise _NotAttention(f"{label}: its input is a constant")
    scores, chain = _search_back(
        m, sm.input[0], lambda n: n.op_type == "MatMul" and all(i in m.dep for i in n.input))
    if scores is None:
        raise _NotAttention(f"{label}: no MatMul of two computed tensors (Q @ K^T) before it")
    pv, post, t = None, [], sm.output[0]
    for _ in range(6):
        users = m.users(t)
        if len(users) != 1:
            break
        n = users[0]
        if n.op_type == "MatMul":
            pv = n
            break
        post.append((n, t))
        t = n.output[0]
    if pv is None:
        raise _NotAttention(f"{label}: no MatMul with V after it")
    if pv.input[0] != t:
        raise OnnxError(f"{label}: the probabilities are the right operand of {m.label(pv)}; "
                        "expected P @ V")
    if pv.input[1] not in m.dep:
        raise _NotAttention(f"{label}: {m.label(pv)} multiplies by a constant, not by V")

    core = _Core("MatMul-Softmax-MatMul", sm, label, scores.input[0], scores.input[1],
                 pv.input[1], pv.output[0], "lead")
    a = _attrs(sm)
    core.softmax_axis = a.get("axis", -1 if m.opset.get("", 13) >= 13 else 1)
    t = scores.output[0]
    for n in chain:       # from the scores MatMul to the Softmax
        path = [i for i in n.input if i == t]
        others = [i for i in n.input if i and i != t]
        what = (f"{m.label(n)} between the scores ({m.label(scores)}) and {label}")
        if n.op_type not in SCORE_OPS:
            raise OnnxError(f"{what} is not supported: only scaling by a constant, additive "
                            "masks and Where masks are (softcapping? a learned bias?)")
        if not path:
            raise OnnxError(f"{what}: unexpected wiring")
        if n.op_type in ("Mul", "Div", "Add", "Sub"):
            other = others[0] if others else t
            _need_constant(m, other, f"{n.op_type} operand", what)
            first = n.input[0] == t
            if n.op_type == "Mul":
                core.score_factors.append((other, 1))
            elif n.op_type == "Div":
                if not first:
                    raise OnnxError(f"{what} divides by the scores; not supported")
                core.score_factors.append((other, -1))
            elif n.op_type == "Add":
                core.adds.append((other, 1.0))
            else:
                if not first:
                    raise OnnxError(f"{what} negates the scores; not supported")
                core.adds.append((other, -1.0))
        elif n.op_type == "Where":
            cond = n.input[0]
            _need_constant(m, cond, "mask condition", what)
            keep_when_true = n.input[1] == t
            other = n.input[2] if keep_when_true else n.input[1]
            _need_constant(m, other, "masked value", what)
            core.wheres.append((cond, other, keep_when_true))
        t = n.output[0]
    for n, t in post:     # from the Softmax to the P @ V MatMul
        what = f"{m.label(n)} between {label} and {m.label(pv)}"
        if n.op_type not in PROB_OPS:
            raise OnnxError(f"{what} is not supported (only Identity, Cast, Dropout and "
                            "zeroing fully masked rows with Where)")
        if n.op_type == "Where":
            _need_constant(m, n.input[0], "row condition", what)
            zero_when_true = n.input[2] == t
            zeros = n.input[1] if zero_when_true else n.input[2]
            _need_constant(m, zeros, "replacement", what)
            core.zero_rows.append((n.input[0], zeros, zero_when_true))
        elif n.input[0] != t:
            raise OnnxError(f"{what}: unexpected wiring")
    return core


def _find_cores(m):
    cores, skipped = [], []
    for n in m.nodes:
        dom = n.domain or ""
        if dom in ("", "ai.onnx") and n.op_type == "Attention":
            cores.append(_core_attention(m, n))
        elif dom == "com.microsoft" and n.op_type == "MultiHeadAttention":
            cores.append(_core_ms_mha(m, n))
        elif dom == "com.microsoft" and n.op_type in UNSUPPORTED:
            raise OnnxError(f"{m.label(n)} (com.microsoft.{n.op_type}): "
                            f"{UNSUPPORTED[n.op_type]}; export the model with the standard "
                            "Attention operator or as plain MatMul/Softmax ops")
    for n in m.nodes:
        if n.op_type == "Softmax" and (n.domain or "") in ("", "ai.onnx"):
            try:
                cores.append(_core_softmax(m, n))
            except _NotAttention as why:
                skipped.append(str(why))
    return cores, skipped


# -- the projections around an attention ---------------------------------------------------
def _projection_path(m, t, role, core):
    factors, seen_bias, steps = [], False, 0
    while True:
        steps += 1
        n = m.producer.get(t)
        if n is None or steps > 64:      # a model input, projected by the identity
            return _Path(role, None, [t], factors, seen_bias)
        dep_in = [i for i in n.input if i and i in m.dep]
        what = f"{core.label}: {m.label(n)} on the {role} path"
        if n.op_type in ("MatMul", "Gemm") and len(dep_in) == 1 and dep_in[0] == n.input[0]:
            has_bias = seen_bias or (n.op_type == "Gemm" and len(n.input) > 2 and bool(n.input[2]))
            return _Path(role, n, _layout_back(m, dep_in[0]), factors, has_bias)
        if n.op_type not in PATH_OPS:
            raise OnnxError(f"{what} is not supported: between a projection and the attention "
                            "only reshapes, transposes, slices and constant scaling or bias are")
        if len(dep_in) != 1:
            raise OnnxError(f"{what} combines several tensors computed from the model input "
                            "(rotary embeddings? cross-attention?); not supported")
        if n.op_type in ("Mul", "Div", "Add", "Sub", "Neg"):
            if n.op_type == "Div" and n.input[0] != dep_in[0]:
                raise OnnxError(f"{what} divides by the projection; not affine")
            if n.op_type in ("Mul", "Div") and not seen_bias:
                other = [i for i in n.input if i and i != dep_in[0]]
                if other:
                    factors.append((other[0], 1 if n.op_type == "Mul" else -1))
            if n.op_type in ("Add", "Sub"):
                seen_bias = True
        elif dep_in[0] != n.input[0]:
            raise OnnxError(f"{what} uses the projection as an index or shape; not supported")
        t = dep_in[0]


def _layout_back(m, t):
    out = [t]
    while True:
        n = m.producer.get(t)
        if n is None or n.op_type not in LAYOUT_OPS or n.input[0] not in m.dep or any(
                i in m.dep for i in n.input[1:] if i):
            return out
        t = n.input[0]
        out.append(t)


def _output_path(m, o, core):
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
            if (n.op_type in ("MatMul", "Gemm") and n.input[0] == t
                    and n.input[1] not in m.dep):
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
        return _Out(None, pre, False)
    return _Out(proj, post, has_bias)


# -- running the model ---------------------------------------------------------------------
class _Runner:
    def __init__(self, m, names, sample_inputs):
        onnx = need_onnx()
        from onnx import numpy_helper
        self.m = m
        self.sample = dict(sample_inputs or {})
        self.consts = {n: numpy_helper.to_array(m.inits[n]) for n in names if n in m.inits}
        inputs = {i.name for i in m.inputs}
        self.fetch = [n for n in dict.fromkeys(names) if n not in self.consts and n not in inputs]
        proto = onnx.ModelProto()
        proto.CopyFrom(m.proto)
        have = {o.name for o in proto.graph.output}
        for n in self.fetch:
            if n not in have:
                proto.graph.output.append(onnx.ValueInfoProto(name=n))
        self.sess = ort_session(proto)

    def shapes(self, batch, seq, swap=False):
        """Input shapes: dynamic axis 0/1 of rank-3 float inputs are batch/seq (swapped for
        seq-first models), other dynamic dims 1; dims with the same name agree."""
        assign, shapes = {}, {}
        ordered = sorted(self.m.inputs, key=lambda i: not _float3(i))
        for inp in ordered:
            dims = []
            for axis, d in enumerate(inp.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(d.dim_value)
                    continue
                key = d.dim_param or (inp.name, axis)
                if key not in assign:
                    if _float3(inp) and axis in (0, 1):
                        assign[key] = seq if (axis == 1) != swap else batch
                    else:
                        assign[key] = 1
                dims.append(assign[key])
            shapes[inp.name] = tuple(dims)
        return shapes

    def run(self, shapes, rng):
        feeds = {}
        for inp in self.m.inputs:
            elem = inp.type.tensor_type.elem_type
            if inp.name in self.sample and elem not in FLOAT_TYPES:
                feeds[inp.name] = np.asarray(self.sample[inp.name])
            elif elem in FLOAT_TYPES:
                feeds[inp.name] = rng.standard_normal(shapes[inp.name]).astype(
                    FLOAT_TYPES[elem])
            else:
                raise OnnxError(f"model input {inp.name!r} is not floating point; pass "
                                f"sample_inputs={{{inp.name!r}: array}} to import_onnx")
        try:
            outs = self.sess.run(self.fetch, feeds)
        except Exception as err:  # onnxruntime raises its own exception types
            msg = str(err).splitlines()[0]
            msg = msg.split("Status Message:")[-1].split("was false.")[-1].strip()
            raise OnnxError(f"onnxruntime cannot run the model on inputs of shapes "
                            f"{ {k: v.shape for k, v in feeds.items()} } ({msg[:200]}); if "
                            "the model only runs at the sequence length it was exported with, "
                            "pass that length as seq_len=") from None
        vals = dict(self.consts)
        vals.update(feeds)
        vals.update(zip(self.fetch, outs))
        return vals


def _float3(inp):
    t = inp.type.tensor_type
    return t.elem_type in FLOAT_TYPES and len(t.shape.dim) == 3


# -- the import ----------------------------------------------------------------------------
def import_onnx(model, *, seq_len: int = 32, batch: int = 1, sample_inputs: dict | None = None,
                seed: int = 0, name: str | None = None) -> list[ImportedAttention]:
    """Find the attention layers of an ONNX model; returns one ImportedAttention each.

    Args:
        model: a path to an ``.onnx`` file (external data is read) or an ``onnx.ModelProto``.
        seq_len, batch: the sequence length and batch size the model is probed at when
            those axes are dynamic (a model exported with a length baked into a Reshape only
            runs at that length: pass it).
        sample_inputs: arrays for non-float model inputs (token ids...); float inputs are
            random.
        seed: seed of the random probe inputs.
        name: name of the graphs (default: the ONNX graph's name, numbered if several).

    Needs onnxruntime (``com.microsoft`` operators need it anyway). Raises ``OnnxError``
    naming the ONNX node and the reason when there is no attention or it cannot be imported.
    """
    onnx = need_onnx()
    if isinstance(model, (str, Path)):
        try:
            proto = onnx.load(str(model))
        except FileNotFoundError:
            raise OnnxError(f"no ONNX model at {model}") from None
        except Exception as err:  # protobuf decode errors have several types
            raise OnnxError(f"{model} is not a readable ONNX model: {err}") from None
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        raise OnnxError(f"import_onnx() takes a path or an onnx.ModelProto, got "
                        f"{type(model).__name__}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise OnnxError(f"seq_len={seq_len!r} must be an integer >= 2")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise OnnxError(f"batch={batch!r} must be a positive integer")
    m = _Model(proto)
    cores, skipped = _find_cores(m)
    if not cores:
        why = "; ".join(skipped[:3]) if skipped else "it has no Softmax"
        raise OnnxError(f"no attention found in ONNX model {proto.graph.name!r} "
                        f"({len(m.nodes)} nodes): no Attention or com.microsoft."
                        f"MultiHeadAttention node, and no Softmax between a Q @ K^T MatMul and "
                        f"a P @ V MatMul ({why})")
    for c in cores:
        c.paths = {r: _projection_path(m, getattr(c, r), r.upper(), c) for r in ("q", "k", "v")}
        c.out = _output_path(m, c.o, c)

    names = []
    for c in cores:
        names += [c.q, c.k, c.v, c.o] + c.out.candidates
        for p in c.paths.values():
            names += p.candidates + [t for t, _ in p.factors]
        names += [t for t, _ in c.score_factors] + [t for t, _ in c.adds] + c.bool_masks
        names += [t for w in c.wheres for t in w[:2]] + [t for z in c.zero_rows for t in z[:2]]
        names += [c.qkv_bias] if c.qkv_bias else []
    runner = _Runner(m, names, sample_inputs)
    rng = np.random.default_rng(seed)

    swap = False
    shapes = runner.shapes(batch, seq_len)
    try:
        first = runner.run(shapes, rng)
    except OnnxError as err:    # perhaps seq-first with a length baked in: seq on axis 0?
        if runner.shapes(batch, seq_len, swap=True) == shapes:
            raise
        try:
            first = runner.run(runner.shapes(batch, seq_len, swap=True), rng)
        except OnnxError:
            raise err from None
        swap, shapes = True, runner.shapes(batch, seq_len, swap=True)
    blocks = _blocks(m, cores, first)
    if not swap and any(b["layout"] == "SBD" for b in blocks) and any(
            _seq(c, first) < 2 for c in cores):   # seq-first: probe again with seq on axis 0
        swap = True
        shapes = runner.shapes(batch, seq_len, swap=True)
        first = runner.run(shapes, rng)
        blocks = _blocks(m, cores, first)

    results = []
    for i, blk in enumerate(blocks):
        gname = name or proto.graph.name or "imported"
        if len(blocks) > 1:
            gname = f"{gname}{i}"
        results.append(_import_block(m, blk, runner, shapes, first, rng, gname, seq_len, batch,
                                     swap))
    return results


def _seq(core, vals):
    q = vals[core.q]
    if core.layout == "lead":
        return q.shape[-2]
    return q.shape[1] if q.ndim == 3 else q.shape[2]


def _blocks(m, cores, vals):
    """Group cores into layers: (X tensor, Y tensor, layout, cores)."""
    blocks = {}
    for c in cores:
        s = _seq(c, vals)
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
        xs_shape = vals[x].shape
        layout = "SBD" if xs_shape[0] == s and xs_shape[1] != s else "BSD"
        ys = [t for t in c.out.candidates
              if vals[t].ndim == 3 and vals[t].shape[:2] == xs_shape[:2]]
        if not ys:
            raise OnnxError(f"{c.label}: no [batch, seq, features] tensor after it (its output "
                            f"{c.o!r} is {vals[c.o].shape}; expected an output projection "
                            "MatMul/Gemm by a constant weight)")
        y = ys[-1]
        blk = blocks.setdefault(y, {"x": x, "y": y, "layout": layout, "cores": []})
        if blk["x"] != x:
            raise OnnxError(f"{c.label} and {blk['cores'][0].label} feed the same output "
                            f"{y!r} but project different tensors ({x!r}, {blk['x']!r})")
        blk["cores"].append(c)
    order = {id(n): i for i, n in enumerate(m.nodes)}   # layers in model order
    return sorted(blocks.values(), key=lambda b: min(order[id(c.node)] for c in b["cores"]))


def _bsd(a, layout):
    return np.swapaxes(a, 0, 1) if layout == "SBD" else a


def _heads(c, vals, batch):
    """Per core: q [B,H,S,d], k, v [B,H,T,d] (K/V repeated per query head), o [B,H,S,dv],
    and the scores shape [B, H, S, T] grouping."""
    q, k, v, o = (np.asarray(vals[t], np.float64) for t in (c.q, c.k, c.v, c.o))
    if c.layout == "lead":
        k = np.swapaxes(k, -1, -2)
        lead = o.shape[:-2]
        try:
            q, k, v = (np.broadcast_to(a, lead + a.shape[-2:]) for a in (q, k, v))
        except ValueError:
            raise OnnxError(f"{c.label}: Q {vals[c.q].shape}, K^T {vals[c.k].shape} and V "
                            f"{vals[c.v].shape} do not broadcast to the output {o.shape}") from None
        n = int(np.prod(lead))
        if n % batch:
            raise OnnxError(f"{c.label}: cannot tell heads from batch in {o.shape}")
        q, k, v, o = (a.reshape(batch, n // batch, *a.shape[-2:]) for a in (q, k, v, o))
        return q, k, v, o, lead
    if c.qkv_bias:
        bias = np.asarray(vals[c.qkv_bias], np.float64)
        nq, nk = q.shape[-1], k.shape[-1]
        if k.ndim != 3 or bias.shape != (nq + nk + v.shape[-1],):
            raise OnnxError(f"{c.label}: bias {bias.shape} does not match query/key/value")
        q, k, v = q + bias[:nq], k + bias[nq:nq + nk], v + bias[nq + nk:]
    if q.ndim == 3:
        if not c.q_heads or not c.kv_heads:
            raise OnnxError(f"{c.label}: 3D Q/K/V need q_num_heads and kv_num_heads")
        if k.ndim != 3 or v.ndim != 3:
            raise OnnxError(f"{c.label}: Q is 3D but K/V are {k.ndim}D; not supported")

        def split(a, h):
            b_, s_, f_ = a.shape
            return a.reshape(b_, s_, h, f_ // h).transpose(0, 2, 1, 3)
        q, k, v = split(q, c.q_heads), split(k, c.kv_heads), split(v, c.kv_heads)
        o = split(o, c.q_heads)
    elif q.ndim != 4:
        raise OnnxError(f"{c.label}: Q is {q.ndim}D; expected 3D or 4D")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise OnnxError(f"{c.label}: {q.shape[1]} query heads and {k.shape[1]} K/V heads")
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    return q, k, v, o, q.shape[:2]


def _keep(c, vals, batch, n_heads, s, t, notes):
    """[B, H, S, T] bool: which keys each query sees, from the core's constant masks."""
    full = (batch, n_heads, s, t)

    def spread(a, what):
        a = np.asarray(a)
        try:
            if c.layout == "lead":
                lead = c._lead
                a = np.broadcast_to(a, tuple(lead) + (s, t))
                return a.reshape(full)
            return np.broadcast_to(a, full)
        except ValueError:
            raise OnnxError(f"{c.label}: {what} of shape {a.shape} does not broadcast to the "
                            f"scores") from None

    keep = np.ones(full, bool)
    for tensor, sign in c.adds:
        a = sign * np.asarray(vals[tensor], np.float64)
        bad = np.isfinite(a) & (a != 0) & (a > NEG_LIMIT) | (a == np.inf)
        if bad.any():
            raise OnnxError(f"{c.label}: additive mask {tensor!r} has values other than 0 and "
                            f"-inf (e.g. {a[bad].flat[0]:.4g}): attention biases such as ALiBi "
                            "or relative positions are not supported")
        if np.any(np.isfinite(a) & (a <= NEG_LIMIT)):
            notes.append(f"additive mask {tensor!r}: finite values <= {NEG_LIMIT:g} taken as "
                         "-inf (a fully masked row then averages in ONNX, is zero in mhagen)")
        keep &= spread(~(a <= NEG_LIMIT), f"mask {tensor!r}")
    for cond, other, keep_when_true in c.wheres:
        o = np.asarray(vals[other], np.float64)
        if np.any(o > NEG_LIMIT):
            raise OnnxError(f"{c.label}: Where replaces masked scores by {o.max():.4g}, not "
                            "-inf; not supported")
        cnd = np.asarray(vals[cond]).astype(bool)
        keep &= spread(cnd if keep_when_true else ~cnd, f"condition {cond!r}")
    for mask in c.bool_masks:
        a = np.asarray(vals[mask])
        if a.dtype == bool:
            keep &= spread(a, f"attn_mask {mask!r}")
        else:
            bad = np.isfinite(a) & (a != 0) & (a > NEG_LIMIT)
            if bad.any():
                raise OnnxError(f"{c.label}: float attn_mask {mask!r} has values other than 0 "
                                f"and -inf (e.g. {a[bad].flat[0]:.4g}); not supported")
            keep &= spread(~(a <= NEG_LIMIT), f"attn_mask {mask!r}")
    if c.causal:
        keep &= np.tril(np.ones((s, t), bool))
    for cond, zeros, zero_when_true in c.zero_rows:
        if np.any(np.asarray(vals[zeros]) != 0):
            raise OnnxError(f"{c.label}: a Where after the Softmax replaces probabilities by "
                            "non-zero values; not supported")
        cnd = np.asarray(vals[cond]).astype(bool)
        z = spread(cnd if zero_when_true else ~cnd, f"condition {cond!r}")
        dead = ~keep.any(axis=-1, keepdims=True)
        if np.any(z & ~dead):
            raise OnnxError(f"{c.label}: a Where after the Softmax zeroes probabilities of rows "
                            "that are not fully masked; not supported")
    return keep


def _band(grid):
    """The mask expression of a [S, T] grid that is a band lo <= kv_idx - q_idx <= hi;
    (causal part, other part) or raises ValueError."""
    s, t = grid.shape
    diff = np.arange(t)[None, :] - np.arange(s)[:, None]
    if grid.all():
        return False, None
    if not grid.any():
        return False, ex.kv_idx < 0
    lo, hi = int(diff[grid].min()), int(diff[grid].max())
    if not np.array_equal(grid, (diff >= lo) & (diff <= hi)):
        raise ValueError("not a band")
    causal = hi == 0
    parts = []
    if hi < t - 1 and not causal:
        parts.append(ex.kv_idx - ex.q_idx <= hi)
    if lo > -(s - 1):
        parts.append(ex.q_idx - ex.kv_idx < 1 - lo)
    other = None
    for p in parts:
        other = p if other is None else other & p
    return causal, other


class _Design:
    """Least squares y ~ x @ w (+ b) over token rows in float64, one SVD of x for all fits."""

    def __init__(self, x, intercept):
        self.a = np.hstack([x, np.ones((x.shape[0], 1))]) if intercept else x
        self.width, self.intercept = x.shape[1], intercept
        u, sv, vt = np.linalg.svd(self.a, full_matrices=False)
        keep = sv > sv[0] * max(self.a.shape) * np.finfo(np.float64).eps
        self.u, self.sv, self.vt = u[:, keep], sv[keep], vt[keep]

    def fit(self, y, what):
        sol = self.vt.T @ ((self.u.T @ y) / self.sv[:, None])
        resid = float(np.max(np.abs(self.a @ sol - y))) if y.size else 0.0
        scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-30)
        if resid > 1e-4 * scale + 1e-6:
            raise OnnxError(f"{what} is not an affine function of the layer input token by "
                            f"token (residual {resid:.2g} of {scale:.2g}): positional or rotary "
                            "embeddings, or a non-linear op, sit between them; not supported")
        w = sol[:self.width]
        b = sol[self.width] if self.intercept else np.zeros(y.shape[1])
        return w, b


def _import_block(m, blk, runner, shapes, first, rng, gname, seq_len, probe_batch, swap):
    x_name, y_name, layout, cores = blk["x"], blk["y"], blk["layout"], blk["cores"]
    notes = []
    if layout == "SBD":
        notes.append(f"{x_name!r} is [seq, batch, D] (seq-first); mhagen takes [batch, seq, D]")
    x0 = _bsd(first[x_name], layout)
    batch, s, d_model = x0.shape
    feats = sum(int(np.prod(first[c.o].shape)) // (batch * s) for c in cores)
    need = 3 * max(d_model + 1, feats + 1)   # 3x the unknowns: well-conditioned fits
    runs = [first] + [runner.run(shapes, rng) for _ in range(-(-need // (batch * s)) - 1)]

    # per core: heads, scale, masks, fits
    head_rows = []          # one entry per query head, in order
    o_cols, k_eq, v_eq = [], [], []
    bias = any(p.has_bias for c in cores for p in c.paths.values()) or any(
        c.qkv_bias for c in cores) or any(c.out.has_bias for c in cores)
    xs = np.concatenate([_bsd(v[x_name], layout).reshape(-1, d_model) for v in runs])
    designs = {}
    for c in cores:
        per_run = [_heads(c, vals, batch) for vals in runs]
        q0, k0, v0, o0, lead = per_run[0]
        c._lead = lead
        n_heads, d = q0.shape[1], q0.shape[-1]
        if k0.shape[-1] != d or v0.shape[-1] != d:
            raise OnnxError(f"{c.label}: Q/K are {d} wide but V is {v0.shape[-1]}; mhagen "
                            "heads have one width")
        if c.softmax_axis is not None:
            rank = len(lead) + 2
            if c.softmax_axis not in (-1, rank - 1):
                raise OnnxError(f"{c.label}: Softmax over axis {c.softmax_axis}, not the key "
                                "axis; not supported")
        # the scale: op attribute or constant factors, times those applied to Q and K
        if c.layout == "lead":
            scale = 1.0
            for t, e in c.score_factors:
                f = np.asarray(first[t], np.float64)
                if f.size != 1:
                    raise OnnxError(f"{c.label}: the scores are multiplied by {t!r} of shape "
                                    f"{f.shape}; only a scalar scale is supported")
                scale *= float(f.reshape(())) ** e
        else:
            scale = float(c.scale) if c.scale else 1.0 / math.sqrt(d)
        div = {}
        for role in ("q", "k"):
            f = 1.0
            for t, e in c.paths[role].factors:
                val = np.asarray(first[t], np.float64)
                if val.size == 1:
                    f *= float(val.reshape(())) ** e
            div[role] = f
        scale *= div["q"] * div["k"]
        keep = _keep(c, first, batch, n_heads, s, k0.shape[2], notes)
        if not np.all(keep == keep[:1]):
            raise OnnxError(f"{c.label}: the mask differs between batch elements (a padding "
                            "mask?); mhagen masks are functions of positions only")
        if (~keep[0].any(axis=-1)).any():
            notes.append("some queries see no key (fully masked rows); mhagen gives zeros there"
                         + ("" if c.zero_rows or c.source == "Attention" else
                            " (this ONNX model gives NaN)"))
        fits = {}
        for role, idx in (("q", 0), ("k", 1), ("v", 2)):
            ys = np.concatenate([r[idx].transpose(0, 2, 1, 3).reshape(-1, n_heads * d)
                                 for r in per_run])
            intercept = c.paths[role].has_bias or bool(c.qkv_bias)
            if intercept not in designs:
                designs[intercept] = _Design(xs, intercept)
            w, b = designs[intercept].fit(ys, f"{c.label}: {role.upper()}")
            f = div.get(role, 1.0)
            fits[role] = (w.reshape(d_model, n_heads, d).transpose(1, 0, 2) / f,
                          b.reshape(n_heads, d) / f)
        for h in range(n_heads):
            try:
                causal, other = _band(keep[0, h])
            except ValueError:
                raise OnnxError(f"{c.label}: the mask of head {h} is not a band "
                                "(lo <= kv_idx - q_idx <= hi) at seq length "
                                f"{s}; mhagen cannot express it as a mask expression") from None
            head_rows.append({"scale": scale, "causal": causal, "mask": other, "d": d,
                              "q": (fits["q"][0][h], fits["q"][1][h]),
                              "k": (fits["k"][0][h], fits["k"][1][h]),
                              "v": (fits["v"][0][h], fits["v"][1][h])})
        k_eq.append(k0)
        v_eq.append(v0)
        o_cols.append([r[3].transpose(0, 2, 1, 3).reshape(-1, n_heads * d) for r in per_run])

    widths = {h["d"] for h in head_rows}
    if len(widths) != 1:
        raise OnnxError(f"heads of different widths {sorted(widths)} ({cores[0].label}...); "
                        "not supported")
    d = widths.pop()
    n_heads = len(head_rows)
    # grouped K/V: the largest group of query heads whose K and V are the same tensors
    k_all, v_all = np.concatenate(k_eq, axis=1), np.concatenate(v_eq, axis=1)
    group = max(g for g in range(1, n_heads + 1) if n_heads % g == 0 and all(
        np.array_equal(k_all[:, h], k_all[:, h - h % g]) and
        np.array_equal(v_all[:, h], v_all[:, h - h % g]) for h in range(n_heads)))
    kv_heads = n_heads // group

    # the output projection, from the observed attention outputs
    os_ = np.concatenate([np.concatenate([cols[i] for cols in o_cols], axis=1)
                          for i in range(len(runs))])
    ys = np.concatenate([_bsd(v[y_name], layout).reshape(-1, v[y_name].shape[-1]) for v in runs])
    ok = np.all(np.isfinite(os_), axis=1) & np.all(np.isfinite(ys), axis=1)
    if ok.sum() <= os_.shape[1]:
        raise OnnxError(f"{cores[0].label}: too few finite outputs to find the output "
                        "projection (fully masked rows give NaN in this model)")
    out_bias = any(c.out.has_bias for c in cores)
    w_o, b_o = _Design(os_[ok], out_bias).fit(ys[ok], f"{cores[0].label}: the output "
                                                      f"{y_name!r}")
    d_out = w_o.shape[1]

    weights = {"w_q": np.stack([h["q"][0] for h in head_rows]),
               "w_k": np.stack([head_rows[j * group]["k"][0] for j in range(kv_heads)]),
               "w_v": np.stack([head_rows[j * group]["v"][0] for j in range(kv_heads)]),
               "w_o": w_o}
    if bias:
        weights.update(b_q=np.stack([h["q"][1] for h in head_rows]),
                       b_k=np.stack([head_rows[j * group]["k"][1] for j in range(kv_heads)]),
                       b_v=np.stack([head_rows[j * group]["v"][1] for j in range(kv_heads)]),
                       b_o=b_o)
    weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    graph = _layer(gname, d_model, d, d_out, head_rows, kv_heads, bias)

    # verification on a fresh input (another length when the seq axis is dynamic)
    vshapes = runner.shapes(probe_batch + 1, seq_len + 7, swap=swap)
    try:
        vals = runner.run(vshapes, rng)
    except OnnxError:
        vals = runner.run(shapes, rng)
    xv, yv = _bsd(vals[x_name], layout), _bsd(vals[y_name], layout)
    ref = graph.reference(xv.astype(np.float32), weights)
    rows = np.all(np.isfinite(yv), axis=-1)
    err = float(np.max(np.abs(ref[rows] - yv[rows]))) if rows.any() else 0.0
    tol = 1e-4 + 2e-4 * float(np.max(np.abs(yv[rows]))) if rows.any() else 0.0
    if not rows.all():
        notes.append(f"{int((~rows).sum())} output rows are NaN in the ONNX model (fully masked "
                     "queries); mhagen gives finite values there")
    if err > tol:
        raise OnnxError(f"{cores[0].label}: the imported layer does not reproduce the ONNX "
                        f"output {y_name!r} (max error {err:.3g} at shape {xv.shape}); the "
                        "layer holds something mhagen does not model (a mask that depends on "
                        "the sequence length beyond the probe, a residual, ...)")
    block_nodes = _block_nodes(m, x_name, y_name)
    return ImportedAttention(graph, weights, cores[0].source, x_name, y_name, layout,
                             tuple(block_nodes), tuple(dict.fromkeys(notes)), err)


def _layer(name, d_model, d, d_out, heads, kv_heads, bias):
    import mhagen
    std = 1.0 / math.sqrt(d)
    first = heads[0]
    uniform = all(abs(h["scale"] - std) <= 1e-5 * std and h["causal"] == first["causal"]
                  and h["mask"] == first["mask"] for h in heads)
    if uniform and d_out == d_model:
        return mhagen.mha(d_model, len(heads), head_dim=d, kv_heads=kv_heads,
                          causal=first["causal"], mask=first["mask"], bias=bias, name=name)
    g = Graph(name, options={"d_model": d_model, "num_heads": len(heads), "head_dim": d,
                             "kv_heads": kv_heads, "bias": bias, "imported": "onnx"})
    x = g.input("x", d_model)
    masks = [(ex.causal() if h["mask"] is None else ex.causal() & h["mask"]) if h["causal"]
             else h["mask"] for h in heads]
    g.set_output(add_heads(g, x, [h["scale"] for h in heads], masks, kv_heads, d, d_out, bias))
    g.shapes()
    return g


def _block_nodes(m, x, y):
    fwd, todo = {x}, [x]
    while todo:
        for n in m.consumers.get(todo.pop(), []):
            for o in n.output:
                if o and o not in fwd:
                    fwd.add(o)
                    todo.append(o)
    names, seen, todo = [], set(), [y]
    while todo:
        n = m.producer.get(todo.pop())
        if n is None or id(n) in seen or not any(o in fwd for o in n.output):
            continue
        seen.add(id(n))
        names.append(n.name or n.output[0])
        todo.extend(i for i in n.input if i)
    order = {n.name or n.output[0]: i for i, n in enumerate(m.nodes)}
    return sorted(names, key=order.get)
