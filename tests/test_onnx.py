"""ONNX: export (decomposed and fused forms) checked in onnxruntime against the reference;
import (Attention, com.microsoft.MultiHeadAttention, MatMul-Softmax-MatMul from our export
and from torch's export of nn.MultiheadAttention) rebuilt with mhagen against onnxruntime;
errors; the CLI sub-commands; the example.

NOTE: onnxruntime and torch are test dependencies (pyproject [test] extra, installed by CI).
The importorskips only let a bare checkout without them run the rest of the suite.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.ir import batch as batch_idx
from mhagen.ir import head as head_idx
from mhagen.onnx import OnnxError, export_onnx, import_onnx
from mhagen.tolerances import assert_close

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: "
                                                "`pip install -e .[test]` (CI installs it)")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from test_onnx_import import torch_mha_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
B, S = 2, 7

LAYERS = {   # the round-trip matrix
    "plain": lambda: mhagen.mha(32, 4),
    "causal": lambda: mhagen.mha(32, 4, causal=True),
    "gqa-causal": lambda: mhagen.mha(32, 4, kv_heads=2, causal=True),
    "no-bias": lambda: mhagen.mha(32, 4, bias=False),
}
MORE_LAYERS = {
    "mqa": lambda: mhagen.mha(32, 4, kv_heads=1),
    "head_dim12": lambda: mhagen.mha(32, 4, head_dim=12),
    "sliding-window": lambda: mhagen.mha(32, 4, mask=mhagen.sliding_window(3)),
    "fully-masked-row": lambda: mhagen.mha(32, 4, mask=mhagen.kv_idx < mhagen.q_idx),
    "head-dependent-mask": lambda: mhagen.mha(
        32, 4, mask=(mhagen.kv_idx <= mhagen.q_idx) | head_idx.eq(1)),
    "batch-dependent-mask": lambda: mhagen.mha(
        32, 4, mask=mhagen.kv_idx <= mhagen.q_idx + batch_idx),
}
FORMS = ["decomposed", "fused"]


def rand_x(d_model, batch=B, seq=S, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, seq, d_model)).astype(np.float32)


def run_ort(model, x):
    data = str(model) if isinstance(model, Path) else model.SerializeToString()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def ops(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


# -- export -> onnxruntime == reference ----------------------------------------------------
@pytest.mark.parametrize("name", list(LAYERS) + list(MORE_LAYERS))
@pytest.mark.parametrize("form", FORMS)
def test_export_matches_reference_in_onnxruntime(form, name, tmp_path):
    layer = {**LAYERS, **MORE_LAYERS}[name]()
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, batch=B, seq_len=S)
    onnx.checker.check_model(str(path), full_check=True)
    x = rand_x(32)
    assert_close(run_ort(path, x), layer.reference(x, w))
    model = onnx.load(str(path))
    used = {i for n in model.graph.node for i in n.input}
    assert [t.name for t in model.graph.initializer if t.name not in used] == []
    if form == "fused":
        (att,) = [n for n in model.graph.node if n.op_type == "Attention"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in att.attribute}
        assert model.opset_import[0].version >= 23
        assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (4, layer.options["kv_heads"])
    else:
        assert model.opset_import[0].version >= 17 and "Attention" not in ops(path)
        inits = {t.name for t in model.graph.initializer}
        assert {"w_q.0", "w_q.3", "w_o"} <= inits            # per-head weights visible


@pytest.mark.parametrize("form, opset", [("decomposed", None), ("decomposed", 18),
                                         ("fused", None), ("fused", 24)],
                         ids=["decomposed", "decomposed-opset18", "fused", "fused-opset24"])
def test_dynamic_batch_and_seq(form, opset, tmp_path):
    layer = mhagen.mha(32, 4, kv_heads=2, mask=mhagen.sliding_window(4))
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, dynamic_batch=True,
                       dynamic_seq=True, opset=opset)
    assert onnx.load(str(path)).opset_import[0].version == opset or opset is None
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", "seq", 32]
    assert "Range" in ops(path)                 # the mask is computed from the length
    for shape in [(1, 5), (3, 11)]:
        x = rand_x(32, *shape)
        assert_close(run_ort(path, x), layer.reference(x, w))


@pytest.mark.parametrize("masks", ["constant", "computed"])
def test_mask_forms_agree(masks, tmp_path):
    layer = MORE_LAYERS["batch-dependent-mask"]()
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, batch=B, seq_len=S, masks=masks)
    model = onnx.load(str(path))
    bool_inits = [t for t in model.graph.initializer if t.data_type == TP.BOOL]
    assert ("Range" in ops(path)) == (masks == "computed")
    assert bool(bool_inits) == (masks == "constant")
    x = rand_x(32)
    assert_close(run_ort(path, x), layer.reference(x, w))


def test_constant_masks_need_static_shapes(tmp_path):
    layer = mhagen.mha(32, 4, causal=True)
    with pytest.raises(OnnxError, match="masks='constant' needs static shapes"):
        export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), dynamic_seq=True,
                    masks="constant")


def test_fully_masked_rows_are_zeros_not_nan(tmp_path):
    # Query 0 sees no key: mhagen gives zeros (y row = b_o). A bare ONNX Softmax gives NaN,
    # so the decomposed export zeroes such rows; the Attention op already gives zeros.
    layer = MORE_LAYERS["fully-masked-row"]()
    w = layer.init_weights(0)
    x = rand_x(32)
    for form in FORMS:
        y = run_ort(export_onnx(layer, tmp_path / f"{form}.onnx", w, form=form, batch=B,
                                seq_len=S), x)
        np.testing.assert_allclose(y[:, 0], np.broadcast_to(w["b_o"], (B, 32)), atol=1e-6)
    model = onnx.load(str(tmp_path / "decomposed.onnx"))
    where = [n for n in model.graph.node if n.op_type == "Where" and n.name == "p0"]
    assert where, "the decomposed form should zero fully masked rows after Softmax"
    bare = onnx.load(str(tmp_path / "decomposed.onnx"))    # drop the fix: ONNX gives NaN
    bare.graph.node.remove(next(n for n in bare.graph.node if n.name == "p0"))
    for n in bare.graph.node:
        n.output[:] = ["p0" if o == "p0_raw" else o for o in n.output]
    assert np.isnan(run_ort(bare, x)[:, 0]).all()


def test_fused_form_refuses_heads_of_different_structure(tmp_path):
    g = mhagen.Graph("mixed")
    x = g.input("x", 16)
    outs = []
    for h, mask in enumerate([None, mhagen.causal()]):
        q, k, v = (g.head_projection(x, f"w_{r}", h, 8, name=f"{r}{h}") for r in "qkv")
        s = g.scale(g.scores(q, k), 0.3)
        if mask is not None:
            s = g.mask(s, mask, head=h)
        outs.append(g.weighted_sum(g.softmax(s), v))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 16))
    w = g.init_weights(0)
    with pytest.raises(OnnxError, match="heads use different masks.*form='decomposed'"):
        export_onnx(g, tmp_path / "f.onnx", w, form="fused", seq_len=S)
    path = export_onnx(g, tmp_path / "d.onnx", w, seq_len=S, batch=B)
    x = rand_x(16)
    assert_close(run_ort(path, x), g.reference(x, w))
    (found,) = import_onnx(path)                # different scale and masks per head
    assert found.graph.options.get("imported") == "onnx"
    assert_close(found.graph.reference(x, found.weights), g.reference(x, w))


def test_builder_graph_with_uneven_heads_exports_decomposed(tmp_path):
    g = mhagen.Graph("uneven")
    x = g.input("x", 12)
    a = g.weighted_sum(g.softmax(g.mask(g.scores(g.head_projection(x, "wa", 0, 4),
                                                 g.head_projection(x, "wb", 0, 4)),
                                        mhagen.sliding_window(2), head=0)),
                       g.head_projection(x, "wc", 0, 6))
    c = g.head_projection(x, "wd", 0, 3)
    g.set_output(g.output_projection(g.concat_heads([a, c]), "wo", 5, bias="bo"))
    w = g.init_weights(0)
    path = export_onnx(g, tmp_path / "u.onnx", w, batch=B, seq_len=S)
    x = rand_x(12)
    assert_close(run_ort(path, x), g.reference(x, w))


@pytest.mark.parametrize("form", FORMS)
def test_fused_graph_exports(form, tmp_path):
    from mhagen.passes.fuse_attention import fuse_attention
    layer = mhagen.mha(32, 4, kv_heads=2, causal=True)
    fused = fuse_attention(layer).graph
    w = layer.init_weights(0)
    path = export_onnx(fused, tmp_path / "m.onnx", w, form=form, batch=B, seq_len=S)
    x = rand_x(32)
    assert_close(run_ort(path, x), layer.reference(x, w))


def test_external_data(tmp_path):
    layer = mhagen.mha(32, 4)
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "ext.onnx", w, batch=B, seq_len=S, external_data=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size >= sum(a.nbytes for a in w.values())
    assert all(t.data_location == TP.EXTERNAL
               for t in onnx.load(str(path), load_external_data=False).graph.initializer
               if t.name.startswith("w_"))
    x = rand_x(32)
    assert_close(run_ort(path, x), layer.reference(x, w))
    path = export_onnx(layer, tmp_path / "ext.onnx", w, batch=B, seq_len=S, external_data=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size < 2 * sum(a.nbytes for a in w.values())


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"form": "fused", "opset": 17}, OnnxError, "needs opset >= 23"),
    ({"form": "tvm"}, OnnxError, "not an ONNX form"),
    ({"masks": "lazy"}, OnnxError, "masks='lazy'"),
    ({"weights": None}, mhagen.InputError, "needs weights"),
    ({"seq_len": 0}, mhagen.GraphError, "seq_len=0"),
], ids=["fused-opset", "form", "masks", "no-weights", "seq_len"])
def test_export_errors(kwargs, error, fragment, tmp_path):
    layer = mhagen.mha(32, 4)
    kwargs = {"weights": layer.init_weights(0), **kwargs}
    with pytest.raises(error, match=fragment):
        export_onnx(layer, tmp_path / "m.onnx", **kwargs)


# -- ONNX -> import -> mhagen.build == onnxruntime -----------------------------------------
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("form", FORMS)
def test_roundtrip_import_and_build(form, name, tmp_path):
    layer = LAYERS[name]()
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, batch=B, seq_len=S)
    (found,) = import_onnx(path)
    graph, weights = found
    assert graph == layer and found.source == ("Attention" if form == "fused" else
                                                 "MatMul-Softmax-MatMul")
    assert (found.input, found.output, found.layout) == ("x", "y", "BSD")
    assert found.weight_source == "initializers"
    for k in w:
        assert np.array_equal(weights[k], w[k]), k
    x = rand_x(32)
    kernel = mhagen.build(graph, "x86", batch=B, seq_len=S, weights=weights)
    assert_close(kernel(x), run_ort(path, x))


@pytest.mark.parametrize("name", list(MORE_LAYERS)[:-1])   # batch-dependent: not a band
@pytest.mark.parametrize("form", FORMS)
def test_import_more_variants(form, name, tmp_path):
    layer = MORE_LAYERS[name]()
    w = layer.init_weights(0)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, dynamic_batch=True,
                       dynamic_seq=True)
    (found,) = import_onnx(path, seq_len=9)
    x = rand_x(32, 3, 13)
    assert_close(found.graph.reference(x, found.weights), run_ort(path, x))


def test_import_finds_each_layer_of_a_larger_model(tmp_path):
    from onnx import compose
    a, b = mhagen.mha(32, 4, causal=True), mhagen.mha(32, 2, kv_heads=1)
    wa, wb = a.init_weights(0), b.init_weights(1)
    ma = onnx.load(str(export_onnx(a, tmp_path / "a.onnx", wa, batch=B, seq_len=S, opset=23)))
    mb = onnx.load(str(export_onnx(b, tmp_path / "b.onnx", wb, batch=B, seq_len=S,
                                   form="fused")))
    for m in (ma, mb):
        del m.metadata_props[:]
    model = compose.merge_models(ma, mb, io_map=[("y", "x")], prefix2="b/")  # y = b(a(x))
    found = import_onnx(model)
    assert [(f.source, f.input, f.output) for f in found] == [
        ("MatMul-Softmax-MatMul", "x", "y"), ("Attention", "y", "b/y")]
    for f, layer, w in zip(found, (a, b), (wa, wb)):
        assert f.graph.options == layer.options
        for k in w:   # read from the initializers: exact
            assert np.array_equal(f.weights[k], w[k]), k
    x = rand_x(32)
    assert_close(b.reference(a.reference(x, wa), wb), run_ort(model, x))


def test_import_refuses_batch_dependent_mask(tmp_path):
    layer = MORE_LAYERS["batch-dependent-mask"]()
    path = export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), batch=B, seq_len=S)
    with pytest.raises(OnnxError, match="differs between batch elements"):
        import_onnx(path)


# torch's exporter of nn.MultiheadAttention (the legacy TorchScript one: the dynamo exporter
# needs onnxscript, not a test dependency)
@pytest.mark.parametrize("batch_first, causal", [(True, False), (False, True)],
                         ids=["batch_first", "seq_first-causal"])
def test_import_torch_multihead_attention(batch_first, causal):
    m, model = torch_mha_model(batch_first, causal)
    x = rand_x(32)
    xt = x if batch_first else x.transpose(1, 0, 2).copy()
    assert {"Softmax", "MatMul"} <= {n.op_type for n in model.graph.node}
    (found,) = import_onnx(model)
    assert found.layout == ("BSD" if batch_first else "SBD")
    assert found.graph == mhagen.mha(32, 4, causal=causal, name=model.graph.name)
    expected_w = mhagen.weights_from_torch(m)
    for k in expected_w:
        assert np.array_equal(found.weights[k], expected_w[k]), k
    y_ort = run_ort(model, xt)
    kernel = mhagen.build(found.graph, "x86", batch=B, seq_len=S, weights=found.weights)
    y = kernel(x)
    assert_close(y, y_ort if batch_first else y_ort.transpose(1, 0, 2))


def ms_mha_model(w, causal, heads=4, d_model=32):
    """x -> MatMul W_q/W_k/W_v -> com.microsoft.MultiHeadAttention(bias) -> MatMul W_o + b_o
    (as onnxruntime's transformer optimizer fuses a layer)."""
    inits = [nh.from_array(np.concatenate(list(w[f"w_{r}"]), axis=1), f"W{r}") for r in "qkv"]
    inits += [nh.from_array(np.concatenate([w[f"b_{r}"].reshape(-1) for r in "qkv"]), "bqkv"),
              nh.from_array(w["w_o"], "Wo"), nh.from_array(w["b_o"], "bo")]
    nodes = [oh.make_node("MatMul", ["x", f"W{r}"], [r], name=f"proj_{r}") for r in "qkv"]
    nodes += [oh.make_node("MultiHeadAttention", ["q", "k", "v", "bqkv"], ["att"],
                           domain="com.microsoft", name="mha", num_heads=heads,
                           unidirectional=int(causal)),
              oh.make_node("MatMul", ["att", "Wo"], ["o"], name="out"),
              oh.make_node("Add", ["o", "bo"], ["y"], name="out_bias")]
    g = oh.make_graph(nodes, "ms", [oh.make_tensor_value_info("x", TP.FLOAT,
                                                              ["batch", "seq", d_model])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", d_model])],
                      inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17),
                                           oh.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "unidirectional"])
