"""ONNX import, weight recovery: weights in initializers are read exactly (bitwise) and need
no onnxruntime; the least-squares fit is only the fallback, says so, refuses rank-deficient
probes and checks itself on inputs it did not fit on.
"""
import io
import math
import sys
import warnings

import numpy as np
import pytest

import mhagen
from mhagen.onnx import OnnxError, export_onnx, import_onnx
from mhagen.tolerances import assert_close, tolerance

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

B, S = 2, 7


def rand_x(d_model, batch=B, seq=S, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, seq, d_model)).astype(np.float32)


def run_reference_evaluator(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)[0]


@pytest.fixture
def no_onnxruntime(monkeypatch):
    """`import onnxruntime` raises ImportError for the test's duration."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)


def assert_same_weights(found, w):
    assert set(found.weights) == set(w)
    for k in w:
        assert found.weights[k].dtype == np.float32
        assert np.array_equal(found.weights[k], w[k]), k


@pytest.mark.parametrize("layer", [
    mhagen.mha(32, 4), mhagen.mha(32, 4, kv_heads=2, causal=True),
    mhagen.mha(32, 4, bias=False, mask=mhagen.sliding_window(3)),
    mhagen.mha(32, 4, head_dim=12, kv_heads=1)],
    ids=["plain", "gqa-causal", "no-bias-window", "mqa-head_dim12"])
@pytest.mark.parametrize("form", ["decomposed", "fused"])
def test_mhagen_exports_import_exactly_without_onnxruntime(form, layer, tmp_path,
                                                           no_onnxruntime):
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, dynamic_batch=True,
                       dynamic_seq=True)
    (found,) = import_onnx(path, seq_len=9)
    assert found.weight_source == "initializers"
    assert "read exactly from the initializers" in str(found)
    assert_same_weights(found, w)
    assert all(found.graph.options[k] == layer.options[k]   # the window reads as causal &
               for k in ("num_heads", "head_dim", "kv_heads", "bias"))  # a band: same mask
    x = rand_x(32, 3, 11)
    assert_close(found.graph.reference(x, found.weights), layer.reference(x, w))
    with pytest.raises(ImportError):
        import onnxruntime  # noqa: F401


def torch_mha_model(batch_first, causal):
    """(torch module, ONNX model of it as torch.onnx.export writes nn.MultiheadAttention)."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    with torch.no_grad():     # torch initialises biases to zero; make them count
        m.in_proj_bias.uniform_(-0.5, 0.5)
        m.out_proj.bias.uniform_(-0.5, 0.5)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            n = x.shape[1] if batch_first else x.shape[0]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n) if causal else None
            return self.m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)[0]

    x = torch.zeros((B, S, 32) if batch_first else (S, B, 32))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrapped(), (x,), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    return m, onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("batch_first, causal", [(True, False), (False, True)],
                         ids=["batch_first", "seq_first-causal"])
def test_torch_multihead_attention_imports_exactly_without_onnxruntime(
        batch_first, causal, monkeypatch):
    module, model = torch_mha_model(batch_first, causal)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    (found,) = import_onnx(model)
    assert found.weight_source == "initializers" and found.layout == (
        "BSD" if batch_first else "SBD")
    assert_same_weights(found, mhagen.weights_from_torch(module))
    x = rand_x(32)
    y = run_reference_evaluator(model, {"x": x if batch_first else x.transpose(1, 0, 2)})
    assert_close(found.graph.reference(x, found.weights),
                 y if batch_first else y.transpose(1, 0, 2))


