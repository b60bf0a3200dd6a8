"""Score modifiers (FlexAttention's score_mod): ALiBi, softcap, any numeric expression of the
scaled score and the indices; reference semantics, the fused template's hook, the unfused
path, fusion rules, ONNX export."""
import math
import warnings

import numpy as np
import pytest
from conftest import mha_by_hand, random_input

import mhagen
from mhagen.errors import GraphError
from mhagen.ir import expr as ex
from mhagen.passes import run_passes
from mhagen.target import resolve
from mhagen.tolerances import assert_close


def paper_slopes(n):
    """ALiBi's get_slopes from the paper's reference code (Press et al., 2022)."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][:n - closest]


@pytest.mark.parametrize("heads", [1, 4, 6, 8, 12, 16])
def test_alibi_slopes_are_the_papers(heads):
    np.testing.assert_allclose(ex.alibi_slopes(heads), paper_slopes(heads), rtol=1e-12)
    if heads & (heads - 1) == 0:
        assert ex.alibi_slopes(heads) == [2 ** (-8 * (h + 1) / heads) for h in range(heads)]


MODS = {
    "alibi": (lambda H: mhagen.alibi(H),
              lambda H: lambda s, h, i, j: s + ex.alibi_slopes(H)[h] * (j - i)),
    "softcap": (lambda H: mhagen.softcap(2.0),
                lambda H: lambda s, h, i, j: 2.0 * np.tanh(s / 2.0)),
    "alibi-then-softcap": (lambda H: [mhagen.alibi(H), mhagen.softcap(2.0)],
                           lambda H: lambda s, h, i, j: 2.0 * np.tanh(
                               (s + ex.alibi_slopes(H)[h] * (j - i)) / 2.0)),
}


@pytest.mark.parametrize("name", sorted(MODS))
def test_reference_semantics(name):
    make, numpy_mod = MODS[name]
    layer = mhagen.mha(48, 6, kv_heads=3, causal=True, score_mod=make(6))
    w, x = layer.init_weights(1), random_input(layer, 2, 13)
    np.testing.assert_allclose(layer.reference(x, w),
                               mha_by_hand(w, x, 6, causal=True, modify=numpy_mod(6)),
                               rtol=1e-12, atol=1e-12)


def test_modifiers_combine_in_order():
    capped_first = mhagen.combine(mhagen.softcap(2.0), mhagen.alibi(4))
    alibi_first = mhagen.combine(mhagen.alibi(4), mhagen.softcap(2.0))
    assert capped_first != alibi_first
    assert repr(alibi_first).startswith("(2.0 * tanh(((score + ")


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("name,causal", [("alibi", True), ("softcap", False),
                                         ("alibi-then-softcap", True)])
def test_fused_kernels_match_the_reference(target, name, causal):
    """Awkward shapes: seq 97 (193 causal: long enough for whole key blocks to be hidden),
    head_dim 40, grouped K/V; causal keeps skipping blocks."""
    t = resolve(target)
    if not t.runs_here():
        pytest.skip(f"{target} code cannot run on this CPU: {t.cannot_run()} "
                    "(tests/test_target_resolution.py checks the error)")
    make, _ = MODS[name]
    layer = mhagen.mha(320, 8, head_dim=40, kv_heads=2, causal=causal, score_mod=make(8))
    seq = 193 if causal else 97
    w, x = layer.init_weights(2), random_input(layer, 2, seq)
    m = mhagen.build(layer, target, batch=2, seq_len=seq, weights=w)
    assert m.program.fusion.startswith("fused")
    assert_close(m(x), layer.reference(x, w))
    if causal:
        table = m.bound_params["blocks"]
        assert (table == 0).any(), "causal blocks above the diagonal are still skipped"


def _torch_layer(torch, w, x, attend):
    """The layer in PyTorch (float64) from mhagen's weights: per-head projections, then
    attend(q, k, v) [batch, heads, seq, head_dim], then the output projection."""
    t = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in w.items()}
    xt = torch.from_numpy(x.astype(np.float64))
    q, k, v = (torch.einsum("bsd,hde->bhse", xt, t[f"w_{n}"]) + t[f"b_{n}"][None, :, None, :]
               for n in "qkv")
    o = attend(q, k, v)                                  # [batch, heads, seq, head_dim]
    return (o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1) @ t["w_o"] + t["b_o"]).numpy()


@pytest.mark.parametrize("name", sorted(MODS))
def test_modifiers_match_pytorch(name):
    """Cross-check with PyTorch: FlexAttention (eager, float64, on CPU) with the modifier as
    its score_mod, and ALiBi also as SDPA with an explicit float bias mask; the compiled
    layer and the reference both agree with it (causal, seq 23, head_dim 16)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import flex_attention
    heads, seq = 4, 23
    slopes = torch.tensor(ex.alibi_slopes(heads), dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        if name.startswith("alibi"):
            score = score + slopes[h] * (kv_idx - q_idx)
        if name.endswith("softcap"):
            score = 2.0 * torch.tanh(score / 2.0)
        return torch.where(kv_idx <= q_idx, score, -float("inf"))   # causal, after it

    layer = mhagen.mha(64, heads, causal=True, score_mod=MODS[name][0](heads))
    w, x = layer.init_weights(3), random_input(layer, 2, seq)
    target = "x86" if resolve("x86").runs_here() else "x86-avx2"
    compiled = mhagen.build(layer, target, batch=2, seq_len=seq, weights=w)(x)
    with warnings.catch_warnings():   # eager FlexAttention says (once) it is not compiled
        warnings.simplefilter("ignore")
        flex = _torch_layer(torch, w, x, lambda q, k, v: flex_attention(q, k, v,
                                                                        score_mod=score_mod))
    np.testing.assert_allclose(layer.reference(x, w), flex, rtol=1e-10, atol=1e-10)
    assert_close(compiled, flex)
    if name == "alibi":
        i = torch.arange(seq)
        bias = slopes[:, None, None] * (i[None, None, :] - i[None, :, None]).double()
        bias = bias.masked_fill(i[None, None, :] > i[None, :, None], -float("inf"))
        sdpa = _torch_layer(torch, w, x, lambda q, k, v:
                            torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, attn_mask=bias[None]))
        np.testing.assert_allclose(flex, sdpa, rtol=1e-10, atol=1e-10)