def test_import_ms_multihead_attention(causal):
    layer = mhagen.mha(32, 4, causal=causal, name="ms")
    w = layer.init_weights(3)
    model = ms_mha_model(w, causal)
    (found,) = import_onnx(model)
    assert found.source == "com.microsoft.MultiHeadAttention" and found.graph == layer
    assert found.nodes == ("proj_q", "proj_k", "proj_v", "mha", "out", "out_bias")
    x = rand_x(32)
    y_ort = run_ort(model, x)
    assert_close(y_ort, layer.reference(x, w))
    if causal:
        kernel = mhagen.build(found.graph, "x86", batch=B, seq_len=S, weights=found.weights)
        assert_close(kernel(x), y_ort)
    else:
        assert_close(found.graph.reference(x, found.weights), y_ort)


# -- import errors: the node and the reason ------------------------------------------------
def hand_model(*, scores_hook=None, q_hook=None, kv_input="x", extra_inputs=(),
               attention=None, d=8, seq=4):
    """Single-head attention by hand: x [1, seq, d] -> y; hooks splice in extra nodes."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((d, d)).astype(np.float32), f"W{r}")
             for r in "qkvo"] + [nh.from_array(np.float32(d ** -0.5), "scale")]
    nodes, q = [oh.make_node("MatMul", ["x", "Wq"], ["q"], name="proj_q")], "q"
    if q_hook:
        q = q_hook(nodes, inits, q)
    nodes += [oh.make_node("MatMul", [kv_input, "Wk"], ["k"], name="proj_k"),
              oh.make_node("MatMul", [kv_input, "Wv"], ["v"], name="proj_v")]
    if attention is not None:
        nodes.append(attention)
        o = attention.output[0]
    else:
        nodes += [oh.make_node("Transpose", ["k"], ["kT"], name="kT", perm=[0, 2, 1]),
                  oh.make_node("MatMul", [q, "kT"], ["s"], name="scores"),
                  oh.make_node("Mul", ["s", "scale"], ["s1"], name="scaled")]
        s = scores_hook(nodes, inits, "s1") if scores_hook else "s1"
        nodes += [oh.make_node("Softmax", [s], ["p"], name="softmax", axis=-1),
                  oh.make_node("MatMul", ["p", "v"], ["o"], name="pv")]
        o = "o"
    nodes.append(oh.make_node("MatMul", [o, "Wo"], ["y"], name="out"))
    inputs = [oh.make_tensor_value_info(n, TP.FLOAT, shape)
              for n, shape in [("x", [1, seq, d]), *extra_inputs]]
    g = oh.make_graph(nodes, "hand", inputs, [oh.make_tensor_value_info("y", TP.FLOAT, None)],
                      inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 23),
                                           oh.make_opsetid("com.microsoft", 1)])


def _add(name, tensor):
    def hook(nodes, inits, s):
        inits.append(nh.from_array(tensor, name + "_c"))
        nodes.append(oh.make_node("Add", [s, name + "_c"], [name], name=name))
        return name
    return hook


def _pad_mask(nodes, inits, s):
    nodes.append(oh.make_node("Add", [s, "pad"], ["padded"], name="add_padding"))
    return "padded"


def _rotary(nodes, inits, q):
    inits.append(nh.from_array(np.cos(np.arange(32, dtype=np.float32)).reshape(4, 8), "cos"))
    nodes.append(oh.make_node("Mul", [q, "cos"], ["q_rot"], name="rotate_q"))
    return "q_rot"


def _no_attention():
    x = oh.make_tensor_value_info("x", TP.FLOAT, [1, 4, 8])
    w = nh.from_array(np.ones((8, 8), np.float32), "W")
    g = oh.make_graph([oh.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                       oh.make_node("Relu", ["h"], ["y"], name="relu")], "mlp", [x],
                      [oh.make_tensor_value_info("y", TP.FLOAT, None)], [w])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)])


position_bias = (np.arange(4)[None, :] * np.arange(4)[:, None]).astype(np.float32) * 0.5
ERROR_MODELS = {
    "no-attention": (_no_attention, "no attention found in ONNX model 'mlp'"),
    "padding-mask-input": (lambda: hand_model(scores_hook=_pad_mask, extra_inputs=[
        ("pad", [1, 1, 4])]), "Add node 'add_padding'.*model input.*'pad'.*padding mask"),
    # a bias that depends on the positions, not their distance alone
    "position-bias": (lambda: hand_model(scores_hook=_add("pos", position_bias)),
                      "softmax.*head 0's additive bias is neither a linear distance bias"),
    "cross-attention": (lambda: hand_model(kv_input="mem", extra_inputs=[("mem", [1, 4, 8])]),
                        "Softmax node 'softmax': Q projects 'x' but K projects 'mem' "
                        r"\(cross-attention\)"),
    "rotary": (lambda: hand_model(q_hook=_rotary), "not an affine function.*rotary"),
    "kv-cache": (lambda: hand_model(attention=oh.make_node(
        "Attention", ["q", "k", "v", "", "past_k", "past_v"], ["o"], name="att",
        q_num_heads=1, kv_num_heads=1), extra_inputs=[("past_k", [1, 1, 2, 8]),
                                                      ("past_v", [1, 1, 2, 8])]),
        "Attention node 'att': past_key/past_value"),
    "softcap": (lambda: hand_model(attention=oh.make_node(
        "Attention", ["q", "k", "v"], ["o"], name="att", q_num_heads=1, kv_num_heads=1,
        softcap=30.0)), "Attention node 'att': softcap=30.0 is not supported"),
    "ms-packed-attention": (lambda: hand_model(attention=oh.make_node(
        "Attention", ["x", "Wq"], ["o"], name="msatt", domain="com.microsoft", num_heads=1)),
        r"Attention node 'msatt' \(com.microsoft.Attention\)"),
}


@pytest.mark.parametrize("name", list(ERROR_MODELS))
def test_import_errors_name_the_node_and_reason(name):
    make, fragment = ERROR_MODELS[name]
    with pytest.raises(OnnxError, match=fragment):
        import_onnx(make())


def test_import_of_a_bare_hand_model_works():
    # the error models above differ from this one only by what makes them fail
    (found,) = import_onnx(hand_model())
    x = rand_x(8, 1, 4)
    assert_close(found.graph.reference(x, found.weights), run_ort(hand_model(), x))
    assert found.graph.options["num_heads"] == 1


def test_import_bad_path(tmp_path):
    with pytest.raises(OnnxError, match="no ONNX model at"):
        import_onnx(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(OnnxError, match="not a readable ONNX model"):
        import_onnx(tmp_path / "junk.onnx")


# -- CLI, package hygiene, example ---------------------------------------------------------
@pytest.fixture
def cli():
    """The sub-commands, wired as mhagen/cli.py does (main() prints MhagenError as one line
    and exits 2)."""
    from mhagen import cli as main_cli
    from mhagen.onnx.cli import add_parsers
    p = main_cli._Parser(prog="mhagen")
    sub = p.add_subparsers(dest="command", parser_class=main_cli._Parser)
    handlers = add_parsers(sub, main_cli._layer_options, main_cli._layer)
    assert set(handlers) == {"export-onnx", "import-onnx"}

    def run(*argv):
        args = p.parse_args([str(a) for a in argv])
        return handlers[args.command](args)
    return run


def test_cli_export_check_import_and_reexport(cli, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert cli("export-onnx", "--d-model", 32, "--heads", 4, "--kv-heads", 2, "--causal",
               "--form", "fused", "--seq-len", 9, "--batch", 2, "--out", out, "--check") == 0
    text = capsys.readouterr().out
    assert "fused form, opset 23" in text and " ok" in text
    assert cli("import-onnx", out, "--out", tmp_path / "found", "--show") == 0
    text = capsys.readouterr().out
    assert "1 attention layer" in text and "kv_heads=2, causal=True" in text
    assert "output_projection" in text       # --show prints the graph
    js, npz = tmp_path / "found" / "mha.json", tmp_path / "found" / "mha.npz"
    assert js.is_file() and npz.is_file()
    again = tmp_path / "again.onnx"
    assert cli("export-onnx", "--graph", js, "--weights", npz, "--dynamic-batch",
               "--dynamic-seq", "--out", again, "--seq-len", 5, "--check") == 0
    assert "weights from" in capsys.readouterr().out
    x = rand_x(32, 2, 9)
    assert_close(run_ort(again, x), run_ort(out, x))


def two_scale_graph():
    g = mhagen.Graph("two_scales")
    x = g.input("x", 16)
    outs = [g.weighted_sum(g.softmax(g.scale(g.scores(g.head_projection(x, "w_q", h, 8),
                                                      g.head_projection(x, "w_k", h, 8)),
                                             0.1 * (h + 1))), g.head_projection(x, "w_v", h, 8))
            for h in range(2)]
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 16))
    return g


def test_cli_errors(cli, tmp_path):
    (tmp_path / "g.json").write_text(two_scale_graph().to_json())
    onnx.save(_no_attention(), str(tmp_path / "mlp.onnx"))
    with pytest.raises(OnnxError, match="heads use different scales.*--form decomposed"):
        cli("export-onnx", "--graph", tmp_path / "g.json", "--form", "fused", "--out",
            tmp_path / "x.onnx")
    with pytest.raises(mhagen.InputError, match="cannot read weights"):
        cli("export-onnx", "--weights", tmp_path / "none.npz", "--out", tmp_path / "x.onnx")
    with pytest.raises(mhagen.InputError, match="cannot read"):
        cli("export-onnx", "--graph", tmp_path / "none.json", "--out", tmp_path / "x.onnx")
    with pytest.raises(OnnxError, match="no attention found"):
        cli("import-onnx", tmp_path / "mlp.onnx")
    with pytest.raises(SystemExit):
        cli("export-onnx", "--form", "bogus", "--out", tmp_path / "x.onnx")


def test_package_imports_neither_tvm_nor_onnx():
    code = ("import sys, mhagen, mhagen.onnx, mhagen.onnx.cli; "
            "print(sorted(m for m in ('tvm', 'onnx', 'onnxruntime') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_example_script():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "onnx_roundtrip.py"),
                        "--d-model", "64", "--heads", "4", "--seq-len", "16", "--causal",
                        "--form", "fused"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    errors = {k: float(v) for k, v in
              (ln.rsplit(":", 1) for ln in r.stdout.splitlines() if "max error:" in ln)}
    assert len(errors) == 4 and max(errors.values()) < 1e-4, r.stdout
    assert "latency: onnxruntime" in r.stdout and "same graph as exported: True" in r.stdout