# -- the fallback --------------------------------------------------------------------------
def column_scaled_model(d=8, seq=4, ids=False):
    """One head by hand whose Q is scaled column by column after its projection (a layout
    the initializer reader does not follow); x, or token ids -> Gather(embedding) -> x."""
    rng = np.random.default_rng(0)
    w = {r: rng.standard_normal((d, d)).astype(np.float32) for r in "qkvo"}
    cols = np.linspace(0.5, 2.0, d).astype(np.float32)
    inits = [nh.from_array(a, f"W{r}") for r, a in w.items()]
    inits += [nh.from_array(cols, "cols"), nh.from_array(np.float32(d ** -0.5), "scale")]
    nodes = [oh.make_node("MatMul", ["x", f"W{r}"], [r], name=f"proj_{r}") for r in "qkv"]
    nodes += [oh.make_node("Mul", ["q", "cols"], ["qc"], name="scale_columns"),
              oh.make_node("Transpose", ["k"], ["kT"], perm=[0, 2, 1]),
              oh.make_node("MatMul", ["qc", "kT"], ["s"], name="scores"),
              oh.make_node("Mul", ["s", "scale"], ["s1"]),
              oh.make_node("Softmax", ["s1"], ["p"], axis=-1),
              oh.make_node("MatMul", ["p", "v"], ["o"]),
              oh.make_node("MatMul", ["o", "Wo"], ["y"], name="out")]
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, [1, seq, d])]
    if ids:
        inits.append(nh.from_array(rng.standard_normal((50, d)).astype(np.float32), "emb"))
        nodes.insert(0, oh.make_node("Gather", ["emb", "ids"], ["x"], name="embed"))
        inputs = [oh.make_tensor_value_info("ids", TP.INT64, [1, seq])]
    g = oh.make_graph(nodes, "scaled", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, None)],
                      inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)]), w, cols


def test_unreadable_layout_falls_back_to_the_fit_and_says_why():
    pytest.importorskip("onnxruntime")
    model, w, cols = column_scaled_model()
    (found,) = import_onnx(model)
    assert found.weight_source == "fit"
    assert "fitted by least squares" in str(found) and "'scale_columns'" in str(found)
    np.testing.assert_allclose(found.weights["w_q"][0], w["q"] * cols, atol=1e-5)
    np.testing.assert_allclose(found.weights["w_o"], w["o"], atol=1e-5)
    x = rand_x(8, 1, 4)
    assert_close(found.graph.reference(x, found.weights),
                 run_reference_evaluator(model, {"x": x}))


def test_fit_refuses_rank_deficient_probes_and_checks_on_unseen_inputs():
    pytest.importorskip("onnxruntime")
    model, w, cols = column_scaled_model(ids=True)
    one = {"ids": np.array([[1, 2, 3, 4]], np.int64)}
    with pytest.raises(OnnxError, match="span 4 of the 8 directions.*more varied sample_inputs"):
        import_onnx(model, sample_inputs=one)
    rng = np.random.default_rng(5)
    samples = [{"ids": rng.choice(50, size=(1, 4), replace=False)} for _ in range(12)]
    (found,) = import_onnx(model, sample_inputs=samples)
    assert found.weight_source == "fit"
    np.testing.assert_allclose(found.weights["w_q"][0], w["q"] * cols, atol=1e-4)
    repeated = samples[:11] + [samples[0]]     # the held-out sample was fitted on
    with pytest.raises(OnnxError, match="self-check input repeats inputs the fit saw"):
        import_onnx(model, sample_inputs=repeated)


def test_token_id_model_with_readable_weights_needs_one_sample(no_onnxruntime):
    model, w, _ = column_scaled_model(ids=True)
    for n in model.graph.node:          # drop the column scaling: Q is readable again
        if n.name == "scores":
            n.input[0] = "q"
    (found,) = import_onnx(model, sample_inputs={"ids": np.array([[1, 2, 3, 4]], np.int64)})
    assert found.weight_source == "initializers" and found.input == "x"
    for r in "qkv":
        assert np.array_equal(found.weights[f"w_{r}"][0], w[r])
    assert np.array_equal(found.weights["w_o"], w["o"])