def test_unfused_path_matches_the_reference():
    layer = mhagen.mha(64, 4, causal=True, score_mod=[mhagen.alibi(4), mhagen.softcap(3.0)])
    w, x = layer.init_weights(0), random_input(layer, 1, 17)
    m = mhagen.build(layer, "x86-avx2" if not resolve("x86").runs_here() else "x86",
                     batch=1, seq_len=17, weights=w, fuse=False)
    assert m.program.fusion.startswith("not fused")
    assert_close(m(x), layer.reference(x, w))


def test_heads_with_different_modifiers_do_not_fuse_and_say_why():
    g = mhagen.Graph("mixed")
    x = g.input("x", 32)
    outs = []
    for h, cap in enumerate((2.0, 3.0)):
        q = g.head_projection(x, "w_q", h, 16)
        k = g.head_projection(x, "w_k", h, 16)
        v = g.head_projection(x, "w_v", h, 16)
        s = g.score_mod(g.scale(g.scores(q, k), 0.25), mhagen.softcap(cap), head=h)
        outs.append(g.weighted_sum(g.softmax(s), v))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 32))
    result = run_passes(g, fuse=True)
    assert not result.fused and "different score modifiers" in result.reason
    # one expression reading `head` (a table) fuses
    per_head = ex.table([2.0, 3.0], ex.head) * ex.tanh(ex.score / ex.table([2.0, 3.0], ex.head))
    layer = mhagen.mha(32, 2, bias=False, score_mod=per_head)
    assert run_passes(layer, fuse=True).fused
    w, xs = g.init_weights(0), random_input(layer, 1, 9)
    assert_close(layer.reference(xs, w), g.reference(xs, w))


