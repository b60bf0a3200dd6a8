"""Rotary position embeddings (RoPE, LLaMA's half-split layout): reference semantics against
hand-written numpy and torch, the fused path's in-place rotary kernel and the unfused path on
x86, CUDA compile-only, fusion decisions, JSON, ONNX decomposed export, save/load."""
import math

import numpy as np
import pytest
from conftest import mha_by_hand, random_input

import mhagen
from mhagen.errors import GraphError
from mhagen.passes import run_passes
from mhagen.schedules.cuda.nvcc import missing_tools
from mhagen.target import resolve
from mhagen.tolerances import assert_close


def numpy_rope(x, rotary_dim, base):
    """RoPE written out pair by pair (positions along axis 1), independent of mhagen."""
    y = x.copy()
    half = rotary_dim // 2
    for t in range(x.shape[1]):
        for i in range(half):
            angle = t / base ** (2 * i / rotary_dim)
            a, b = x[:, t, i], x[:, t, i + half]
            y[:, t, i] = a * math.cos(angle) - b * math.sin(angle)
            y[:, t, i + half] = b * math.cos(angle) + a * math.sin(angle)
    return y


@pytest.mark.parametrize("head_dim,rotary_dim,base", [(8, None, 10000.0), (10, 6, 500.0)])
def test_reference_is_rope_by_hand(head_dim, rotary_dim, base):
    layer = mhagen.mha(24, 6, head_dim=head_dim, kv_heads=3, causal=True,
                       rotary=mhagen.rotary(base=base, rotary_dim=rotary_dim))
    w, x = layer.init_weights(1), random_input(layer, 2, 13)
    expected = mha_by_hand(w, x, 6, causal=True,
                           rotate=lambda t: numpy_rope(t, rotary_dim or head_dim, base))
    np.testing.assert_allclose(layer.reference(x, w), expected, rtol=1e-12, atol=1e-12)
    plain = mhagen.mha(24, 6, head_dim=head_dim, kv_heads=3, causal=True)
    assert mhagen.max_error(plain.reference(x, w), expected) > 1e-3, "the rotation matters"