def test_torch_sdpa_export_with_its_nan_guard_imports_exactly(monkeypatch):
    """torch.onnx.export of F.scaled_dot_product_attention with a boolean mask writes
    Where(IsNaN(P), 0, P) after the Softmax (fully masked rows give zeros, as in mhagen);
    the importer reads through it, weights from the initializers."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    import torch.nn.functional as F
    torch.manual_seed(0)
    d, heads = 32, 4

    class SDPA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.o(o.transpose(1, 2).reshape(b, s, d))

    m = SDPA().eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.zeros(B, S, d),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    model = onnx.load_from_string(buf.getvalue())
    assert "IsNaN" in {n.op_type for n in model.graph.node}
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    (found,) = import_onnx(model)
    assert found.weight_source == "initializers" and found.graph.options["causal"]
    x = rand_x(d)
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    assert_close(found.graph.reference(x, found.weights), want)


# -- score modifiers -----------------------------------------------------------------------
@pytest.mark.parametrize("score_mod", [
    mhagen.alibi(4), mhagen.softcap(5.0), [mhagen.softcap(5.0), mhagen.alibi(4)]],
    ids=["alibi", "softcap", "softcap-then-alibi"])
def test_score_modifiers_import_as_the_layer_that_was_exported(score_mod, tmp_path,
                                                                no_onnxruntime):
    layer = mhagen.mha(32, 4, causal=True, score_mod=score_mod)
    w = layer.init_weights(0)
    (found,) = import_onnx(export_onnx(layer, tmp_path / "m.onnx", w, batch=B, seq_len=S))
    assert found.graph == layer and found.weight_source == "initializers"
    assert_same_weights(found, w)
    x = rand_x(32, seq=11)      # another length than the probes'
    assert_close(found.graph.reference(x, found.weights), layer.reference(x, w))


def bias_model(bias, d=8, heads=2, seq=5):
    """Scores scaled then plus a constant additive bias [1, H, seq, seq] (one head's
    projection per head by hand), as BLOOM-like exports write ALiBi."""
    rng = np.random.default_rng(0)
    w = {r: rng.standard_normal((heads, d, d)).astype(np.float32) for r in "qkv"}
    w_o = rng.standard_normal((heads * d, d)).astype(np.float32)
    inits = [nh.from_array(w[r][h], f"W{r}{h}") for r in "qkv" for h in range(heads)]
    inits += [nh.from_array(w_o, "Wo"), nh.from_array(np.float32(d ** -0.5), "scale"),
              nh.from_array(bias.astype(np.float32), "bias")]
    nodes, outs = [], []
    for h in range(heads):
        nodes += [oh.make_node("MatMul", ["x", f"W{r}{h}"], [f"{r}{h}"]) for r in "qkv"]
        nodes += [oh.make_node("Transpose", [f"k{h}"], [f"kT{h}"], perm=[0, 2, 1]),
                  oh.make_node("MatMul", [f"q{h}", f"kT{h}"], [f"s{h}"]),
                  oh.make_node("Mul", [f"s{h}", "scale"], [f"t{h}"]),
                  oh.make_node("Gather", ["bias", f"h{h}"], [f"b{h}"], axis=1),
                  oh.make_node("Add", [f"t{h}", f"b{h}"], [f"u{h}"]),
                  oh.make_node("Softmax", [f"u{h}"], [f"p{h}"], axis=-1),
                  oh.make_node("MatMul", [f"p{h}", f"v{h}"], [f"o{h}"])]
        inits.append(nh.from_array(np.int64(h), f"h{h}"))
        outs.append(f"o{h}")
    nodes += [oh.make_node("Concat", outs, ["o"], axis=-1),
              oh.make_node("MatMul", ["o", "Wo"], ["y"])]
    g = oh.make_graph(nodes, "biased", [oh.make_tensor_value_info("x", TP.FLOAT, [1, seq, d])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


def test_bloom_form_alibi_imports_as_a_distance_bias(no_onnxruntime):
    """slope_h * kv_idx (BLOOM's form: a row constant away from slope_h * (kv_idx - q_idx))
    with slopes that are not ALiBi's: a per-head table times the distance."""
    slopes = np.array([0.3, -0.125])
    bias = (slopes[:, None, None] * np.arange(5)[None, None, :]).repeat(5, axis=1)[None]
    model = bias_model(bias)
    (found,) = import_onnx(model)
    assert "table[2][head] * (kv_idx - q_idx)" in found.graph.options["score_mod"]
    x = rand_x(8, batch=1, seq=5)
    assert_close(found.graph.reference(x, found.weights),
                 run_reference_evaluator(model, {"x": x}))


def test_a_bias_of_the_distance_alone_imports_as_a_distance_table(no_onnxruntime):
    """-|kv_idx - q_idx| / 2 per head (a learned relative bias's form: a function of the
    distance, not linear in it) imports as a table per head and distance."""
    d = np.arange(5)[None, :] - np.arange(5)[:, None]
    bias = np.stack([-0.5 * np.abs(d), 0.25 * np.minimum(d, 2)])[None]
    model = bias_model(bias)
    (found,) = import_onnx(model)
    assert "table[18][(((head * 9) + (kv_idx - q_idx)) + 4)]" in found.graph.options["score_mod"]
    assert any("learned relative position bias" in n for n in found.notes)
    x = rand_x(8, batch=1, seq=5)
    assert_close(found.graph.reference(x, found.weights),
                 run_reference_evaluator(model, {"x": x}))


def test_relative_bias_layers_import_as_the_layer_that_was_exported(tmp_path, no_onnxruntime):
    """mhagen.relative_bias (T5 buckets, max_distance 6) exported at seq 12 and imported:
    the per-distance table read at the probe covers every distinct distance, so the layer
    matches the exported one at another length too."""
    table = np.random.default_rng(1).standard_normal((4, 8))
    layer = mhagen.mha(32, 4, score_mod=mhagen.relative_bias(table, max_distance=6))
    w = layer.init_weights(0)
    (found,) = import_onnx(export_onnx(layer, tmp_path / "m.onnx", w, batch=B, seq_len=12))
    assert found.weight_source == "initializers"
    x = rand_x(32, seq=40)
    assert_close(found.graph.reference(x, found.weights), layer.reference(x, w))
    kernel = mhagen.build(found.graph, batch=x.shape[0], seq_len=40, weights=found.weights)
    assert_close(kernel(x), layer.reference(x, w))


def test_a_bias_of_the_positions_is_refused_clearly(no_onnxruntime):
    bias = np.random.default_rng(3).standard_normal((1, 2, 5, 5))
    with pytest.raises(OnnxError, match="neither a linear distance bias.*nor a function of "
                                        "kv_idx - q_idx alone"):
        import_onnx(bias_model(bias))


@pytest.mark.parametrize("backend", ["onnxruntime", "onnx.reference"])
def test_a_model_the_backend_cannot_load_or_run_is_an_onnx_error(backend, tmp_path,
                                                                monkeypatch):
    """A damaged model (Softmax over axis 7 of a rank-4 tensor) is refused with the
    backend's reason, whichever backend probes it; never the backend's own exception."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    else:
        monkeypatch.setitem(sys.modules, "onnxruntime", None)
    layer = mhagen.mha(16, 2, causal=True)
    model = onnx.load(str(export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(),
                                      seq_len=6)))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    next(a for a in softmax.attribute if a.name == "axis").i = 7
    with pytest.raises(OnnxError, match=f"{backend} cannot (load|run) the model") as info:
        import_onnx(model)
    assert "axis" in str(info.value).lower()


# -- real exports of Hugging Face models -----------------------------------------------------

@pytest.mark.parametrize("damage, message", [
    ("nan_weight", r"Attention node 'attention': the model's w_k of head 1 holds NaN or inf"),
    # a NaN before the layer (a LayerNorm's weight in Hugging Face exports) had raised
    # numpy's LinAlgError from the fit or ValueError from the rotary reader
    ("nan_input", r"Attention node 'attention': the layer's input 'x_scaled' holds NaN or "
                  r"inf when the model runs on random probe inputs"),
    ("inf_scale", r"Attention node 'attention': what the model computes is not a valid "
                  r"mhagen layer: .*finite")])
def test_values_mhagen_cannot_take_are_onnx_errors_naming_the_node(damage, message, tmp_path,
                                                                   no_onnxruntime):
    """Found by editing exported models at random: a NaN in a weight or an infinite
    Attention scale came out as the graph verifier's or the reference's error, naming
    mhagen's own node or weight instead of the ONNX node; a NaN before the layer as numpy's
    errors."""
    layer = mhagen.mha(16, 2, kv_heads=2)
    model = onnx.load(str(export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(),
                                      form="fused", seq_len=6)))
    if damage == "nan_input":      # x -> Mul(x, [1, .., NaN]) -> the layer
        scale = np.ones(16, np.float32)
        scale[5] = np.nan
        model.graph.initializer.append(nh.from_array(scale, "nan_scale"))
        for n in model.graph.node:
            n.input[:] = ["x_scaled" if i == "x" else i for i in n.input]
        model.graph.node.insert(0, oh.make_node("Mul", ["x", "nan_scale"], ["x_scaled"]))
    elif damage == "nan_weight":
        init = next(t for t in model.graph.initializer if t.name == "w_k")
        w = nh.to_array(init).copy()
        w[0, 8 + 3] = np.nan             # K/V heads side by side: column 11 is head 1's
        init.CopyFrom(nh.from_array(w, "w_k"))
    else:
        attention = next(n for n in model.graph.node if n.op_type == "Attention")
        next(a for a in attention.attribute if a.name == "scale").f = float("inf")
    with pytest.raises(OnnxError, match=message):
        import_onnx(model)

def _hf_import(model, torch):
    """A transformers model (random config) exported with token ids as its only input, as a
    user would; the one imported layer."""
    class Ids(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # eval() on the wrapper: export restores its mode, and that of every child
        torch.onnx.export(Ids().eval(), (ids,), buf, dynamo=False, opset_version=17,
                          input_names=["ids"], output_names=["y"])
    assert not model.training
    (found,) = import_onnx(onnx.load_from_string(buf.getvalue()),
                           sample_inputs={"ids": ids.numpy()})
    assert found.weight_source == "initializers"
    return found


def _around(model, torch, enter, leave, take_output=lambda out: out):
    """(input of module `enter`, output of module `leave`) on token ids the import never
    saw (batch 2)."""
    seen = {}
    hooks = [enter.register_forward_pre_hook(
                 lambda mod, args, kw: seen.update(x=(args or (kw["hidden_states"],))[0]),
                 with_kwargs=True),
             leave.register_forward_hook(lambda mod, args, out: seen.update(y=take_output(out)))]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 100, (2, 8),
                                          generator=torch.Generator().manual_seed(5)))
    finally:
        for h in hooks:
            h.remove()
    return seen["x"].numpy(), seen["y"].numpy()


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_hugging_face_models_import_exactly_and_match_on_unseen_tokens(arch):
    """Issue 16's silent wrong import: a 1-layer transformers model (random config) with
    token ids as its only input. Its attention must come out exact: weights read from the
    initializers, and the layer equal to the model's own attention block (BERT:
    self-attention + the output dense, before the residual and LayerNorm; GPT-2: causal
    attention + c_proj) on token ids the import never saw."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    if arch == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64,
            attn_implementation="eager")).eval()
        att = model.encoder.layer[0].attention
        ends = (att.self, att.output.dense, lambda out: out)
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=1, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager")).eval()
        att = model.h[0].attn
        ends = (att, att, lambda out: out[0])
    found = _hf_import(model, torch)
    assert found.graph.options["causal"] == (arch == "gpt2")
    x, want = _around(model, torch, *ends)
    assert_close(found.graph.reference(x, found.weights), want)


