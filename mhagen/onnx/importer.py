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
    (heads in one Softmax or one Softmax per head; K/V heads broadcast or repeated; the
    scores and probabilities may be reshaped between ``[batch*heads, q, k]`` and
    ``[batch, heads, q, k]`` on the way, as BLOOM's export does).
Around each, the projections: MatMul/Gemm by a constant weight (+ a constant bias), reached
through reshapes, transposes, slices/gathers of packed QKV, and scaling by constants; after
it, the output projection. A ``[batch, seq, D]`` tensor before the projections and one after
the output projection bound the layer (``found.input``, ``found.output``).

The stages, one module each:
  match.py          find the cores and the projection paths (graph structure only);
  probe.py          run the model on probe inputs (onnxruntime, or onnx's reference evaluator
                    when onnxruntime is not installed);
  spec.py           per core, from probe values: heads, scale, masks;
  recover.py        the weights: read exactly from the initializers (initializers.py), or
                    fitted by least squares when the layout defeats the reader (fit.py);
  build_graph.py    the mhagen graph and weights.
``found.weight_source`` says which recovery was used: ``"initializers"`` (weights bitwise
equal to the model's) or ``"fit"`` (with the reason in ``found.notes``). Scalar factors
applied to Q and K (PyTorch scales both by sqrt(scale)) go into the layer's scale; a scale
other than 1/sqrt(head_dim) shared by every head becomes ``mha(scale=...)`` (T5's 1.0,
Gemma 2's query_pre_attn_scalar ** -0.5). Last,
the imported layer's reference is compared with the ONNX model on a fresh input (at another
sequence length when that axis is dynamic; never one the fit saw); a mismatch is an error.

Additive biases: a linear distance bias per head (ALiBi, BLOOM's form) becomes
``mhagen.alibi`` or a slope table; a bias that depends on ``kv_idx - q_idx`` alone (a learned
relative position bias, as T5's) becomes a table per head and distance, read up to the probe
length (``seq_len=``): farther distances take the last value, exact when the probe is longer
than the model's farthest distinct distance (T5: ``max_distance``); a softcap (``Tanh``
between two constant factors) becomes ``mhagen.softcap``.

Rotary embeddings on Q and K (Hugging Face's ``x cos + rotate_half(x) sin``, or mhagen's
exported Slices/Sub/Add/Concat) become ``mhagen.rotary(base, rotary_dim)``: the angles are
measured on probe values (spec.read_rotary), the weights read through them (they rotate
within a head, so the projection's columns are unchanged).

Limits (each an ``OnnxError`` naming the node and the reason): cross-attention, KV caches
(``past_key``...), padding masks computed from model inputs, other additive biases, scaled
rotary frequencies (``rope_scaling``), heads of different widths, and
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

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mhagen.checks import positive_int
from mhagen.errors import GraphError
from mhagen.ir.graph import Graph
from mhagen.onnx._common import OnnxError, need_onnx
from mhagen.onnx.build_graph import layer_graph, layer_weights
from mhagen.onnx.fit import VARIED_INPUTS_HINT, bsd, unseen_rows
from mhagen.onnx.match import ModelIndex, core_seq_len, find_blocks, find_cores, trace_names
from mhagen.onnx.probe import Prober
from mhagen.onnx.recover import recover_weights
from mhagen.onnx.spec import kv_heads_of, read_core

WEIGHT_SOURCES = {"initializers": "weights read exactly from the initializers",
                  "fit": "weights fitted by least squares on probe runs"}


@dataclass
class ImportedAttention:
    """One attention layer found in an ONNX model.

    ``graph`` and ``weights`` are ready for ``mhagen.build`` (and unpack: ``for graph,
    weights in import_onnx(path)``). ``input``/``output`` name the ONNX tensors the layer maps
    between; ``layout`` is ``"BSD"`` or ``"SBD"`` (seq-first, as PyTorch's default
    ``batch_first=False``: transpose to [batch, seq, D] for mhagen). ``source`` is the ONNX
    form, ``nodes`` the ONNX nodes of the layer, ``notes`` anything worth knowing;
    ``weight_source`` is ``"initializers"`` (read exactly) or ``"fit"`` (least squares).
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
    weight_source: str = "initializers"

    def __iter__(self):
        yield self.graph
        yield self.weights

    def __str__(self):
        lines = [f"{self.source}: {self.input!r} -> {self.output!r} ({self.layout}, "
                 f"{len(self.nodes)} ONNX nodes) as {self.graph!r}; "
                 f"{WEIGHT_SOURCES[self.weight_source]}; max error vs the ONNX "
                 f"model {self.max_error:.1e}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def import_onnx(model, *, seq_len: int = 32, batch: int = 1, sample_inputs=None,
                seed: int = 0, name: str | None = None) -> list[ImportedAttention]:
    """Find the attention layers of an ONNX model; returns one ImportedAttention each.

    Args:
        model: a path to an ``.onnx`` file (external data is read) or an ``onnx.ModelProto``.
        seq_len, batch: the sequence length and batch size the model is probed at when
            those axes are dynamic (a model exported with a length baked into a Reshape only
            runs at that length: pass it).
        sample_inputs: arrays for non-float model inputs (token ids...): a dict {input name:
            array}, or a list of such dicts (the last one is kept for the self-check when
            the weights have to be fitted); float inputs are random.
        seed: seed of the random probe inputs.
        name: name of the graphs (default: the ONNX graph's name, numbered if several).

    Weights in initializers are read exactly and need no onnxruntime (models are then probed
    with onnx's reference evaluator); layouts the reader cannot follow, and the
    ``com.microsoft`` operators, need onnxruntime. Raises ``OnnxError`` naming the ONNX
    node and the reason when there is no attention or it cannot be imported.
    """
    proto = _load(model)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise OnnxError(f"seq_len={seq_len!r} must be an integer >= 2")
    positive_int("batch", batch, error=OnnxError)
    m = ModelIndex(proto)
    cores = _find_cores(m, proto)
    names = [t for c in cores for t in c.probe_names() + trace_names(m, c)]
    prober = Prober(m, names, sample_inputs)
    rng = np.random.default_rng(seed)
    shapes, first, swap, blocks = _first_probe(m, cores, prober, rng, batch, seq_len)
    base = name or proto.graph.name or "imported"
    return [_import_block(m, blk, prober, shapes, first, rng,
                          f"{base}{i}" if len(blocks) > 1 else base, (batch, seq_len, swap))
            for i, blk in enumerate(blocks)]


def _load(model):
    """The ModelProto of a path or a ModelProto."""
    onnx = need_onnx()
    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (str, Path)):
        raise OnnxError(f"import_onnx() takes a path or an onnx.ModelProto, got "
                        f"{type(model).__name__}")
    try:
        return onnx.load(str(model))
    except FileNotFoundError:
        raise OnnxError(f"no ONNX model at {model}") from None
    except Exception as err:  # protobuf decode errors have several types
        raise OnnxError(f"{model} is not a readable ONNX model: {err}") from None


def _find_cores(m, proto):
    cores, skipped = find_cores(m)
    if not cores:
        why = "; ".join(skipped[:3]) if skipped else "it has no Softmax"
        raise OnnxError(f"no attention found in ONNX model {proto.graph.name!r} "
                        f"({len(m.nodes)} nodes): no Attention or com.microsoft."
                        f"MultiHeadAttention node, and no Softmax between a Q @ K^T MatMul and "
                        f"a P @ V MatMul ({why})")
    return cores


def _first_probe(m, cores, prober, rng, batch, seq_len):
    """(input shapes, probe values, seq-first swap, blocks) of the first probe run; a
    seq-first model with its length baked in is probed again with seq on axis 0."""
    shapes = prober.shapes(batch, seq_len)
    swapped = prober.shapes(batch, seq_len, swap=True)
    try:
        first, swap = prober.run(shapes, rng), False
    except OnnxError as err:
        if swapped == shapes:
            raise
        try:
            first, swap = prober.run(swapped, rng), True
        except OnnxError:
            raise err from None
    blocks = find_blocks(m, cores, first)
    if not swap and any(b.layout == "SBD" for b in blocks) and any(
            core_seq_len(c, first) < 2 for c in cores):
        swap, first = True, prober.run(swapped, rng)
        blocks = find_blocks(m, cores, first)
    return (swapped if swap else shapes), first, swap, blocks


def _import_block(m, blk, prober, shapes, first, rng, gname, probe):
    notes = []
    if blk.layout == "SBD":
        notes.append(f"{blk.x!r} is [seq, batch, D] (seq-first); mhagen takes [batch, seq, D]")
    label = blk.cores[0].label
    batch, d_model = bsd(first[blk.x], blk.layout).shape[0], first[blk.x].shape[-1]
    if not np.all(np.isfinite(first[blk.x])):   # (NaN weights before it: a LayerNorm's)
        raise OnnxError(f"{label}: the layer's input {blk.x!r} holds NaN or inf "
                        "when the model runs on random probe inputs; a layer cannot be read "
                        "from it: check the weights that compute it")
    specs = [read_core(c, first, batch, notes) for c in blk.cores]
    rec = recover_weights(m, blk, specs, prober, shapes, first, rng, batch)
    if rec.source == "fit":
        notes.append(f"weights fitted by least squares: they could not be read from the "
                     f"initializers ({rec.detail})")
    kv_heads = kv_heads_of(specs)
    bias = any(p.has_bias for c in blk.cores for p in c.paths.values()) or any(
        c.qkv_bias or c.out.has_bias for c in blk.cores)
    weights = layer_weights(rec, kv_heads, bias)
    _check_finite(label, weights, rec.source)
    try:
        graph = layer_graph(gname, d_model, weights["w_o"].shape[1], specs, kv_heads, bias)
    except GraphError as err:   # a value read from the model mhagen cannot take (scale inf)
        raise OnnxError(f"{_block_label(blk)}: what the model computes is not a valid mhagen "
                        f"layer: {err}") from None
    except OnnxError as err:    # what the cores hold together (widths, softcaps, rotary)
        raise OnnxError(f"{_block_label(blk)}: {err}") from None
    try:
        err = _self_check(blk, graph, weights, prober, shapes, rng, probe, rec, notes)
    except OnnxError as e:
        span = max((len(s.distances[0]) // 2 for s in specs if s.distances), default=None)
        if span is None:
            raise
        raise OnnxError(f"{e}; its learned relative position bias was read per distance up "
                        f"to {span} (the probe length less one): import with a seq_len longer than "
                        "the model's farthest distinct distance (T5: max_distance 128, so "
                        "seq_len=160)") from None
    return ImportedAttention(graph, weights, blk.cores[0].source, blk.x, blk.y, blk.layout,
                             tuple(_block_nodes(m, blk.x, blk.y)), tuple(dict.fromkeys(notes)),
                             err, rec.source)


def _block_label(blk):
    """The ONNX node(s) at the centre of a layer: its first core, and how many more."""
    more = len(blk.cores) - 1
    return blk.cores[0].label + (f" (and the layer's {more} other attention "
                                 f"{'core' if more == 1 else 'cores'})" if more else "")


def _check_finite(label, weights, source):
    """OnnxError naming the weight and head when one read from the model is NaN or inf."""
    for key, w in weights.items():
        bad = ~np.isfinite(w)
        if bad.any():
            per_head = key in ("w_q", "w_k", "w_v", "b_q", "b_k", "b_v")   # [heads, ...]
            where = f" of head {int(np.argwhere(bad)[0][0])}" if per_head else ""
            how = "in its initializers" if source == "initializers" else "as fitted"
            raise OnnxError(f"{label}: the model's {key}{where} holds NaN or inf ({how}); "
                            "mhagen layers need finite weights: fix the model's weights")


def _self_check(blk, graph, weights, prober, shapes, rng, probe, rec, notes):
    """Max error of the imported layer against the ONNX model on a fresh input (another
    shape when the model allows); OnnxError when it does not reproduce the model."""
    batch, seq_len, swap = probe
    try:
        vals = prober.run(prober.shapes(batch + 1, seq_len + 7, swap=swap), rng, check=True)
    except OnnxError:
        vals = prober.run(shapes, rng, check=True)
    xv, yv = bsd(vals[blk.x], blk.layout), bsd(vals[blk.y], blk.layout)
    if rec.fit_rows is not None and not unseen_rows(xv, rec.fit_rows):
        raise OnnxError(f"{blk.cores[0].label}: the self-check input repeats inputs the fit "
                        f"saw, so it cannot check the fitted weights; {VARIED_INPUTS_HINT}")
    ref = graph.reference(xv.astype(np.float32), weights)
    rows = np.all(np.isfinite(yv), axis=-1)
    if not rows.any():
        raise OnnxError(f"{blk.cores[0].label}: every row of the ONNX output {blk.y!r} is NaN "
                        "or inf on the check input, so nothing shows that the import "
                        "reproduces it; check the model")
    err = float(np.max(np.abs(ref[rows] - yv[rows]))) if rows.any() else 0.0
    tol = 1e-4 + 2e-4 * float(np.max(np.abs(yv[rows]))) if rows.any() else 0.0
    if not rows.all():
        notes.append(f"{int((~rows).sum())} output rows are NaN in the ONNX model (fully masked "
                     "queries); mhagen gives finite values there")
    if err > tol:
        raise OnnxError(f"{blk.cores[0].label}: the imported layer does not reproduce the ONNX "
                        f"output {blk.y!r} (max error {err:.3g} at shape {xv.shape}); the "
                        "layer holds something mhagen does not model (a mask that depends on "
                        "the sequence length beyond the probe, a residual, ...)")
    return err


def _block_nodes(m, x, y):
    """Names of the ONNX nodes between x and y (shape computations included), model order."""
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
