"""mhagen.mha(..., scale=): the score scale as an option (T5: 1.0, Gemma 2:
query_pre_attn_scalar ** -0.5). The reference against a hand-written float64 layer; every
compiled path (fused prefill, decoding, cross-attention, key padding, any length, half
precision, unfused; the CUDA templates' TIR) against the reference, each at a scale whose
output differs from the default's by far more than the tolerance (a path that ignored the
scale fails); ONNX export and import, the graph JSON, print(), the command line and the C
header."""
import json
import math

import numpy as np
import pytest

import mhagen
from mhagen.errors import GraphError
from mhagen.tolerances import assert_close, tolerance, within_half_reference
from tests.conftest import in_chunks, mha_by_hand, random_input

SCALES = [1.0, 0.0625]


def _differs_from_default(layer, x, w, **call):
    """The layer's reference, checked to be far (100 tolerances) from the default scale's."""
    opts = {k: v for k, v in layer.options.items() if k not in ("scale", "rotary", "mask",
                                                                "score_mod")}
    default = mhagen.mha(**opts, rotary=layer.options.get("rotary") and mhagen.rotary(
        **layer.options["rotary"]))
    y = layer.reference(x, w, **call)
    assert mhagen.max_error(default.reference(x, w, **call), y) > 100 * tolerance(y)
    return y


# -- the option ----------------------------------------------------------------------------
def test_default_is_one_over_sqrt_head_dim_and_left_out_of_the_options():
    layer = mhagen.mha(80, 2, head_dim=40)
    assert "scale" not in layer.options
    assert mhagen.mha(80, 2, head_dim=40, scale=1 / math.sqrt(40)) == layer
    # 8 ** -0.5 differs from 1 / sqrt(8) in the last bit: still the default
    assert 8 ** -0.5 != 1 / math.sqrt(8)
    assert mhagen.mha(64, 8, scale=8 ** -0.5) == mhagen.mha(64, 8)
    factors = {n.attrs["factor"] for n in layer.nodes if n.kind == "scale"}
    assert factors == {1 / math.sqrt(40)}
    t5 = mhagen.mha(80, 2, head_dim=40, scale=1)
    assert t5.options["scale"] == 1.0 and isinstance(t5.options["scale"], float)
    assert {n.attrs["factor"] for n in t5.nodes if n.kind == "scale"} == {1.0}
    assert "scale=1.0" in repr(t5) and "factor=1 " in str(t5)
    assert "factor=0.0625" in str(mhagen.mha(64, 2, scale=np.float32(0.0625)))


@pytest.mark.parametrize("bad, fragment", [
    (float("nan"), "positive finite number, got nan"),
    (float("inf"), "positive finite number, got inf"),
    (0.0, "positive finite number, got 0.0"),
    (-0.125, "positive finite number, got -0.125"),
    (True, "takes a number"), ("1.0", "takes a number"), ([1.0], "takes a number")])
def test_bad_scales_are_refused(bad, fragment):
    with pytest.raises(GraphError, match=fragment) as info:
        mhagen.mha(64, 2, scale=bad)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("scale", SCALES)
def test_reference_matches_a_layer_written_by_hand(scale):
    """GQA, causal, head_dim 40, seq 97: the reference against the standard layer in float64
    numpy with the scores scaled by `scale` instead of 1/sqrt(40)."""
    layer = mhagen.mha(160, 4, head_dim=40, kv_heads=2, causal=True, scale=scale)
    w = layer.init_weights(0)
    x = random_input(layer, 2, 97).astype(np.float64)
    by_hand = mha_by_hand(w, x, 4, causal=True,
                          modify=lambda s, h, i, j: s * math.sqrt(40) * scale)
    np.testing.assert_allclose(_differs_from_default(layer, x, w), by_hand, atol=1e-10)


# -- compiled paths ------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("scale", SCALES)
def test_fused_prefill_with_softcap(target, scale):
    """Gemma 2's shape of the problem: a scale then a softcap, seq 97, head_dim 40."""
    layer = mhagen.mha(80, 2, head_dim=40, causal=True, scale=scale,
                       score_mod=mhagen.softcap(5.0))
    w = layer.init_weights(1)
    x = random_input(layer, 2, 97)
    m = mhagen.build(layer, target, batch=2, seq_len=97, weights=w, tuning=None)
    assert m.program.fusion.startswith("fused")
    assert_close(m(x), _differs_from_default(layer, x, w))