def test_hugging_face_t5_relative_bias_imports_exactly():
    """A 1-layer T5 encoder (random config, 8 buckets, max_distance 6): its learned relative
    position bias imports as a table per head and distance (no 1/sqrt(d) scale, no
    projection biases), equal to T5's own attention block on tokens the import never saw,
    at the export length and at a longer one (max_distance < the probe length)."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=6,
        attn_implementation="eager")).eval()
    found = _hf_import(model, torch)
    assert any("learned relative position bias" in n for n in found.notes)
    assert found.graph.options["bias"] is False
    att = model.encoder.block[0].layer[0].SelfAttention
    x, want = _around(model, torch, att, att, lambda out: out[0])
    assert_close(found.graph.reference(x, found.weights), want)
    seen = {}
    hooks = [att.register_forward_pre_hook(
                 lambda mod, args, kw: seen.update(x=(args or (kw["hidden_states"],))[0]),
                 with_kwargs=True),
             att.register_forward_hook(lambda mod, args, out: seen.update(y=out[0]))]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(7)))
    for h in hooks:
        h.remove()
    assert_close(found.graph.reference(seen["x"].numpy(), found.weights), seen["y"].numpy())


def _mistral_like(transformers, arch, **extra):
    """A 1-layer model with rotary embeddings (random config): Mistral (grouped K/V, a
    sliding window of 4) or LLaMA (rope_theta 500000, head_dim 16)."""
    if arch == "mistral":
        return transformers.MistralModel(transformers.MistralConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
            attn_implementation="eager", **extra)).eval()
    return transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager", **extra)).eval()


@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_hugging_face_rotary_models_import_exactly(arch):
    """Rotary embeddings on Q and K (Hugging Face's x cos + rotate_half(x) sin) import as
    mhagen.rotary with the model's base, read from the angles; with Mistral's grouped K/V
    and causal sliding window too. The layer equals the model's own attention block
    (self_attn with its o_proj) on unseen tokens at two lengths, in the reference and
    compiled for this CPU."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    model = _mistral_like(transformers, arch)
    found = _hf_import(model, torch)
    opts = found.graph.options
    head_dim = 8 if arch == "mistral" else 16
    assert opts["rotary"] == {"base": 10000.0 if arch == "mistral" else 500000.0,
                              "rotary_dim": head_dim}
    assert opts["causal"] and opts["head_dim"] == head_dim
    if arch == "mistral":
        assert opts["kv_heads"] == 2 and opts["mask"] == "((q_idx - kv_idx) < 4)"
    att = model.layers[0].self_attn
    for seq in (8, 20):
        seen = {}
        hooks = [att.register_forward_pre_hook(
                     lambda mod, args, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True),
                 att.register_forward_hook(lambda mod, args, out: seen.update(y=out[0]))]
        with torch.no_grad():
            model(input_ids=torch.randint(0, 100, (2, seq),
                                          generator=torch.Generator().manual_seed(seq)))
        for h in hooks:
            h.remove()
        x, want = seen["x"].numpy(), seen["y"].numpy()
        assert_close(found.graph.reference(x, found.weights), want)
        module = mhagen.build(found.graph, "x86", batch=2, seq_len=seq,
                              weights=found.weights, tuning=None)
        assert_close(module(x), want)


def test_scaled_rotary_frequencies_are_refused():
    """LLaMA with linear rope_scaling (positions divided by 2): not mhagen's RoPE; refused
    with the reason rather than imported with the wrong angles."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    model = _mistral_like(transformers, "llama",
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(OnnxError, match="rotary embeddings on Q.*scaled frequencies"):
        _hf_import(model, torch)


@pytest.mark.parametrize("dynamic", [False, True])
def test_mhagen_rotary_layers_round_trip(tmp_path, dynamic):
    """mhagen's own export of rotary layers (Slices, Sub/Add, Concat; partial rotary with a
    pass-through part) imports as the same graph."""
    for layer in (mhagen.mha(64, 4, rotary=mhagen.rotary()),
                  mhagen.mha(80, 4, head_dim=20, kv_heads=2, causal=True,
                             rotary=mhagen.rotary(base=500.0, rotary_dim=12))):
        weights = layer.init_weights(seed=0)
        path = export_onnx(layer, tmp_path / "rot.onnx", weights, seq_len=24,
                           dynamic_seq=dynamic)
        (found,) = import_onnx(path)
        assert found.graph == layer, found.graph
        x = np.random.default_rng(1).standard_normal((1, 24, layer.options["d_model"]))
        assert_close(found.graph.reference(x, found.weights), layer.reference(x, weights))


def _check_at_two_lengths(model, torch, found, enter, leave, take_output):
    """The imported layer's reference and one any-length module for this CPU against the
    model's own attention (from `enter`'s input to `leave`'s output) on unseen tokens at the
    export length and a longer one; returns (input, reference output) at the first."""
    module = mhagen.build(found.graph, "x86", batch=2, seq_len=None, max_seq_len=20,
                          weights=found.weights, tuning=None)
    checked = []
    for seq in (8, 20):
        seen = {}
        hooks = [enter.register_forward_pre_hook(
                     lambda mod, args, kw: seen.update(x=(args or (kw["hidden_states"],))[0]),
                     with_kwargs=True),
                 leave.register_forward_hook(lambda mod, args, out: seen.update(
                     y=take_output(out)))]
        with torch.no_grad():
            model(input_ids=torch.randint(0, 100, (2, seq),
                                          generator=torch.Generator().manual_seed(seq)))
        for h in hooks:
            h.remove()
        x, want = seen["x"].numpy(), seen["y"].numpy()
        ref = found.graph.reference(x, found.weights)
        assert_close(ref, want)
        assert_close(module(x), want)
        checked.append((x, ref))
    return checked[0]


def test_hugging_face_gemma2_with_its_own_query_scale_imports_exactly():
    """Gemma 2 scales the scores by query_pre_attn_scalar ** -0.5 (24 here, head_dim 16),
    then softcaps them, with rotary, grouped K/V and a sliding window of 4: imported as
    mha(scale=24 ** -0.5, softcap, rotary, window) -- it had been refused over "per-head
    scales" -- equal to the model's attention (self_attn with o_proj) on unseen tokens, in
    the reference and compiled; weights larger than Gemma's init so that the scale and the
    softcap move the output by far more than the tolerance."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    model = transformers.Gemma2Model(transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0, sliding_window=4, max_position_embeddings=64,
        initializer_range=0.15, attn_implementation="eager")).eval()
    found = _hf_import(model, torch)
    opts = found.graph.options
    assert math.isclose(opts["scale"], 24 ** -0.5, rel_tol=1e-7)
    assert opts["score_mod"] == repr(mhagen.softcap(3.0)) and opts["kv_heads"] == 2
    assert opts["causal"] and opts["mask"] == "((q_idx - kv_idx) < 4)"
    assert opts["rotary"] == {"base": 10000.0, "rotary_dim": 16}
    assert found.max_error < 1e-5          # onnxruntime's run of the model, unseen input
    att = model.layers[0].self_attn
    x, ref = _check_at_two_lengths(model, torch, found, att, att, lambda out: out[0])
    default = mhagen.mha(64, 4, head_dim=16, kv_heads=2, causal=True, bias=False,
                         mask=(mhagen.q_idx - mhagen.kv_idx) < 4, rotary=True,
                         score_mod=mhagen.softcap(3.0))
    assert opts == default.options | {"scale": opts["scale"]}
    assert mhagen.max_error(default.reference(x, found.weights), ref) > 100 * tolerance(ref)