@pytest.mark.parametrize("size", [4, 40], ids=["select-table", "param-table"])
def test_heads_whose_tables_differ_only_in_values_do_not_fuse(size):
    """Found by editing graph JSON at random: the fusion pass compared the heads' modifiers
    by repr, which abbreviates a table to its length, so heads whose distance tables held
    other values fused into head 0's expression (max error 0.18, silently)."""
    rng = np.random.default_rng(size)
    g = mhagen.Graph("own_tables")
    x = g.input("x", 32)
    outs = []
    for h in range(2):
        q, k, v = (g.head_projection(x, w, h, 16) for w in ("w_q", "w_k", "w_v"))
        bias = ex.table(rng.standard_normal(size).tolist(), ex.q_idx - ex.kv_idx + 3)
        s = g.score_mod(g.scale(g.scores(q, k), 0.25), ex.score + bias, head=h)
        outs.append(g.weighted_sum(g.softmax(s), v))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 32))
    result = run_passes(g, fuse=True)
    assert not result.fused and "different score modifiers" in result.reason
    w, xs = g.init_weights(0), random_input(g, 2, 9)
    m = mhagen.build(g, "x86-avx2" if not resolve("x86").runs_here() else "x86",
                     batch=2, seq_len=9, weights=w)
    assert_close(m(xs), g.reference(xs, w))


def test_bad_expressions_are_refused_clearly():
    with pytest.raises(GraphError, match="score_mod= takes a numeric expression"):
        mhagen.mha(32, 2, score_mod=mhagen.kv_idx <= mhagen.q_idx)
    g = mhagen.Graph("score_in_mask")
    x = g.input("x", 16)
    q, k, v = (g.head_projection(x, f"w_{r}", 0, 16) for r in "qkv")
    with pytest.raises(GraphError, match="mask must be a boolean expression of integers"):
        s = g.mask(g.scores(q, k), ex.score > 0.0, head=0)
        g.set_output(g.output_projection(g.concat_heads([g.weighted_sum(g.softmax(s), v)]),
                                         "w_o", 16))
        g.shapes()
    with pytest.raises(TypeError, match="table index must be an integer"):
        ex.table([1.0, 2.0], ex.score)
    with pytest.raises(ValueError, match="positive cap"):
        mhagen.softcap(0)


def test_graph_json_round_trip_keeps_the_modifier():
    layer = mhagen.mha(32, 4, score_mod=[mhagen.alibi(4), mhagen.softcap(5.0)])
    again = mhagen.Graph.from_json(layer.to_json())
    assert again == layer


@pytest.mark.parametrize("masks", ["constant", "computed"])
def test_onnx_export_decomposes_modifiers(tmp_path, masks):
    ort = pytest.importorskip("onnxruntime")
    mod = ex.where(ex.kv_idx > ex.q_idx - 3, ex.score, ex.score * 0.5) - ex.exp(-ex.score / 4.0)
    layer = mhagen.mha(48, 6, kv_heads=2, causal=True, score_mod=[mhagen.alibi(6), mod])
    w, x = layer.init_weights(0), random_input(layer, 2, 11)
    for graph in (layer, run_passes(layer, fuse=True).graph):
        path = mhagen.export_onnx(graph, tmp_path / "m.onnx", weights=w, seq_len=11, batch=2,
                                  masks=masks)
        y = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
        assert_close(y, layer.reference(x, w))
    with pytest.raises(mhagen.onnx.OnnxError, match="score modifier.*form='decomposed'"):
        mhagen.export_onnx(layer, tmp_path / "f.onnx", weights=w, seq_len=11, form="fused")


def _t5_table(heads, buckets, seed=0):
    return np.random.default_rng(seed).standard_normal((heads, buckets)).round(3)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20), (16, 9)])