def test_reference_matches_torch_rotate_half():
    """Hugging Face LLaMA's formulation (rotate_half, cos/sin over the whole rotary width)
    with torch's SDPA, partial rotary as GPT-NeoX (rotate the first rotary_dim dims)."""
    torch = pytest.importorskip("torch")
    heads, kv_heads, d, rd, base, seq = 4, 2, 16, 8, 10000.0, 9
    layer = mhagen.mha(64, heads, kv_heads=kv_heads, causal=True,
                       rotary=mhagen.rotary(rotary_dim=rd))
    w, x = layer.init_weights(3), random_input(layer, 2, seq)
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    xt = torch.from_numpy(x).double()

    def rotate_half(v):
        return torch.cat((-v[..., rd // 2:], v[..., :rd // 2]), dim=-1)
    inv_freq = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)

    def rope(v):
        rot, keep = v[..., :rd], v[..., rd:]
        return torch.cat((rot * emb.cos() + rotate_half(rot) * emb.sin(), keep), dim=-1)
    q = torch.stack([rope(xt @ t["w_q"][h] + t["b_q"][h]) for h in range(heads)], 1)
    k = torch.stack([rope(xt @ t["w_k"][h // 2] + t["b_k"][h // 2]) for h in range(heads)], 1)
    v = torch.stack([xt @ t["w_v"][h // 2] + t["b_v"][h // 2] for h in range(heads)], 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = o.transpose(1, 2).reshape(2, seq, heads * d) @ t["w_o"] + t["b_o"]
    np.testing.assert_allclose(layer.reference(x, w), y.numpy(), rtol=1e-10, atol=1e-10)


CASES = {  # awkward shapes: seq 97, head_dim 40 (padded to the lanes), grouped K/V, causal
    "d40-full-gqa-causal": (dict(d_model=320, num_heads=8, head_dim=40, kv_heads=2,
                                 causal=True), mhagen.rotary()),
    "d64-rot32": (dict(d_model=256, num_heads=4, head_dim=64), mhagen.rotary(rotary_dim=32)),
    "d40-rot20-base500": (dict(d_model=160, num_heads=4, head_dim=40, kv_heads=1),
                          mhagen.rotary(base=500.0, rotary_dim=20)),
}


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_kernels_match_the_reference(target, case):
    t = resolve(target)
    if not t.runs_here():
        pytest.skip(f"{target} code cannot run on this CPU: {t.cannot_run()} "
                    "(tests/test_target_resolution.py checks the error)")
    options, rotary = CASES[case]
    layer = mhagen.mha(**options, rotary=rotary)
    w, x = layer.init_weights(2), random_input(layer, 2, 97)
    m = mhagen.build(layer, target, batch=2, seq_len=97, weights=w)
    assert m.program.fusion.startswith("fused")
    assert [k.name for k in m.program.kernels] == ["qkv_projection", "rotary", "attention",
                                                   "output_projection"]
    assert_close(m(x), layer.reference(x, w))


def test_unfused_path_matches_the_reference():
    layer = mhagen.mha(80, 4, head_dim=20, kv_heads=2, causal=True,
                       rotary=mhagen.rotary(rotary_dim=12))
    w, x = layer.init_weights(0), random_input(layer, 2, 17)
    m = mhagen.build(layer, "x86-avx2" if not resolve("x86").runs_here() else "x86",
                     batch=2, seq_len=17, weights=w, fuse=False)
    assert m.program.fusion.startswith("not fused")
    assert_close(m(x), layer.reference(x, w))


def test_saved_module_keeps_the_cos_sin_table(tmp_path):
    target = "x86-avx2" if not resolve("x86").runs_here() else "x86"
    layer = mhagen.mha(64, 4, causal=True, rotary=True)
    w, x = layer.init_weights(0), random_input(layer, 1, 33)
    mhagen.build(layer, target, batch=1, seq_len=33, weights=w).save(tmp_path / "m")
    assert_close(mhagen.load(tmp_path / "m")(x), layer.reference(x, w))


@pytest.mark.skipif(bool(missing_tools()), reason="the CUDA toolkit is not on the PATH")
def test_cuda_rotary_kernel_compiles_without_spills():
    layer = mhagen.mha(512, 8, kv_heads=2, causal=True, rotary=mhagen.rotary(rotary_dim=32))
    m = mhagen.build(layer, "cuda-sm90", batch=1, seq_len=97, tuning=None)
    code = m.info.device_code
    assert sorted(code.entries()) == sorted(f"{k.name}_kernel" for k in m.program.kernels)
    assert "rotary_kernel" in code.entries()
    for entry, r in code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)


def partial_rotary_graph(rotated_heads, rotary_dims=None):
    """Two heads, rotary on the Q and K of `rotated_heads` only (rotary_dims per head)."""
    g = mhagen.Graph("partial")
    x = g.input("x", 32)
    outs = []
    for h in range(2):
        q = g.head_projection(x, "w_q", h, 16)
        k = g.head_projection(x, "w_k", h, 16)
        v = g.head_projection(x, "w_v", h, 16)
        if h in rotated_heads:
            rd = (rotary_dims or {}).get(h)
            q, k = g.rotary(q, rotary_dim=rd), g.rotary(k, rotary_dim=rd)
        outs.append(g.weighted_sum(g.softmax(g.scale(g.scores(q, k), 0.25)), v))
    return g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 32))


def test_fusion_accepts_rotary_on_every_head_and_refuses_partial():
    fused = run_passes(mhagen.mha(32, 2, bias=False, rotary=True), fuse=True)
    assert fused.fused
    assert fused.graph.node("attention").attrs["rotary"] == {"base": 10000.0, "rotary_dim": 16}
    assert run_passes(partial_rotary_graph({0, 1}), fuse=True).fused
    for g in (partial_rotary_graph({0}), partial_rotary_graph({0, 1}, {0: 8, 1: 16})):
        result = run_passes(g, fuse=True)
        assert not result.fused and "rotary" in result.reason, result.reason
    # the refused graph still compiles (unfused) and is right
    g = partial_rotary_graph({0})
    w, x = g.init_weights(0), random_input(g, 1, 7)
    m = mhagen.build(g, "x86-avx2" if not resolve("x86").runs_here() else "x86", batch=1,
                     seq_len=7, weights=w)
    assert m.program.fusion.startswith("not fused")
    assert_close(m(x), g.reference(x, w))


def test_bad_rotary_options_are_refused_clearly():
    with pytest.raises(GraphError, match="even int"):
        mhagen.rotary(rotary_dim=7)
    with pytest.raises(GraphError, match="exceeds the head width"):
        mhagen.mha(32, 2, rotary=mhagen.rotary(rotary_dim=32))
    with pytest.raises(GraphError, match="base must be a number > 1"):
        mhagen.rotary(base=1.0)
    with pytest.raises(GraphError, match="rotary= takes"):
        mhagen.mha(32, 2, rotary=16)
    with pytest.raises(GraphError, match="even"):
        mhagen.mha(30, 2, rotary=True)     # head_dim 15: no whole pairs


def test_graph_json_round_trip_keeps_rotary():
    layer = mhagen.mha(48, 4, kv_heads=2, rotary=mhagen.rotary(base=500.0, rotary_dim=6))
    assert mhagen.Graph.from_json(layer.to_json()) == layer
    fused = run_passes(layer, fuse=True).graph
    assert mhagen.Graph.from_json(fused.to_json()) == fused


@pytest.mark.parametrize("dynamic", [False, True])
def test_onnx_decomposed_export_runs_in_onnxruntime(tmp_path, dynamic):
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(48, 6, head_dim=10, kv_heads=2, causal=True,
                       rotary=mhagen.rotary(base=500.0, rotary_dim=6))
    w, x = layer.init_weights(0), random_input(layer, 2, 11)
    for graph in (layer, run_passes(layer, fuse=True).graph):
        path = mhagen.export_onnx(graph, tmp_path / "m.onnx", weights=w, seq_len=11, batch=2,
                                  dynamic_seq=dynamic, dynamic_batch=dynamic)
        session = ort.InferenceSession(str(path))
        assert_close(session.run(None, {"x": x})[0], layer.reference(x, w))
        if dynamic:   # the tables follow the sequence length
            x2 = random_input(layer, 1, 23, seed=1)
            assert_close(session.run(None, {"x": x2})[0], layer.reference(x2, w))
    with pytest.raises(mhagen.onnx.OnnxError, match="rotary.*form='decomposed'"):
        mhagen.export_onnx(layer, tmp_path / "f.onnx", weights=w, seq_len=11, form="fused")