def test_hugging_face_bloom_reshaped_scores_and_alibi_import_exactly():
    """BLOOM's export: Q K^T on [batch*heads, q, k] via baddbmm (the scale, then ALiBi
    added), a Reshape to [batch, heads, q, k] for the causal mask and Softmax, a Reshape back
    for P V. Imported as mha(causal, mhagen.alibi(4)), equal to the model's attention
    (self_attention up to its dense projection, before the residual) on unseen tokens."""
    torch = pytest.importorskip("torch", reason="torch is a test dependency")
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    torch.manual_seed(0)
    model = transformers.BloomModel(transformers.BloomConfig(
        vocab_size=128, hidden_size=64, n_layer=1, n_head=4, initializer_range=0.15,
        attn_implementation="eager")).eval()
    found = _hf_import(model, torch)
    assert found.graph == mhagen.mha(64, 4, causal=True, score_mod=mhagen.alibi(4),
                                     name=found.graph.name), found.graph
    assert found.max_error < 1e-5
    att = model.h[0].self_attention
    _check_at_two_lengths(model, torch, found, att, att.dense, lambda out: out)


def _exported_rotary_heads(tmp_path):
    """mhagen's decomposed export of a 2-head rotary layer at seq 6: one Softmax per head."""
    layer = mhagen.mha(32, 2, rotary=True)
    return onnx.load(str(export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0),
                                     seq_len=6)))