def test_t5_buckets_are_hugging_faces(bidirectional, buckets, max_distance):
    """mhagen's bucket function against transformers' own T5Attention."""
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    if max_distance <= (buckets // 2 if bidirectional else buckets) // 2:
        pytest.skip("max_distance within the exact buckets (refused by relative_bias)")
    distances = np.arange(-3 * max_distance, 3 * max_distance + 1)
    theirs = t5.T5Attention._relative_position_bucket(
        torch.tensor(distances), bidirectional=bidirectional, num_buckets=buckets,
        max_distance=max_distance).numpy()
    ours = [ex.t5_bucket(int(d), buckets, max_distance, bidirectional) for d in distances]
    assert ours == theirs.tolist()


def _t5_by_hand(table, max_distance, bidirectional):
    buckets = table.shape[1]

    def modify(s, h, i, j):
        b = np.vectorize(lambda d: ex.t5_bucket(int(d), buckets, max_distance,
                                                bidirectional))(j - i)
        return s + table[h][b]
    return modify


@pytest.mark.parametrize("bidirectional,causal", [(True, False), (False, True)])
def test_relative_bias_reference_semantics(bidirectional, causal):
    table = _t5_table(6, 16)
    layer = mhagen.mha(48, 6, kv_heads=3, causal=causal,
                       score_mod=mhagen.relative_bias(table, max_distance=9,
                                                      bidirectional=bidirectional))
    w, x = layer.init_weights(1), random_input(layer, 2, 31)     # distances past 9 too
    np.testing.assert_allclose(
        layer.reference(x, w),
        mha_by_hand(w, x, 6, causal=causal, modify=_t5_by_hand(table, 9, bidirectional)),
        rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("build", ["fused", "unfused", "any-length"])
def test_relative_bias_kernels_match_the_reference(target, build):
    """Seq 97 and 193 (distances past max_distance 40 both ways), head_dim 40, grouped K/V,
    causal; the table is a constant param (2 x 81 distances per head), read in the kernels."""
    t = resolve(target)
    if not t.runs_here():
        pytest.skip(f"{target} code cannot run on this CPU: {t.cannot_run()}")
    table = _t5_table(8, 32, seed=3)
    layer = mhagen.mha(320, 8, head_dim=40, kv_heads=2, causal=True,
                       score_mod=mhagen.relative_bias(table, max_distance=40))
    w = layer.init_weights(2)
    kw = {"fused": {}, "unfused": dict(fuse=False),
          "any-length": dict(seq_len=None, max_seq_len=200)}[build]
    m = mhagen.build(layer, target, **{"batch": 2, "seq_len": 97, **kw}, weights=w)
    params = m.program.role("param")
    assert [p.shape for p in params if p.name.startswith("score_table")] == [(8 * 81,)]
    assert m.program.fusion.startswith("not fused" if build == "unfused" else "fused")
    for seq in ((97, 1, 193) if build == "any-length" else (97,)):
        x = random_input(layer, 2, seq, seed=seq)
        assert_close(m(x), layer.reference(x, w))


def test_relative_bias_decoding_and_attention_maps():
    """The decode template reads the table too; attention maps (the unfused path) as well."""
    t = "x86" if resolve("x86").runs_here() else "x86-avx2"
    table = _t5_table(4, 16, seed=5)
    mod = mhagen.relative_bias(table, max_distance=12, bidirectional=False)
    prefill = mhagen.mha(64, 4, causal=True, score_mod=mod)
    w = prefill.init_weights(4)
    x = random_input(prefill, 1, 30, seed=1)
    expected = prefill.reference(x, w)
    step = mhagen.mha(64, 4, causal=True, score_mod=mod, kv_cache=32)
    m = mhagen.build(step, t, batch=1, seq_len=1, weights=w)
    cache = m.new_cache()
    got = np.concatenate([m(x[:, i:i + 1], cache=cache) for i in range(30)], axis=1)
    assert_close(got, expected)
    maps = mhagen.build(prefill, t, batch=1, seq_len=30, weights=w).attention_maps(x)
    assert maps.shape == (1, 4, 30, 30)
    np.testing.assert_allclose(maps.sum(-1), 1.0, rtol=1e-5)


def test_per_head_tables_must_cover_the_heads():
    with pytest.raises(GraphError, match="per-head table of the score modifier has 2 values"):
        mhagen.mha(32, 4, score_mod=mhagen.alibi(2))
    with pytest.raises(GraphError, match="per-head table"):
        mhagen.mha(32, 4, score_mod=mhagen.relative_bias(_t5_table(3, 8), max_distance=8))
    for bad in ([[1.0, 2.0], [3.0]], np.ones(8), [["a", "b"]], 3.0, [], [[]]):
        with pytest.raises(ValueError, match="table \\[num_heads, num_buckets\\]"):
            mhagen.relative_bias(bad)
    with pytest.raises(ValueError, match="NaN"):
        mhagen.relative_bias([[float("nan")] * 8] * 4, max_distance=8)
    with pytest.raises(ValueError, match="must exceed the exact buckets"):
        mhagen.relative_bias(_t5_table(2, 32), max_distance=8)


def test_relative_bias_exports_to_onnx(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(48, 6, kv_heads=2, causal=True,
                       score_mod=mhagen.relative_bias(_t5_table(6, 8), max_distance=6))
    w, x = layer.init_weights(0), random_input(layer, 2, 11)
    path = mhagen.export_onnx(layer, tmp_path / "m.onnx", weights=w, seq_len=11, batch=2)
    y = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert_close(y, layer.reference(x, w))


MXCSR_READER = "#include <xmmintrin.h>\nunsigned mxcsr(void) { return _mm_getcsr(); }\n"


def test_steep_alibi_flushes_denormals_in_its_tasks_and_leaves_the_callers_mxcsr(tmp_path):
    """ALiBi slopes of 0.7 put most scores of a long row far below its maximum: the online
    softmax's tiny probabilities and rescaled accumulators came out denormal, and the Intel
    Xeon took the attention to 4.2x its plain time. The attention and decode tasks run with
    FTZ and DAZ set (their code sets and restores MXCSR: compile-checked on any x86 host),
    and so do the unfused path's softmax and batched matmul tasks (its steep layer at
    1x1024x512x8 took 1.53x the plain one's time, flushed 1.03x; Intel Xeon, 1 thread);
    the output still matches the reference, and the calling thread, which runs tasks
    too, gets its MXCSR back unchanged (read through a C helper)."""
    import ctypes
    import shutil
    import subprocess

    from mhagen.host import host_arch
    steep = ex.score + ex.table([0.7] * 2, ex.head) * (ex.kv_idx - ex.q_idx)
    layer = mhagen.mha(32, 2, score_mod=steep)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=300, weights=w, tuning=None)
    attention = m.inspect("source")
    assert attention.count("ldmxcsr") >= 2 and "stmxcsr" in attention
    decoding = mhagen.mha(32, 2, kv_cache=64, score_mod=steep)
    d = mhagen.build(decoding, "x86-avx2", batch=1, seq_len=1, weights=w, tuning=None)
    assert d.inspect("source").count("ldmxcsr") >= 2
    unfused = mhagen.build(layer, "x86-avx2", batch=1, seq_len=300, weights=w, tuning=None,
                           fuse=False)
    assert unfused.inspect("source").count("ldmxcsr") >= 2
    for fuse in (True, False):
        arm = mhagen.build(layer, "arm-neon", batch=1, seq_len=8, weights=w, tuning=None,
                           fuse=fuse)
        assert "ldmxcsr" not in arm.inspect("source") and "mxcsr" not in arm.inspect("source")
    if host_arch() != "x86_64" or not m.target.runs_here() or not shutil.which("gcc"):
        pytest.skip("the run half needs an x86 host running AVX2 code and gcc")
    lib = tmp_path / "mxcsr.so"
    (tmp_path / "mxcsr.c").write_text(MXCSR_READER)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "mxcsr.c")],
                   check=True)
    read = ctypes.CDLL(str(lib)).mxcsr
    before = read()
    assert not before & 0x8040, hex(before)       # FTZ and DAZ off: Python's default
    x = random_input(layer, 1, 300, seed=3)
    for module in (m, unfused):
        assert_close(module(x), layer.reference(x, w))
        assert read() == before, (hex(before), hex(read()))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_minus_inf_from_a_modifier_hides_keys_and_empty_rows_give_zeros(fuse):
    """-inf from a score modifier hides a key as a mask does (FlexAttention's score_mod
    idiom), through where() or a table value added to the score; a row it hides whole gives
    zeros. +inf, or inf times a score, is refused (test_ir): it made the softmax NaN."""
    inf = float("inf")
    mod = ex.where((ex.kv_idx > ex.q_idx) | (ex.q_idx.eq(3)), -inf, ex.score) + ex.table(
        [0.0, -inf, 0.25], ex.kv_idx - ex.q_idx + 2)
    layer = mhagen.mha(32, 2, score_mod=mod)
    w, x = layer.init_weights(0), random_input(layer, 2, 9)
    ref = layer.reference(x, w)
    assert np.isfinite(ref).all()
    m = mhagen.build(layer, "x86-avx2" if not resolve("x86").runs_here() else "x86",
                     batch=2, seq_len=9, weights=w, fuse=fuse)
    y = m(x)
    assert_close(y, ref)
    bias = w["b_o"] if "b_o" in w else 0.0      # row 3 sees no key: its heads give zeros
    np.testing.assert_allclose(y[:, 3], np.broadcast_to(bias, y[:, 3].shape), atol=1e-6)
