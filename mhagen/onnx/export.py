"""Export any mhagen layer to ONNX, in one of two forms (and decoding layers in a third).

``decomposed`` (the default, for portability; opset 17 or later): the graph is walked node by
node and every node becomes plain ONNX ops -- MatMul/Add per head projection (each head's
weight and bias is its own initializer, ``w_q.3``, ``b_q.3``), MatMul + Transpose for the
scores, Mul for the scale, Where for masks, Softmax, MatMul for the weighted sum, Concat,
MatMul/Add for W_O, and RoPE (``rotary`` nodes, the fused attention's ``rotary``) as
Slice/Mul/Sub/Add/Concat with cos/sin tables [S, rotary_dim/2] -- constants when the sequence
length is static, else computed in float64 from Range (then Cast to float32), as mhagen's
tables are. Any verified graph exports this way, builder-made graphs and graphs with
the fused kinds (``qkv_projection`` becomes one MatMul per segment + Concat, ``attention``
becomes per-head Slice + the ops above).

``fused``: Q, K and V projections (one MatMul each, heads side by side), the standard
``Attention`` operator (opset 23+: ``q_num_heads``, ``kv_num_heads``, ``scale``,
``is_causal``, ``attn_mask``), then W_O. Only for layers whose heads all have the same
structure (what ``mhagen.passes.fuse_attention`` accepts); otherwise an ``OnnxError`` says why
and suggests ``form="decomposed"``. Layers with score modifiers or rotary embeddings are
refused too (``Attention`` carries neither; opset 23's ``RotaryEmbedding`` is not used).

``gqa`` (decoding layers only): onnxruntime's ``com.microsoft.GroupQueryAttention``, each
batch row with its own cache length and new-token count; rotary embeddings, sliding windows,
softcap and additive score biases (ALiBi) carried by the op; see mhagen/onnx/export_gqa.py.

Decoding layers (``kv_cache=``) export in the fused form as ONNX's past/present form:
inputs ``x`` [batch, seq, d_model], ``past_key`` and ``past_value`` [batch, kv_heads,
past_seq, head_dim] (``past_seq`` a symbolic dim unless ``past_len`` is given); outputs ``y``,
``present_key`` and ``present_value`` [batch, kv_heads, past_seq + seq, head_dim], in the
layer's cache dtype (a half-precision cache: Cast to float32 around ``Attention``, the new
K/V rounded to it first, as mhagen's kernels read them from the cache). That is
mhagen's cache with every batch row holding the same number of tokens (``cache.lens`` all
``past_seq``): the new tokens sit at positions past_seq + t, and ``is_causal`` is bottom-right
aligned from the past length, as mhagen's decoding positions are. Causal or no mask only
(other masks, score modifiers and rotary embeddings are refused with the reason).

Masks (any boolean mask expression of batch, head, q_idx, kv_idx):
  * ``masks="constant"``: materialised as a constant boolean initializer, [S, S] (with a
    leading batch and/or head axis when the expression uses them). Needs static shapes.
  * ``masks="computed"``: computed in the graph from Range and comparison ops on the runtime
    sequence length (``Shape(x)``), so it works with a dynamic sequence axis.
  * ``masks="auto"`` (default): constant when the dimensions the mask needs are static,
    computed otherwise. A plain causal mask in the fused form is ``is_causal=1``.

Semantics that differ from a naive reading of the ONNX spec, and what the export does:
  * **Fully masked rows.** mhagen gives zeros for a query that sees no key. ONNX ``Softmax``
    of an all ``-inf`` row is NaN (onnxruntime and the reference evaluator agree), so the
    decomposed form follows each masked Softmax with ``Where(row_is_fully_masked, 0, p)``
    (the condition is computed from the mask, never from the data; it is left out when a
    constant mask has no such row). The ``Attention`` operator's spec (errata of onnx 1.23)
    gives a zero output row for a fully masked query, and onnxruntime 1.32 does so: the fused
    form needs no fix-up. (``com.microsoft.MultiHeadAttention`` with a ``-inf`` bias gives NaN,
    with a finite large negative bias a uniform average.)
  * **Causal alignment.** mhagen's causal mask is top-left aligned (query i sees keys 0..i).
    ``Attention``'s ``is_causal`` is bottom-right (offset-aware) aligned: query i sees keys
    ``j <= i + offset`` with offset = past length, or ``nonpad_kv_seqlen - q_len``, and 0
    without a cache. So bottom-right alignment comes from a cache offset, not from the
    lengths alone: q_len 3, kv_len 5 without a cache is top-left (query i sees keys 0..i;
    onnxruntime 1.32 and onnx's reference evaluator agree).
    mhagen layers are self-attention without a cache (equal lengths, offset 0), where all
    readings give the same lower triangle: ``is_causal=1`` is exact here. Other masks go in
    ``attn_mask`` (boolean, True = attend).
  * **Grouped K/V.** ``Attention`` with ``kv_num_heads < q_num_heads`` gives query head h the
    K/V head ``h // (q_num_heads // kv_num_heads)`` -- mhagen's rule. K/V sharing patterns that
    are not contiguous groups are exported with one (duplicated) K/V head per query head.

Weights are initializers; above 2 GB (or with ``external_data=True``) they are written as
external data next to the model (``<name>.onnx.data``). ``onnx.checker`` (full check, with
shape inference) runs on every export.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mhagen.version import __version__ as mhagen_version
from mhagen.checks import positive_int
from mhagen.dtypes import numpy_dtype
from mhagen.errors import GraphError, InputError
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.graph import Graph
from mhagen.onnx._common import OnnxError, fewest_kv_heads, first_query_heads, need_onnx
from mhagen.onnx.export_gqa import build_gqa
from mhagen.passes.fuse_attention import fuse_attention
from mhagen.reference import mask_grid
from mhagen.weights import check_weights

FORMS = ("decomposed", "fused", "gqa")
MASK_MODES = ("auto", "constant", "computed")
MIN_OPSET = {"decomposed": 17, "fused": 23, "gqa": 17}
#: protobuf refuses messages of 2 GiB; stay clear of it.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26

_CMP = {"<": "Less", "<=": "LessOrEqual", ">": "Greater", ">=": "GreaterOrEqual", "==": "Equal"}
_ARITH = {"+": "Add", "-": "Sub", "*": "Mul"}


def export_onnx(layer: Graph, path, weights: dict | None = None, *, form: str = "decomposed",
                batch: int = 1, seq_len: int = 128, dynamic_batch: bool = False,
                dynamic_seq: bool = False, opset: int | None = None, masks: str = "auto",
                external_data: bool | None = None, past_len: int | None = None,
                kv_seq_len: int | None = None) -> Path:
    """Write `layer` with `weights` as an ONNX model at `path`; returns the path.

    Args:
        layer: any mhagen graph with one input [batch, seq, d_model] (``mhagen.mha(...)``, a
            builder-made ``Graph``, or a fused graph).
        path: the ``.onnx`` file to write (its directory is created).
        weights: the layer's weights (``layer.init_weights(seed)``, ``weights_from_torch``...);
            required -- an export never invents weights.
        form: ``"decomposed"`` (plain ops, every graph), ``"fused"`` (the ``Attention``
            operator, opset 23+, for layers whose heads share one structure) or ``"gqa"``
            (decoding layers: com.microsoft.GroupQueryAttention, mhagen/onnx/export_gqa.py).
        batch, seq_len: the static input shape [batch, seq_len, d_model].
        dynamic_batch, dynamic_seq: make that axis symbolic (``"batch"``, ``"seq"``).
        opset: ONNX opset; default 17 (decomposed, gqa) or 23 (fused).
        masks: ``"auto"``, ``"constant"`` or ``"computed"`` (see the module docstring).
        external_data: store initializers in ``<path>.data``; default: only above 2 GB.
        past_len: decoding layers, fused form: the static past length of
            past_key/past_value; default a symbolic ``past_seq``.
        kv_seq_len: cross-attention layers: the context's static length (with dynamic_seq,
            a symbolic ``kv_seq`` instead); decomposed form only.

    The model's input is ``x`` [batch, seq, d_model] of the layer's dtype (cross-attention:
    and ``context`` [batch, kv_seq, kv_dim]), its output ``y``. A float16/bfloat16 layer
    keeps its weights in that dtype and computes as mhagen does: Cast to float32 after the
    inputs and the weights, float32 throughout, ``y`` Cast back.
    """
    onnx = need_onnx()
    if not isinstance(layer, Graph):
        raise GraphError(f"export_onnx() takes a mhagen graph (mhagen.mha(...) or a Graph), got "
                         f"{type(layer).__name__}")
    if form not in FORMS:
        raise OnnxError(f"form={form!r} is not an ONNX form; use one of {', '.join(FORMS)}")
    if masks not in MASK_MODES:
        raise OnnxError(f"masks={masks!r}: use one of {', '.join(MASK_MODES)}")
    positive_int("batch", batch)
    positive_int("seq_len", seq_len)
    layer.shapes()
    if layer.cache_lens_input is not None and form == "decomposed":
        raise OnnxError("decoding layers (a K/V cache) export in the fused form (opset-23 "
                        "Attention with past_key/past_value) or the gqa form (onnxruntime's "
                        "GroupQueryAttention, a cache length per row): pass form='fused' or "
                        "form='gqa' (--form fused, --form gqa)")
    if past_len is not None:
        positive_int("past_len", past_len)
        if form == "gqa":
            raise InputError("the gqa form's past is the whole cache buffer (kv_cache rows, "
                             "each row's length in seqlens_k): drop past_len")
    cross = layer.context_input is not None
    if len(layer.inputs) != 1 + cross:
        raise GraphError(f"export_onnx() exports graphs with one input [batch, seq, d_model] "
                         f"(and a cross-attention layer's context); {layer.name!r} has "
                         f"{len(layer.inputs)}")
    if cross:
        if form != "decomposed":
            raise OnnxError("cross-attention layers export in the decomposed form only: pass "
                            "form='decomposed'")
        if kv_seq_len is None and not dynamic_seq:
            raise InputError("a cross-attention layer needs the context's length: pass "
                             "kv_seq_len=T (or dynamic_seq=True)")
        if kv_seq_len is not None:
            positive_int("kv_seq_len", kv_seq_len)
    elif kv_seq_len is not None:
        raise InputError(f"kv_seq_len is the context's length of a cross-attention layer; "
                         f"{layer.name!r} has one input: drop it")
    if weights is None:
        raise InputError("export_onnx() needs weights: pass weights=layer.init_weights(seed) "
                         "(random) or trained weights, e.g. mhagen.weights_from_torch(module)")
    w = check_weights(layer, weights, dtype=np.float32)   # half layers: rounded first
    opset = MIN_OPSET[form] if opset is None else opset
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET[form]:
        hint = (" (the Attention operator is opset 23); or use form='decomposed'"
                if form == "fused" else "")
        raise OnnxError(f"opset={opset!r}: the {form} form needs opset >= {MIN_OPSET[form]}{hint}")
    if opset > onnx.defs.onnx_opset_version():
        raise OnnxError(f"opset={opset} is newer than this onnx package supports "
                        f"({onnx.defs.onnx_opset_version()}); upgrade onnx or pass a lower opset")

    b = _Builder(onnx, opset, layer, batch, seq_len, dynamic_batch, dynamic_seq, masks,
                 kv_seq_len)
    b.past = "past_seq" if past_len is None else past_len
    if form == "decomposed":
        out = _decomposed(b, layer, w)
    elif form == "gqa":
        out = build_gqa(b, layer, w, fused_view(layer))
    else:
        out = _fused(b, layer, w)
    model = b.model(out, form)

    path = Path(path)
    big = sum(t.ByteSize() for t in model.graph.initializer) >= EXTERNAL_DATA_THRESHOLD
    if external_data is None:
        external_data = big
    elif not external_data and big:
        raise OnnxError("the weights exceed the 2 GB protobuf limit; export with "
                        "external_data=True (or leave it unset)")
    data = path.with_name(path.name + ".data")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if data.exists():
            data.unlink()   # onnx appends to an existing data file
        if external_data:
            onnx.save_model(model, str(path), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data.name, size_threshold=0)
            onnx.checker.check_model(str(path), full_check=True)
        else:
            onnx.checker.check_model(model, full_check=True)
            onnx.save_model(model, str(path))
    except OSError as err:
        raise OnnxError(f"cannot write {path}: {err.strerror or err}") from None
    return path


# -- building ONNX graphs -----------------------------------------------------------------
class _Builder:
    """Collects nodes and initializers with unique, readable names."""

    def __init__(self, onnx, opset, layer, batch, seq_len, dynamic_batch, dynamic_seq, masks,
                 kv_seq_len=None):
        from onnx import numpy_helper
        self.onnx, self.h, self.nh, self.opset = onnx, onnx.helper, numpy_helper, opset
        self.layer = layer
        self.nodes, self.inits, self.used, self._consts, self._cache = [], [], set(), {}, {}
        self.batch = "batch" if dynamic_batch else batch
        self.seq = "seq" if dynamic_seq else seq_len
        self.masks = masks
        self.d_model = layer.inputs[0].attrs["shape"][2]
        self.x = self.fresh("x")
        context = layer.context_input       # cross-attention: keys' length kv_seq, not seq
        self.context = self.fresh(context.name) if context is not None else None
        self.kv_dim = context.attrs["shape"][2] if context is not None else None
        self.kv_seq = self.seq if context is None else ("kv_seq" if dynamic_seq else kv_seq_len)
        lengths = layer.lengths_input
        self.kv_lens = self.fresh(lengths.name) if lengths is not None else None  # int32 [B]
        self.used.add("y")
        # decoding: past / present K and V, (name, shape, ONNX element type)
        self.extra_inputs, self.extra_outputs = [], []
        self.domains = {}     # operator domains beside ONNX's own: {domain: version}
        # a half-precision layer: x, a context and y in its dtype, Cast to/from float32
        self.storage = None if layer.dtype == "float32" else self.elem_type(layer.dtype)

    # names, constants, ops
    def fresh(self, base):
        base = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(base)) or "t"
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name

    def init(self, base, array):
        name = self.fresh(base)
        self.inits.append(self.nh.from_array(np.array(array, copy=True, order="C"), name))
        return name

    def weight(self, base, array):
        """A weight initializer: float32, or a half-precision layer's dtype followed by a Cast
        to float32 (the file holds the rounded weights at their size; compute is float32,
        as in mhagen's kernels)."""
        if self.storage is None:
            return self.init(base, array)
        stored = self.init(base, np.asarray(array).astype(numpy_dtype(self.layer.dtype)))
        return self.op("Cast", [stored], f"{stored}_f32", to=self.onnx.TensorProto.FLOAT)

    def const(self, value, dtype):
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            if arr.size == 1:
                v = arr.reshape(-1)[0]
                txt = "ninf" if np.isneginf(v) else str(v).replace("-", "m").replace(".", "_")
                base = f"c_{arr.dtype.name}_{txt}" + ("" if arr.ndim == 0 else f"_{arr.ndim}d")
            else:
                base = "c_" + arr.dtype.name
            self._consts[key] = self.init(base, arr)
        return self._consts[key]

    def elem_type(self, dtype: str) -> int:
        """The ONNX element type of a storage dtype (mhagen/dtypes.py)."""
        return getattr(self.onnx.TensorProto, {"float32": "FLOAT", "float16": "FLOAT16",
                                               "bfloat16": "BFLOAT16"}[dtype])

    def op(self, op_type, inputs, base=None, **attrs):
        name = self.fresh(base or op_type)
        self.nodes.append(self.h.make_node(op_type, list(inputs), [name], name=name, **attrs))
        return name

    def i64(self, *values):
        return self.const(list(values), np.int64)

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # dims at run time (scalars, int64)
    def dim(self, axis):
        """Axis 0 batch, 1 seq, 2 the keys' length (kv_seq: the context's, else seq)."""
        static = (self.batch, self.seq, self.kv_seq)[axis]
        if isinstance(static, int):
            return self.const(static, np.int64)
        if axis == 2 and self.context is None:
            return self.dim(1)
        source = self.context if axis == 2 else self.x
        return self.cached(("dim", axis), lambda: self.op(
            "Gather", [self.cached(("shape", source), lambda: self.op(
                "Shape", [source], f"shape_{source}")),
                self.const(min(axis, 1), np.int64)], ("batch", "seq", "kv_seq")[axis] + "_len",
            axis=0))

    def _cast_inputs(self, names):
        """Every node reading one of these half-precision inputs reads its float32 Cast."""
        casts = {}
        for name in names:
            casts[name] = self.fresh(name + "_f32")
        for node in self.nodes:
            node.input[:] = [casts.get(i, i) for i in node.input]
        self.nodes[:0] = [self.h.make_node("Cast", [n], [c], name=c, to=self.onnx.TensorProto.FLOAT)
                          for n, c in casts.items()]

    def reduce_max_last(self, t, base):
        if self.opset >= 18:
            return self.op("ReduceMax", [t, self.i64(-1)], base, keepdims=1)
        return self.op("ReduceMax", [t], base, axes=[-1], keepdims=1)

    def model(self, out, form):
        h, onnx = self.h, self.onnx
        d_out = self.layer.shapes()[self.layer.output][-1]
        io = self.storage or onnx.TensorProto.FLOAT
        x_info = h.make_tensor_value_info(self.x, io, [self.batch, self.seq, self.d_model])
        y_info = h.make_tensor_value_info("y", io, [self.batch, self.seq, d_out])
        if self.storage is not None:
            self._cast_inputs([self.x] + ([self.context] if self.context else []))
            out = self.op("Cast", [out], "y_rounded", to=self.storage)
        if not any(out in node.output for node in self.nodes):   # the output is x itself
            self.nodes.append(h.make_node("Identity", [out], ["y"], name="y"))
        for node in self.nodes:   # the output tensor is called y ("y" is reserved)
            node.input[:] = ["y" if i == out else i for i in node.input]
            node.output[:] = ["y" if o == out else o for o in node.output]
        inputs, outputs = [x_info], [y_info]
        if self.context is not None:
            inputs.append(h.make_tensor_value_info(self.context, io,
                                                   [self.batch, self.kv_seq, self.kv_dim]))
        if self.kv_lens is not None:
            inputs.append(h.make_tensor_value_info(self.kv_lens, onnx.TensorProto.INT32,
                                                   [self.batch]))
        for name, shape, elem in self.extra_inputs:
            inputs.append(h.make_tensor_value_info(name, elem, shape))
        for name, shape, elem in self.extra_outputs:
            outputs.append(h.make_tensor_value_info(name, elem, shape))
        graph = h.make_graph(self.nodes, self.layer.name, inputs, outputs, self.inits,
                             doc_string=f"mhagen layer {self.layer!r}, {form} form")
        opsets = [h.make_opsetid("", self.opset)] + [h.make_opsetid(domain, version)
                                                     for domain, version in self.domains.items()]
        model = h.make_model(graph, opset_imports=opsets, producer_name="mhagen",
                             producer_version=mhagen_version,
                             ir_version=h.find_min_ir_version_for(opsets[:1]))
        h.set_model_props(model, {"mhagen.form": form, "mhagen.graph": self.layer.to_json()})
        return model

    # rotary embeddings -----------------------------------------------------------------
    def rope_tables(self, rotary_dim, base):
        """(cos, sin) float32 tensors [S, rotary_dim / 2] (see mhagen/ir/rope.py)."""
        def make():
            if isinstance(self.seq, int):
                cos, sin = rope.tables(self.seq, rotary_dim, base)
                return self.const(cos, np.float32), self.const(sin, np.float32)
            # dynamic seq: angles in float64 like mhagen's tables, then float32
            half = rotary_dim // 2
            inv_freq = float(base) ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
            pos = self.op("Range", [self.const(0.0, np.float64),
                                    self.op("Cast", [self.dim(1)], "rope_seq",
                                            to=self.onnx.TensorProto.DOUBLE),
                                    self.const(1.0, np.float64)], "rope_pos")
            angle = self.op("Mul", [self.op("Unsqueeze", [pos, self.i64(1)], "rope_pos_col"),
                                    self.const(inv_freq, np.float64)], f"rope_angle{rotary_dim}")
            f32 = self.onnx.TensorProto.FLOAT
            return tuple(self.op("Cast", [self.op(op, [angle], f"rope_{op.lower()}{rotary_dim}_f64")],
                                 f"rope_{op.lower()}{rotary_dim}", to=f32)
                         for op in ("Cos", "Sin"))
        return self.cached(("rope", rotary_dim, float(base)), make)

    def rotary(self, x, head_dim, rotary_dim, base, name, tables=None):
        """RoPE on x [.., head_dim]: half-split pairs, dims past rotary_dim unchanged; the
        (cos, sin) tables [S, rotary_dim / 2] of rope_tables, or `tables` that broadcast
        against x's leading axes (the gqa form's per-row positions)."""
        half = rotary_dim // 2
        cos, sin = tables if tables is not None else self.rope_tables(rotary_dim, base)

        def cols(lo, hi, tag):
            return self.op("Slice", [x, self.i64(lo), self.i64(hi), self.i64(-1)],
                           f"{name}_{tag}")
        a, b = cols(0, half, "a"), cols(half, rotary_dim, "b")
        parts = [self.op("Sub", [self.op("Mul", [a, cos], f"{name}_acos"),
                                 self.op("Mul", [b, sin], f"{name}_bsin")], f"{name}_lo"),
                 self.op("Add", [self.op("Mul", [b, cos], f"{name}_bcos"),
                                 self.op("Mul", [a, sin], f"{name}_asin")], f"{name}_hi")]
        if rotary_dim < head_dim:
            parts.append(cols(rotary_dim, head_dim, "pass"))
        return self.op("Concat", parts, name, axis=-1)

    # masks -----------------------------------------------------------------------------
    def mask_static(self, expr):
        """Whether the mask can be a constant: the dims it depends on are static."""
        static = isinstance(self.seq, int) and isinstance(self.kv_seq, int)   # grid [.., S, T]
        if "batch" in ex.variables(expr):
            static = static and isinstance(self.batch, int)
        if self.kv_lens is not None and "kv_len" in ex.variables(expr):
            static = False    # it reads the key lengths given per call
        if self.masks == "constant" and not static:
            raise OnnxError(f"masks='constant' needs static shapes, but mask {expr!r} depends on "
                            "a dynamic axis; use masks='computed' or 'auto'")
        return static and self.masks != "computed"

    def mask_grid(self, expr, heads):
        """numpy bool grid: [S, T], or [B?, H?, S, T] for heads=list (fused form)."""
        uses = ex.variables(expr)
        nb = self.batch if "batch" in uses else 1
        hs = heads if isinstance(heads, list) else [heads]
        hs = hs if "head" in uses else hs[:1]
        grid = np.stack([mask_grid(expr, nb, h, self.seq, self.kv_seq) for h in hs], axis=1)
        return grid   # [B?, H?, S, T]

    def index_var(self, name, head, rank):
        """An int64 tensor of an index variable, broadcastable to [.., S, T] of rank dims."""
        s, t = self.dim(1), self.dim(2)
        if name == "kv_len" and self.kv_lens is not None:   # [B, 1, 1]: one per batch row
            return self.cached(("kv_len", rank), lambda: self.op(
                "Reshape", [self.op("Cast", [self.kv_lens], "kv_lens_i64",
                                    to=self.onnx.TensorProto.INT64),
                            self.i64(-1, *[1] * (rank - 1))], "kv_len"))
        if name in ("q_len", "kv_len"):
            return s if name == "q_len" else t
        if name == "kv_idx":
            return self.cached("kv_idx", lambda: self.op(
                "Range", [self.const(0, np.int64), t, self.const(1, np.int64)], "kv_idx"))
        if name == "q_idx":   # self-attention: the keys' range serves the queries too
            def rows():
                if self.context is None:
                    return self.index_var("kv_idx", head, rank)
                return self.op("Range", [self.const(0, np.int64), s, self.const(1, np.int64)],
                               "q_range")
            return self.cached("q_idx", lambda: self.op("Unsqueeze", [rows(), self.i64(1)],
                                                        "q_idx"))
        if name == "batch":
            return self.cached(("batch_idx", rank), lambda: self.op(
                "Reshape", [self.op("Range", [self.const(0, np.int64), self.dim(0),
                                              self.const(1, np.int64)], "batch_range"),
                            self.i64(-1, *[1] * (rank - 1))], "batch_idx"))
        if name == "head":
            if head is not None:
                return self.const(head, np.int64)
            n_heads = self._n_heads
            return self.cached("head_idx", lambda: self.const(
                np.arange(n_heads, dtype=np.int64).reshape(n_heads, 1, 1), np.int64))
        raise OnnxError(f"expression variable {name!r} cannot be exported")

    def score_mod(self, expr, score, head, base, index=None):
        """The float tensor of a score modifier applied to `score` ([B, S, S], one head);
        index(name): the tensors of the index variables instead of index_var's (the gqa
        form's bias, at each batch row's own positions)."""
        onnx_types = {"float": self.onnx.TensorProto.FLOAT, "int": self.onnx.TensorProto.INT64}

        def as_kind(t, kind, want):
            return t if kind == want else self.op("Cast", [t], f"{base}_cast", to=onnx_types[want])

        def emit(e):   # -> (tensor, "bool" | "int" | "float")
            if isinstance(e, ex.Var):
                return (score, "float") if e.name == "score" else \
                    (index(e.name) if index else self.index_var(e.name, head, 3), "int")
            if isinstance(e, ex.Const):
                is_int = isinstance(e.value, int)
                return self.const(e.value, np.int64 if is_int else np.float32), \
                    ("int" if is_int else "float")
            if isinstance(e, ex.Table):
                idx, _ = emit(e.index)
                idx = self.op("Clip", [idx, self.const(0, np.int64),
                                       self.const(len(e.values) - 1, np.int64)], f"{base}_index")
                table = self.const(np.asarray(e.values, np.float32), np.float32)
                return self.op("Gather", [table, idx], f"{base}_table", axis=0), "float"
            args = [emit(a) for a in ex.children(e)]
            return _emit_score_op(self, e, args, as_kind, base)
        t, kind = emit(expr)
        return as_kind(t, kind, "float")

    def mask_computed(self, expr, head, rank):
        """Bool tensor of `expr` computed from Range ops; shape broadcastable to rank dims,
        expanded to at least [.., S, T]. head: an int, or None for all heads (fused)."""
        s, kv_s = self.dim(1), self.dim(2)

        def var(name):
            return self.index_var(name, head, rank)

        def emit(e):   # -> (tensor name, is_bool)
            if isinstance(e, ex.Var):
                return var(e.name), False
            if isinstance(e, ex.Const):
                return self.const(e.value, np.int64), False
            (a, ab), (c, cb) = emit(e.lhs), emit(e.rhs)
            if e.op in ("&", "|"):
                return self.op("And" if e.op == "&" else "Or", [a, c], "mask_and"
                               if e.op == "&" else "mask_or"), True
            if ab != cb or (ab and e.op not in ("==", "!=")):   # arithmetic on bools: as ints
                a = self.op("Cast", [a], "mask_int", to=self.onnx.TensorProto.INT64) if ab else a
                c = self.op("Cast", [c], "mask_int", to=self.onnx.TensorProto.INT64) if cb else c
            if e.op in _ARITH:
                return self.op(_ARITH[e.op], [a, c], "mask_" + _ARITH[e.op].lower()), False
            if e.op == "!=":
                return self.op("Not", [self.op("Equal", [a, c], "mask_eq")], "mask_ne"), True
            return self.op(_CMP[e.op], [a, c], "mask_" + _CMP[e.op].lower()), True

        key = ("computed", expr, head if "head" in ex.variables(expr) else None, rank)

        def make():
            t, _ = emit(expr)
            shape = self.cached(("mask_shape", rank), lambda: self.op(
                "Concat", [self.i64(*[1] * (rank - 2)), self.op("Unsqueeze", [s, self.i64(0)],
                                                                "seq_1d"),
                           self.op("Unsqueeze", [kv_s, self.i64(0)], "kv_seq_1d")],
                "mask_shape", axis=0))
            return self.op("Expand", [t, shape], "mask")
        return self.cached(key, make)


_SCORE_FUNCS = {"tanh": "Tanh", "exp": "Exp", "minimum": "Min", "maximum": "Max"}


def _emit_score_op(b, e, args, as_kind, base):
    """One operator of a score modifier; numbers mix as float, comparisons give bools."""
    if isinstance(e, ex.Call) and e.fn == "where":
        (c, ck), (x, xk), (y, yk) = args
        return b.op("Where", [c, as_kind(x, xk, "float"), as_kind(y, yk, "float")],
                    f"{base}_where"), "float"
    if isinstance(e, ex.Call):
        return b.op(_SCORE_FUNCS[e.fn], [as_kind(t, k, "float") for t, k in args],
                    f"{base}_{e.fn}"), "float"
    (x, xk), (y, yk) = args
    if e.op in ("&", "|"):
        return b.op("And" if e.op == "&" else "Or", [x, y], f"{base}_logic"), "bool"
    kind = "int" if (xk, yk) == ("int", "int") and e.op != "/" else "float"
    x, y = as_kind(x, xk, kind), as_kind(y, yk, kind)
    if e.op == "/":
        return b.op("Div", [x, y], f"{base}_div"), "float"
    if e.op in _ARITH:
        return b.op(_ARITH[e.op], [x, y], f"{base}_{_ARITH[e.op].lower()}"), kind
    if e.op == "!=":
        return b.op("Not", [b.op("Equal", [x, y], f"{base}_eq")], f"{base}_ne"), "bool"
    return b.op(_CMP[e.op], [x, y], f"{base}_{_CMP[e.op].lower()}"), "bool"


# -- decomposed form ----------------------------------------------------------------------
def _decomposed(b: _Builder, layer: Graph, w: dict) -> str:
    vals, keep = {}, {}   # node -> tensor; node -> (keep mask tensor, its constant grid or None)
    for n in layer.nodes:
        a = [vals[i] for i in n.inputs]
        k = n.kind
        if k == "input":
            vals[n.name] = b.context if n.name == getattr(layer.context_input, "name", None) \
                else b.x
        elif k == "lengths":   # read by the masks' kv_len (index_var)
            vals[n.name] = b.kv_lens
        elif k == "head_projection":
            head = n.attrs["head"]
            wt = b.weight(f"{n.attrs['weight']}.{head}", w[n.attrs["weight"]][head])
            y = b.op("MatMul", [a[0], wt], n.name + "_matmul" if n.attrs.get("bias") else n.name)
            if n.attrs.get("bias"):
                bt = b.weight(f"{n.attrs['bias']}.{head}", w[n.attrs["bias"]][head])
                y = b.op("Add", [y, bt], n.name)
            vals[n.name] = y
        elif k == "output_projection":
            wt = b.weight(n.attrs["weight"], w[n.attrs["weight"]])
            y = b.op("MatMul", [a[0], wt], n.name + "_matmul" if n.attrs.get("bias") else n.name)
            if n.attrs.get("bias"):
                y = b.op("Add", [y, b.weight(n.attrs["bias"], w[n.attrs["bias"]])], n.name)
            vals[n.name] = y
        elif k == "rotary":
            head_dim = layer.shapes()[n.name][-1]
            vals[n.name] = b.rotary(a[0], head_dim, n.attrs["rotary_dim"], n.attrs["base"],
                                    n.name)
        elif k == "scores":
            kt = b.op("Transpose", [a[1]], n.name + "_kT", perm=[0, 2, 1])
            vals[n.name] = b.op("MatMul", [a[0], kt], n.name)
        elif k == "scale":
            vals[n.name] = b.op("Mul", [a[0], b.const(n.attrs["factor"], np.float32)], n.name)
            if n.inputs[0] in keep:
                keep[n.name] = keep[n.inputs[0]]
        elif k == "score_mod":
            vals[n.name] = b.score_mod(n.attrs["expr"], a[0], n.attrs["head"], n.name)
            if n.inputs[0] in keep:
                keep[n.name] = keep[n.inputs[0]]
        elif k == "mask":
            m = _keep_mask(b, n.attrs["mask"], n.attrs["head"])
            prev = keep.get(n.inputs[0])
            if prev is not None:   # masks in a row: all apply
                m = (b.op("And", [prev[0], m[0]], n.name + "_keep"),
                     None if prev[1] is None or m[1] is None else prev[1] & m[1])
            keep[n.name] = m
            vals[n.name] = b.op("Where", [m[0], a[0], b.const(-np.inf, np.float32)], n.name)
        elif k == "softmax":
            dead = _dead_rows(b, *keep[n.inputs[0]]) if n.inputs[0] in keep else None
            p = b.op("Softmax", [a[0]], n.name if dead is None else n.name + "_raw", axis=-1)
            if dead is not None:
                p = b.op("Where", [dead, b.const(0.0, np.float32), p], n.name)
            vals[n.name] = p
        elif k == "weighted_sum":
            vals[n.name] = b.op("MatMul", [a[0], a[1]], n.name)
        elif k == "concat_heads":
            vals[n.name] = (b.op("Concat", a, n.name, axis=-1) if len(a) > 1
                            else b.op("Identity", a, n.name))
        elif k == "qkv_projection":
            cols = []
            for i, seg in enumerate(n.attrs["segments"]):
                head, wname = seg["head"], seg["weight"]
                wt = b.weight(f"{wname}.{head}", w[wname][head])
                y = b.op("MatMul", [a[0], wt], f"{n.name}_{wname}{head}")
                if seg.get("bias"):
                    y = b.op("Add", [y, b.weight(f"{seg['bias']}.{head}", w[seg["bias"]][head])],
                             f"{n.name}_{wname}{head}_bias")
                cols.append(y)
            vals[n.name] = b.op("Concat", cols, n.name, axis=-1)
        elif k == "attention":   # cross: K/V columns from the second input (kv)
            vals[n.name] = _decomposed_attention(b, n, a[0], a[1] if n.attrs.get("cross")
                                                 else a[0])
        else:  # pragma: no cover - verify() knows every kind
            raise OnnxError(f"node {n.name!r}: kind {k!r} has no ONNX export")
    return vals[layer.output]


def _keep_mask(b, expr, head):
    """(bool tensor of the visible keys, broadcastable to [B, S, S]; its numpy grid when it
    is a constant, else None)."""
    if b.mask_static(expr):
        grid = b.mask_grid(expr, head)[:, 0]          # [B?, S, S]
        if "batch" not in ex.variables(expr):
            grid = grid[0]
        return b.const(grid, np.bool_), grid
    return b.mask_computed(expr, head, rank=3), None


def _dead_rows(b, keep, grid):
    """Bool tensor [.., S, 1]: rows with no visible key (None if a constant mask has none)."""
    if grid is not None:
        dead = ~grid.any(axis=-1, keepdims=True)
        return b.const(dead, np.bool_) if dead.any() else None
    return b.cached(("dead", keep), lambda: b.op("Equal", [b.reduce_max_last(
        b.op("Cast", [keep], keep + "_int", to=b.onnx.TensorProto.INT32), keep + "_any"),
        b.const(0, np.int32)], keep + "_dead"))


def _decomposed_attention(b, n, qkv, kv):
    d = n.attrs["head_dim"]
    mask = n.attrs.get("mask")
    outs = []
    for h, (qo, ko, vo) in enumerate(zip(n.attrs["q_offsets"], n.attrs["k_offsets"],
                                         n.attrs["v_offsets"])):
        def cols(src, off, role):
            return b.cached(("slice", src, off), lambda: b.op(
                "Slice", [src, b.i64(off), b.i64(off + d), b.i64(-1)], f"{n.name}_{role}{h}"))
        q, k, v = cols(qkv, qo, "q"), cols(kv, ko, "k"), cols(kv, vo, "v")
        r = n.attrs.get("rotary")
        if r is not None:   # each K head once, however many query heads read it
            q, k = (b.cached(("rotary", qkv, off), lambda t=t, off=off, role=role: b.rotary(
                t, d, r["rotary_dim"], r["base"], f"{n.name}_r{role}{off}"))
                for t, off, role in ((q, qo, "q"), (k, ko, "k")))
        s = b.op("MatMul", [q, b.op("Transpose", [k], f"{n.name}_kT{h}", perm=[0, 2, 1])],
                 f"{n.name}_s{h}")
        s = b.op("Mul", [s, b.const(n.attrs["scale"], np.float32)], f"{n.name}_scaled{h}")
        if n.attrs.get("score_mod") is not None:
            s = b.score_mod(n.attrs["score_mod"], s, h, f"{n.name}_modified{h}")
        dead = None
        if mask is not None:
            keep, grid = _keep_mask(b, mask, h)
            dead = _dead_rows(b, keep, grid)
            s = b.op("Where", [keep, s, b.const(-np.inf, np.float32)], f"{n.name}_masked{h}")
        p = b.op("Softmax", [s], f"{n.name}_p{h}", axis=-1)
        if dead is not None:
            p = b.op("Where", [dead, b.const(0.0, np.float32), p], f"{n.name}_p{h}_rows")
        outs.append(b.op("MatMul", [p, v], f"{n.name}_o{h}"))
    return b.op("Concat", outs, n.name, axis=-1) if len(outs) > 1 else outs[0]


# -- fused form ---------------------------------------------------------------------------
def fused_view(layer: Graph) -> Graph:
    """The layer as input -> qkv_projection -> attention -> output_projection, or OnnxError."""
    kinds = [n.kind for n in layer.nodes]
    if "lengths" in kinds:
        raise OnnxError(f"graph {layer.name!r} takes key lengths per call, which the fused "
                        "form does not carry yet; export it with form='decomposed'")
    if kinds in (["input", "qkv_projection", "attention", "output_projection"],
                 ["input", "qkv_projection", "cache_lens", "attention", "output_projection"]):
        return layer
    if "attention" in kinds or "qkv_projection" in kinds:
        raise OnnxError(f"graph {layer.name!r} has fused nodes but not in the shape input -> "
                        "qkv_projection -> attention -> output_projection; export it with "
                        "form='decomposed' (--form decomposed)")
    result = fuse_attention(layer)
    if not result.fused:
        raise OnnxError(f"graph {layer.name!r} cannot use the fused ONNX form (the Attention "
                        f"operator needs every head to have the same structure): "
                        f"{result.reason.removeprefix('not fused: ')}; export it with "
                        "form='decomposed' (--form decomposed)")
    return result.graph


def _fused(b: _Builder, layer: Graph, w: dict) -> str:
    f = fused_view(layer)
    by_kind = {n.kind: n for n in f.nodes}
    qkv, att, out = (by_kind[k] for k in ("qkv_projection", "attention", "output_projection"))
    if att.attrs.get("score_mod") is not None:
        raise OnnxError(f"graph {layer.name!r} has a score modifier, which the Attention "
                        "operator cannot carry; export it with form='decomposed'")
    if att.attrs.get("rotary") is not None:
        raise OnnxError(f"graph {layer.name!r} has rotary position embeddings, which the "
                        "Attention operator cannot carry; export it with form='decomposed'")
    if not att.attrs["scale"] > 0:    # the operator reads scale 0 as "the default"
        raise OnnxError(f"graph {layer.name!r} scales its scores by {att.attrs['scale']:.6g}; "
                        "the Attention operator takes a positive scale only: export it with "
                        "form='decomposed'")
    d = att.attrs["head_dim"]
    segs = {i * d: s for i, s in enumerate(qkv.attrs["segments"])}
    widths = {int(s["width"]) for s in segs.values()}
    if widths != {d} or len(segs) * d != sum(int(s["width"]) for s in segs.values()):
        raise OnnxError(f"graph {layer.name!r}: qkv segments are not all {d} wide; export it "
                        "with form='decomposed'")
    q_off, k_off, v_off = (att.attrs[a] for a in ("q_offsets", "k_offsets", "v_offsets"))
    n_heads = len(q_off)
    pairs = list(zip(k_off, v_off))
    kv_heads = fewest_kv_heads(n_heads, lambda h, first: pairs[h] == pairs[first])
    kv_first = first_query_heads(n_heads, kv_heads)
    has_bias = any(s.get("bias") for s in segs.values())

    def packed(offsets, role):
        ws = [w[segs[o]["weight"]][segs[o]["head"]] for o in offsets]
        y = b.op("MatMul", [b.x, b.weight(f"w_{role}", np.concatenate(ws, axis=1))],
                 f"{role}_matmul" if has_bias else role)
        if has_bias:
            bs = [w[segs[o]["bias"]][segs[o]["head"]] if segs[o].get("bias")
                  else np.zeros(d, np.float32) for o in offsets]
            y = b.op("Add", [y, b.weight(f"b_{role}", np.concatenate(bs))], role)
        return y

    q = packed(q_off, "q")
    k = packed([k_off[h] for h in kv_first], "k")
    v = packed([v_off[h] for h in kv_first], "v")
    inputs = [q, k, v]
    attrs = {"q_num_heads": n_heads, "kv_num_heads": kv_heads,
             "scale": float(att.attrs["scale"])}
    mask = att.attrs.get("mask")
    decoding = att.attrs.get("cache") is not None
    if decoding:   # the cache's own rule (kv_idx < kv_len) is the past + new keys: implied
        known = {ex.kv_idx < ex.kv_len: None, ex.causal() & (ex.kv_idx < ex.kv_len): ex.causal()}
        if mask not in known:
            raise OnnxError(f"decoding layer {layer.name!r} has mask {mask!r}; its ONNX form "
                            "(Attention with past_key/past_value) carries causal or no mask "
                            "only")
        mask = known[mask]
    if mask is not None and mask == ex.causal():
        attrs["is_causal"] = 1
    elif mask is not None:
        b._n_heads = n_heads
        if b.mask_static(mask):
            grid = b.mask_grid(mask, list(range(n_heads)))   # [B?, H?, S, S]
            uses = ex.variables(mask)
            if not ({"batch", "head"} & uses):
                grid = grid[0, 0]
            inputs.append(b.const(grid, np.bool_))
        else:
            inputs.append(b.mask_computed(mask, None, rank=4))
    if decoding:
        y = _attention_with_past(b, inputs, attrs, kv_heads, d,
                                 att.attrs["cache"].get("dtype", "float32"))
    else:
        y = b.op("Attention", inputs, "attention", **attrs)
    wt = b.weight(out.attrs["weight"], w[out.attrs["weight"]])
    y = b.op("MatMul", [y, wt], "out_matmul" if out.attrs.get("bias") else "out")
    if out.attrs.get("bias"):
        y = b.op("Add", [y, b.weight(out.attrs["bias"], w[out.attrs["bias"]])], "out")
    return y


def _attention_with_past(b: _Builder, inputs, attrs, kv_heads, head_dim,
                         cache_dtype="float32") -> str:
    """Attention(q, k, v, no mask, past_key, past_value) -> (y, present_key, present_value),
    the past and present as graph inputs and outputs. A half-precision cache (cache_dtype):
    past and present in that dtype, Cast to float32 around the op, and the new K and V
    rounded to it before the op reads them (as mhagen's kernels read them from the cache)."""
    tp = b.onnx.TensorProto
    elem = b.elem_type(cache_dtype)
    past = [b.batch, kv_heads, b.past, head_dim]
    total = (b.past + b.seq if isinstance(b.past, int) and isinstance(b.seq, int)
             else f"{b.past}_plus_{b.seq}")
    names = [b.fresh(n) for n in ("past_key", "past_value", "present_key", "present_value")]
    b.extra_inputs += [(names[0], past, elem), (names[1], past, elem)]
    b.extra_outputs += [(names[2], past[:2] + [total, head_dim], elem),
                        (names[3], past[:2] + [total, head_dim], elem)]
    ins, outs = inputs[:3] + ["", names[0], names[1]], [names[2], names[3]]
    if cache_dtype != "float32":
        for i in (1, 2):   # the new K, V: rounded as the cache stores them
            ins[i] = b.op("Cast", [b.op("Cast", [ins[i]], f"{ins[i]}_{cache_dtype}", to=elem)],
                          f"{ins[i]}_rounded", to=tp.FLOAT)
        for i in (4, 5):
            ins[i] = b.op("Cast", [ins[i]], f"{ins[i]}_f32", to=tp.FLOAT)
        outs = [b.fresh(n + "_f32") for n in outs]
    y = b.fresh("attention")
    b.nodes.append(b.h.make_node("Attention", ins, [y] + outs, name=y, **attrs))
    if cache_dtype != "float32":
        for f32, name in zip(outs, names[2:]):
            b.nodes.append(b.h.make_node("Cast", [f32], [name], name=name, to=elem))
    return y