def test_rotary_heads_of_different_scales_are_refused_naming_the_node(tmp_path,
                                                                      no_onnxruntime):
    """Head 1 scaled by 0.5, head 0 by 1/sqrt(16): mha() takes one scale, so a rotary layer
    like that is refused, naming the Softmax it starts at and the scales (it had named no
    node)."""
    model = _exported_rotary_heads(tmp_path)
    model.graph.initializer.append(nh.from_array(np.float32(0.5), "half"))
    scaled1 = next(n for n in model.graph.node if n.name == "scaled1")
    scaled1.input[1] = "half"
    with pytest.raises(OnnxError, match=r"^Softmax node 'p0' \(and the layer's 1 other "
                                        r"attention core\): rotary embeddings on a layer that "
                                        r"mha\(\) cannot describe: its heads' score scales "
                                        r"are \[0.25, 0.5\]"):
        import_onnx(model)


def test_a_reshape_of_the_key_axis_is_refused_naming_the_node(tmp_path, no_onnxruntime):
    """Reshapes between the scores and Softmax are read when they only regroup the batch and
    head axes (BLOOM); one that moves keys into other rows is refused by name."""
    model = _exported_rotary_heads(tmp_path)
    nodes = list(model.graph.node)
    model.graph.initializer.extend([nh.from_array(np.array([1, 3, 12], np.int64), "wide"),
                                    nh.from_array(np.array([1, 6, 6], np.int64), "square")])
    softmax = next(n for n in nodes if n.name == "p0")
    pv = next(n for n in nodes if n.op_type == "MatMul" and n.input[0] == "p0")
    softmax.input[0], pv.input[0] = "scaled0_wide", "p0_square"
    at = nodes.index(softmax)
    nodes[at + 1:at + 1] = [oh.make_node("Reshape", ["p0", "square"], ["p0_square"],
                                         name="back")]
    nodes[at:at] = [oh.make_node("Reshape", ["scaled0", "wide"], ["scaled0_wide"],
                                 name="rows_of_12")]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    with pytest.raises(OnnxError, match=r"Softmax node 'p0': Reshape node 'rows_of_12' "
                                        r"reshapes the scores \(1, 6, 6\) -> \(1, 3, 12\)"):
        import_onnx(model)