def test_unfused_and_any_length_builds():
    layer = mhagen.mha(80, 2, head_dim=40, kv_heads=1, scale=1.0)
    w = layer.init_weights(2)
    x = random_input(layer, 2, 97)
    unfused = mhagen.build(layer, "x86", batch=2, seq_len=97, weights=w, fuse=False,
                           tuning=None)
    assert not unfused.program.fusion.startswith("fused")
    assert_close(unfused(x), _differs_from_default(layer, x, w))
    any_length = mhagen.build(layer, "x86", batch=2, seq_len=None, max_seq_len=40, weights=w,
                              tuning=None)
    for seq in (1, 17, 40):
        x = random_input(layer, 2, seq, seed=seq)
        assert_close(any_length(x), layer.reference(x, w))


def test_attention_maps():
    """The probabilities softmax(Q K^T * scale) of each head, written out here."""
    layer = mhagen.mha(32, 2, causal=True, scale=1.0)
    w = layer.init_weights(9)
    m = mhagen.build(layer, "x86", batch=1, seq_len=7, weights=w, tuning=None)
    x = random_input(layer, 1, 7)
    p = m.attention_maps(x)
    xs = x[0].astype(np.float64)
    for h in range(2):
        q, k = (xs @ w[f"w_{r}"][h] + w[f"b_{r}"][h] for r in "qk")
        s = np.where(np.tril(np.ones((7, 7), bool)), q @ k.T, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        assert_close(p[0, h], e / e.sum(-1, keepdims=True))


def test_decoding_with_rotary_and_a_cache():
    """Prefill of 7 then steps of 1 on a cache, rotary on Q and K: every output against the
    reference fed the same chunks."""
    layer = mhagen.mha(80, 2, head_dim=40, causal=True, rotary=True, kv_cache=32, scale=1.0)
    w = layer.init_weights(3)
    x = random_input(layer, 2, 10, seed=4)
    expected = in_chunks(layer, None, w, x, [7, 1, 1, 1], mhagen.KVCache.empty(layer, 2))
    assert mhagen.max_error(expected, in_chunks(
        mhagen.mha(80, 2, head_dim=40, causal=True, rotary=True, kv_cache=32), None, w, x,
        [7, 1, 1, 1], mhagen.KVCache.empty(layer, 2))) > 100 * tolerance(expected)
    modules = {n: mhagen.build(layer, "x86", batch=2, seq_len=n, weights=w, tuning=None)
               for n in (7, 1)}
    cache, outs, t = modules[7].new_cache(), [], 0
    for n in (7, 1, 1, 1):
        outs.append(modules[n](x[:, t:t + n], cache=cache))
        t += n
    assert_close(np.concatenate(outs, axis=1), expected)


def test_cross_attention_and_key_padding():
    cross = mhagen.mha(64, 2, cross=True, kv_dim=40, scale=1.0)
    w = cross.init_weights(4)
    x, context = random_input(cross, 2, 9), np.random.default_rng(5).standard_normal(
        (2, 13, 40)).astype(np.float32)
    m = mhagen.build(cross, "x86", batch=2, seq_len=9, kv_seq_len=13, weights=w, tuning=None)
    assert_close(m(x, context=context), _differs_from_default(cross, x, w, context=context))
    padded = mhagen.mha(64, 2, key_padding=True, scale=0.0625)
    w = padded.init_weights(5)
    x, lens = random_input(padded, 2, 16), np.array([16, 5], np.int32)
    m = mhagen.build(padded, "x86", batch=2, seq_len=16, weights=w, tuning=None)
    assert_close(m(x, kv_lens=lens), _differs_from_default(padded, x, w, kv_lens=lens))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    """Within 2x the error of a reference with every value rounded to the dtype
    (FlashAttention's criterion); float16 within the tolerance table too. (bfloat16 on
    AVX-512 BF16 rounds Q and K to bfloat16: scores scaled by 1.0 rather than 1/sqrt(40)
    carry 6x their rounding, past the table's row, set at the default scale.)"""
    layer = mhagen.mha(80, 2, head_dim=40, causal=True, scale=1.0, dtype=dtype)
    w = layer.init_weights(6)
    x = random_input(layer, 2, 33).astype(w["w_q"].dtype)
    m = mhagen.build(layer, "x86", batch=2, seq_len=33, weights=w, tuning=None)
    expected = layer.reference(x, w)
    assert mhagen.max_error(mhagen.mha(80, 2, head_dim=40, causal=True, dtype=dtype)
                            .reference(x, w), expected) > 20 * tolerance(expected, dtype)
    y = m(x)
    err, bound = within_half_reference(y, expected, layer.reference(x, w, rounded_to=dtype))
    assert err <= bound, f"error {err:.3g} > 2x the half-precision reference's ({bound:.3g})"
    if dtype == "float16":
        assert_close(y, expected, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_attention_templates_scale_by_the_option(dtype):
    """The CUDA attention template's TIR (float16: the tensor-core one) multiplies Q K^T by
    scale * log2(e) (lowering only: compiling it is tests/test_cuda.py's)."""
    import re

    from mhagen.lower import lower
    from mhagen.schedules.cuda.attention import CudaAttentionRule
    from mhagen.target import resolve
    target = resolve("cuda-sm90")
    program = lower(mhagen.mha(64, 2, scale=0.0625, dtype=dtype), 1, 16, target)
    w = next(k for k in program.kernels if k.name == "attention").workload
    rule = CudaAttentionRule()
    assert rule.tensor_cores(w) == (dtype == "float16")
    tir = rule.build(w, rule.default_config(w, target), target).script()
    constants = {float(c) for c in re.findall(r"T\.float32\(([-0-9.e]+)\)", tir)}
    assert any(math.isclose(c, 0.0625 * math.log2(math.e), rel_tol=1e-6) for c in constants)
    assert not any(math.isclose(c, math.log2(math.e) / math.sqrt(32), rel_tol=1e-6)
                   for c in constants)


# -- formats -------------------------------------------------------------------------------
def test_graph_json_round_trip_keeps_the_scale():
    layer = mhagen.mha(64, 2, scale=1.0, causal=True)
    again = mhagen.Graph.from_json(layer.to_json())
    assert again == layer and again.options["scale"] == 1.0
    assert json.loads(layer.to_json())["options"]["scale"] == 1.0
    w, x = layer.init_weights(0), random_input(layer, 1, 5)
    assert_close(again.reference(x, w), layer.reference(x, w))


@pytest.mark.parametrize("form", ["fused", "decomposed"])
def test_onnx_export_and_import(form, tmp_path):
    """Exported (the fused form: Attention's scale attribute), run in onnxruntime, imported
    back as the same mha(scale=...) graph with the same weights."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from mhagen.onnx import export_onnx, import_onnx
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, scale=1.0)
    w = layer.init_weights(7)
    path = export_onnx(layer, tmp_path / "m.onnx", w, form=form, batch=2, seq_len=7)
    if form == "fused":
        (att,) = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Attention"]
        assert {a.name: a.f for a in att.attribute}["scale"] == 1.0
    x = random_input(layer, 2, 7)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert_close(sess.run(None, {"x": x})[0], _differs_from_default(layer, x, w))
    (found,) = import_onnx(path)
    assert found.graph == layer, found.graph
    assert all(np.array_equal(found.weights[k], w[k]) for k in w)


def test_fused_onnx_export_refuses_a_scale_attention_cannot_carry(tmp_path):
    """A graph built head by head may scale by any finite number; the Attention operator
    (and onnxruntime) take a positive scale only: refused, nothing written."""
    from mhagen.dsl import add_heads
    from mhagen.onnx import OnnxError, export_onnx
    g = mhagen.Graph("negative")
    g.set_output(add_heads(g, g.input("x", 32), [-0.5] * 2, [None] * 2, 2, 16, 32, True))
    with pytest.raises(OnnxError, match="positive scale only: export it with "
                                        "form='decomposed'"):
        export_onnx(g, tmp_path / "m.onnx", g.init_weights(0), form="fused", seq_len=4)
    assert not (tmp_path / "m.onnx").exists()


def test_command_line_scale(tmp_path, capsys):
    """--scale: the graph printed with it, a build checked against the reference and its C
    header's layer line, a decoding layer's fused ONNX export checked in onnxruntime."""
    from mhagen.cli import main
    assert main(["inspect", "--d-model", "64", "--heads", "2", "--scale", "1", "--what",
                 "graph"]) == 0
    assert "factor=1 " in capsys.readouterr().out
    assert main(["build", "--d-model", "64", "--heads", "2", "--causal", "--scale", "0.0625",
                 "--seq-len", "9", "--repeat", "1", "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "scale=0.0625" in out and " ok" in out
    assert "scale=0.0625" in (tmp_path / "m" / "mha.h").read_text()
    pytest.importorskip("onnxruntime")
    assert main(["export-onnx", "--d-model", "64", "--heads", "4", "--causal", "--kv-cache",
                 "16", "--seq-len", "2", "--form", "fused", "--scale", "1.0", "--out",
                 str(tmp_path / "d.onnx"), "--check"]) == 0
    assert "onnxruntime vs float64 reference" in capsys.readouterr().out
    assert main(["build", "--scale", "nan"]) == 2
    assert "scale= must be a positive finite number" in capsys.readouterr().err
