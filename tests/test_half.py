"""Half-precision layers (float16, bfloat16 storage; float32 compute: mhagen/dtypes.py) against
the float64 reference of the same rounded inputs and weights, on every runnable x86 preset,
fused, unfused and symbolic; the tolerance table's row and FlashAttention's criterion (error
within 2x a half-precision reference's own); Python and C entry points, artifacts, bad input."""
import dataclasses
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

import mhagen
from mhagen import KVCache
from mhagen.errors import GraphError, InputError
from mhagen import host
from mhagen.errors import TargetError
from mhagen.schedules.x86.amx import amx_tiles
from mhagen.schedules.x86.bf16_dot import PAIRS_PAY, bf16_pairs
from mhagen.target import resolve
from mhagen.tolerances import assert_close, tolerance, within_half_reference
from tests.conftest import build_c_app, random_cache
from x86_helpers import function_asm, multiply_add_loops, spills_in_fma_loops

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
RUNNABLE = [p for p in ("x86", "x86-avx2", "x86-avx512", "x86-avx512-bf16", "x86-amx")
            if resolve(p).runs_here()]
NATIVE = "x86-avx512-bf16"    # Zen 4: bfloat16 GEMMs on vdpbf16ps (schedules/x86/bf16_dot.py)
AMX = "x86-amx"               # Sapphire Rapids: bfloat16 GEMMs on AMX tiles (x86/amx.py)


def _x(shape, dtype, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(
        DTYPES[dtype])


def _check(layer, m, x, w, dtype, **call):
    y = m(x, **call)
    assert y.dtype == DTYPES[dtype]
    expected = layer.reference(x, w, **call)
    assert_close(y, expected, dtype)
    err, bound = within_half_reference(y, expected,
                                       layer.reference(x, w, rounded_to=dtype, **call))
    assert err <= bound, f"error {err:.3g} > 2x the half-precision reference's ({bound:.3g})"
    return y


# the fused build on every runnable preset; the other builds on the AVX2 class (CI time)
BUILDS = [(p, dt, "fused") for p in RUNNABLE for dt in DTYPES] + [
    ("x86-avx2", dt, b) for dt in DTYPES for b in ("unfused", "any-length")]


@pytest.mark.parametrize("preset, dtype, build", BUILDS)
def test_half_layers_match_the_reference(preset, dtype, build):
    """seq 97, head_dim 40, grouped K/V, causal: the awkward shapes, in half precision."""
    layer = mhagen.mha(80, 4, head_dim=40, kv_heads=2, causal=True, dtype=dtype)
    w = layer.init_weights(2)
    assert all(v.dtype == DTYPES[dtype] for v in w.values())
    kw = {"fused": {}, "unfused": dict(fuse=False),
          "any-length": dict(seq_len=None, max_seq_len=128)}[build]
    m = mhagen.build(layer, preset, **{"batch": 2, "seq_len": 97, **kw}, weights=w)
    if bf16_pairs(resolve(preset), dtype, 80):
        assert "w_qkv, w_o multiply bfloat16 pairs" in m.precision
    elif amx_tiles(resolve(preset), dtype, 160):   # d_model 80 is not whole 32s, 4 x 40 is
        assert "the GEMMs of w_o run on AMX tiles" in m.precision
    else:
        assert m.precision.startswith(f"{dtype} storage, converted to float32 on load")
    _check(layer, m, _x((2, 97, 80), dtype), w, dtype)
    if build == "any-length":      # other lengths from the same module
        for seq in (1, 17):
            _check(layer, m, _x((2, seq, 80), dtype, seed=seq), w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_layers_with_modifiers_rotary_and_key_padding(dtype):
    layer = mhagen.mha(64, 4, kv_heads=1, rotary=True, key_padding=True,
                       score_mod=[mhagen.alibi(4), mhagen.softcap(20.0)], dtype=dtype)
    w = layer.init_weights(4)
    m = mhagen.build(layer, RUNNABLE[-1], batch=2, seq_len=33, weights=w)
    _check(layer, m, _x((2, 33, 64), dtype), w, dtype, kv_lens=np.array([33, 5], np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_cross_attention(dtype):
    layer = mhagen.mha(64, 2, cross=True, kv_dim=48, dtype=dtype)
    w = layer.init_weights(5)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=9, kv_seq_len=13, weights=w)
    _check(layer, m, _x((1, 9, 64), dtype), w, dtype, context=_x((1, 13, 48), dtype, seed=7))


def test_attention_maps_of_a_half_layer():
    """float32 probabilities of the layer's rounded x and weights."""
    layer = mhagen.mha(32, 2, causal=True, dtype="float16")
    w = layer.init_weights(9)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=7, weights=w)
    x = _x((1, 7, 32), "float16")
    p = m.attention_maps(x)
    assert p.dtype == np.float32 and p.shape == (1, 2, 7, 7)
    xs = x.astype(np.float64)
    for h in range(2):
        q = xs[0] @ w["w_q"][h].astype(np.float64) + w["b_q"][h].astype(np.float64)
        k = xs[0] @ w["w_k"][h].astype(np.float64) + w["b_k"][h].astype(np.float64)
        s = np.where(np.tril(np.ones((7, 7), bool)), q @ k.T / 4.0, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        assert_close(p[0, h], e / e.sum(-1, keepdims=True))
    np.testing.assert_array_equal(m.attention_maps(x.astype(np.float32)), p)


def test_float32_arrays_are_rounded_in_and_answered_in_float32():
    layer = mhagen.mha(64, 2, dtype="bfloat16")
    w32 = {k: v.astype(np.float32) for k, v in layer.init_weights(1).items()}
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=20, weights=w32)
    x32 = np.random.default_rng(3).standard_normal((1, 20, 64)).astype(np.float32)
    y32 = m(x32)
    assert y32.dtype == np.float32
    yh = m(x32.astype(ml_dtypes.bfloat16))
    assert yh.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y32, yh.astype(np.float32))
    out = np.empty((1, 20, 64), np.float32)
    assert m(x32, out=out) is out
    with pytest.raises(InputError, match="out= must be a float32"):
        m(x32, out=np.empty((1, 20, 64), ml_dtypes.bfloat16))
    y64 = m(x32.astype(np.float64))      # converted to float32 (mhagen/inputs.py), then so
    assert y64.dtype == np.float32
    np.testing.assert_array_equal(y64, y32)
    with pytest.raises(InputError, match="x is a bool array"):
        m(np.zeros((1, 20, 64), bool))
    f16 = mhagen.build(mhagen.mha(64, 2, dtype="float16"), "x86-avx2", batch=1, seq_len=20,
                       weights=mhagen.mha(64, 2, dtype="float16").init_weights(1))
    big = x32.copy()
    big[0, 3, 5] = 1e5           # finite in float32, inf in float16: refused, not inf out
    with pytest.raises(InputError, match="beyond float16's range .largest finite 65504"):
        f16(big)


@pytest.mark.parametrize("dtype", DTYPES)
def test_float32_conversions_round_as_numpy(dtype):
    """A CPU half layer's library converts float32 x into its storage and the answer back
    (schedules/casts.py) bit for bit as numpy / ml_dtypes do: random bit patterns (every
    NaN, inf, subnormal and tie among them), the overflow boundary, arrays of no whole
    chunk and unaligned ones; float16's NaNs stay NaNs of their sign (the conversion
    instruction quiets a signalling one). Module calls then match the rounded x's, with
    the conversions and without them (an artifact saved before they existed)."""
    layer = mhagen.mha(64, 2, dtype=dtype)
    w = layer.init_weights(1)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=20, weights=w)
    assert m.storage.cast("mhagen_to_storage") is not None
    assert m.storage.cast("mhagen_from_storage") is not None
    rng = np.random.default_rng(0)
    limit = np.float32(65520 if dtype == "float16" else 3.3961775e38)
    edges = np.array([limit, np.nextafter(limit, 0), -limit, 65504, 1e-45, -0.0, np.inf,
                      -np.nan, 1.00390625, 1.01171875], np.float32)
    for values in (edges, rng.integers(0, 2 ** 32, 70001, dtype=np.uint64).astype(
            np.uint32).view(np.float32)):
        src = np.empty(values.size + 1, np.float32)[1:]       # 4 bytes off alignment
        src[...] = values
        dst = np.empty(values.size + 1, DTYPES[dtype])[1:]
        m.storage.convert("mhagen_to_storage", src, dst)
        with np.errstate(all="ignore"):
            want = values.astype(DTYPES[dtype])
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(dst.astype(np.float32)), nan)
        assert np.array_equal(np.signbit(dst.astype(np.float32)), np.signbit(want.astype(
            np.float32)))
        assert np.array_equal(dst.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        if dtype == "bfloat16":     # NaNs too, as ml_dtypes rounds them
            assert np.array_equal(dst.view(np.uint16), want.view(np.uint16))
        back = np.empty(values.size + 3, np.float32)[3:]
        m.storage.convert("mhagen_from_storage", dst, back)
        expected = dst.astype(np.float32)
        assert np.array_equal(back.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])
        assert np.isnan(back[nan]).all()
    x32 = rng.standard_normal((1, 20, 64)).astype(np.float32) * 4
    unaligned = np.empty(x32.size + 1, np.float32)[1:].reshape(x32.shape)
    unaligned[...] = x32
    want = m(x32.astype(DTYPES[dtype])).astype(np.float32)
    for x in (x32, unaligned):
        np.testing.assert_array_equal(m(x), want)
    m.storage.casts = {"mhagen_to_storage": None, "mhagen_from_storage": None}   # numpy's way
    np.testing.assert_array_equal(m(unaligned), want)


def test_half_against_torch():
    """torch.nn.MultiheadAttention in float32 with the rounded weights and input, rounded
    to float16 at the end: what the float16 module computes."""
    torch = pytest.importorskip("torch")
    ref = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
    layer = mhagen.mha(64, 4, dtype="float16")
    w = mhagen.weights_from_torch(ref)
    m = mhagen.build(layer, "x86-avx2", batch=2, seq_len=31, weights=w)
    x = _x((2, 31, 64), "float16")
    with torch.no_grad():
        want = ref(*[torch.from_numpy(x.astype(np.float32))] * 3, need_weights=False)[0]
    got = m(x).astype(np.float32)
    assert np.abs(got - want.numpy()).max() <= tolerance(want.numpy(), "float16")


def test_unsupported_dtypes_are_refused():
    with pytest.raises(GraphError, match="dtype 'float64' is not supported"):
        mhagen.mha(64, 2, dtype="float64")


@pytest.mark.parametrize("preset", sorted({"x86-avx2", NATIVE} & set(RUNNABLE)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_decoding_matches_the_reference(preset, dtype):
    """A half-precision decoding layer: x, weights and output in the dtype, the K/V cache
    float32 (the rows the float32-accumulating QKV GEMM wrote). GQA, head_dim 40, causal,
    rotary; 3 steps of 1 and of 3 new tokens on rows cached 0 and 40 deep: outputs within
    the dtype's tolerance and 2x a half-precision reference's error, caches as the
    reference's; a prepared run gives the plain call's output."""
    layer = mhagen.mha(80, 4, head_dim=40, kv_heads=2, causal=True, rotary=True, kv_cache=97,
                       dtype=dtype)
    w = layer.init_weights(3)
    for new in (1, 3):
        m = mhagen.build(layer, preset, batch=2, seq_len=new, weights=w)
        cache = m.new_cache()
        assert cache.k.dtype == np.float32
        cache.lens[...] = [0, 40]
        ref, half_ref, prepared = cache.copy(), cache.copy(), cache.copy()
        x_in = mhagen.aligned_empty((2, new, 80), dtype)
        step = m.prepare(x_in, cache=prepared)
        for i in range(3):
            x = _x((2, new, 80), dtype, seed=i)
            y = m(x, cache=cache)
            assert y.dtype == DTYPES[dtype]
            expected = layer.reference(x, w, cache=ref)
            assert_close(y, expected, dtype)
            err, bound = within_half_reference(
                y, expected, layer.reference(x, w, cache=half_ref, rounded_to=dtype))
            assert err <= bound, f"error {err:.3g} > 2x the half reference's ({bound:.3g})"
            x_in[...] = x
            np.testing.assert_array_equal(step().view(np.uint16), y.view(np.uint16))
        assert cache.lens.tolist() == ref.lens.tolist() == [3 * new, 40 + 3 * new]
        assert_close(cache.k, ref.k)
        assert_close(cache.v, ref.v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_artifacts_in_python_and_c(dtype, tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    layer = mhagen.mha(64, 4, causal=True, dtype=dtype)
    w = layer.init_weights(6)
    m = mhagen.build(layer, "x86-avx2", batch=2, seq_len=17, weights=w)
    x = _x((2, 17, 64), dtype)
    y = m(x)
    art = m.save(tmp_path / "m")
    loaded = mhagen.load(art)
    np.testing.assert_array_equal(loaded(x).view(np.uint16), y.view(np.uint16))
    header = (art / "mha.h").read_text()
    assert "typedef uint16_t mha_value;" in header and f'#define MHA_DTYPE "{dtype}"' in header
    if cc is None:
        pytest.skip("needs a C compiler for the C half")   # the Python half has run
    exe = build_c_app(cc, art, tmp_path / "app")
    x.tofile(tmp_path / "x.bin")
    r = subprocess.run([str(exe), str(art), str(tmp_path / "x.bin"), str(tmp_path / "y.bin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"] {dtype}, mean" in r.stdout
    got = np.fromfile(tmp_path / "y.bin", DTYPES[dtype]).reshape(y.shape)
    np.testing.assert_array_equal(got.view(np.uint16), y.view(np.uint16))
    first = float(y[0, 0, 0].astype(np.float64))
    assert f"y[0, 0, :4] = {first:.6f}" in r.stdout    # the app's own half decoding


def _ort_run(path, feeds):
    """Run an exported model in ONNX Runtime; half-precision feeds go in as OrtValues
    (onnxruntime's numpy bridge has no bfloat16), float32 ones as they are; y comes out
    through an appended Cast to float32, after it the model's other outputs (a decoding
    layer's float32 present_key, present_value)."""
    import onnx
    ort = pytest.importorskip("onnxruntime")
    model = onnx.load(str(path))
    model.graph.node.append(onnx.helper.make_node("Cast", ["y"], ["y_f32"],
                                                  to=onnx.TensorProto.FLOAT))
    others = [o for o in model.graph.output if o.name != "y"]
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        "y_f32", onnx.TensorProto.FLOAT, None))
    model.graph.output.extend(others)
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    types = {np.dtype(ml_dtypes.bfloat16): onnx.TensorProto.BFLOAT16,
             np.dtype(np.float16): onnx.TensorProto.FLOAT16}
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) if v.dtype == np.float32 else
              ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(np.uint16), types[v.dtype])
              for k, v in feeds.items()}
    outs = [o.numpy() for o in s.run_with_ort_values(None, values)]
    return outs[0] if len(outs) == 1 else outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["decomposed", "fused"])
def test_half_onnx_export_runs_in_onnxruntime(dtype, form, tmp_path):
    import onnx
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, dtype=dtype)
    w = layer.init_weights(8)
    path = mhagen.export_onnx(layer, tmp_path / "m.onnx", w, form=form, batch=2, seq_len=17)
    model = onnx.load(str(path))
    want = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    assert model.graph.input[0].type.tensor_type.elem_type == want
    assert model.graph.output[0].type.tensor_type.elem_type == want
    assert {t.data_type for t in model.graph.initializer if t.name.startswith("w_")} == {want}
    x = _x((2, 17, 64), dtype)
    y = _ort_run(path, {"x": x})
    m = mhagen.build(layer, "x86-avx2", batch=2, seq_len=17, weights=w)
    assert_close(y, layer.reference(x, w), dtype)
    # the same rounding of the same float32 numbers: at most one ulp apart
    assert np.abs(y - m(x).astype(np.float32)).max() <= 2 * tolerance(y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_decoding_onnx_export_runs_in_onnxruntime(dtype, tmp_path):
    """ONNX's past/present form of a half-precision decoding layer: x and y in the dtype,
    past and present float32 (mhagen's cache); onnxruntime against the reference."""
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, kv_cache=40, dtype=dtype)
    w = layer.init_weights(8)
    path = mhagen.export_onnx(layer, tmp_path / "dec.onnx", w, form="fused", batch=2,
                              seq_len=3)
    cache = KVCache.empty(layer, 2, np.float64)
    rng = np.random.default_rng(0)
    random_cache(cache, rng)
    cache.lens[...] = 11
    x = _x((2, 3, 64), dtype)
    y, present_k, present_v = _ort_run(path, {
        "x": x, "past_key": cache.k[:, :, :11].astype(np.float32),
        "past_value": cache.v[:, :, :11].astype(np.float32)})
    assert_close(y, layer.reference(x, w, cache=cache), dtype)
    assert_close(present_k, cache.k[:, :, :14])
    assert_close(present_v, cache.v[:, :, :14])


def test_cli_builds_a_half_layer_and_says_how_it_computes(tmp_path, capsys):
    from mhagen.cli import main
    assert main(["build", "--dtype", "float16", "--d-model", "64", "--heads", "4",
                 "--seq-len", "19", "--target", "x86-avx2", "--repeat", "1",
                 "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "precision: float16 storage, converted to float32 on load" in out
    assert "(tolerance" in out and ") ok" in out
    assert mhagen.load(tmp_path / "m").dtype == np.float16


def test_float16_weights_are_converted_with_f16c():
    """The GEMMs' half-precision loads become vcvtph2ps (F16C), not calls to a soft-float
    conversion routine."""
    layer = mhagen.mha(64, 4, dtype="float16")
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=12, weights=layer.init_weights(0))
    asm = m.inspect("source")
    assert "vcvtph2ps" in asm and "vcvtps2ph" in asm
    calls = [ln for ln in asm.splitlines() if ln.strip().startswith(("call", "jmp"))]
    # TVM defines weak soft-float helpers in every module; none may be called
    assert not [c for c in calls if "hfsf2" in c or "sfhf2" in c], calls


def _paired_layer(**kw):
    return mhagen.mha(80, 4, head_dim=40, kv_heads=2, causal=True, dtype="bfloat16", **kw)


def test_bfloat16_gemms_compile_to_vdpbf16ps_on_any_host():
    """Compile-only (any host): a bfloat16 layer for an AVX-512 BF16 target multiplies
    bfloat16 pairs in its GEMMs and its attention, loaded from bfloat16 memory, register
    tiles clean (no stack traffic in the pair loops);
    the same layer for plain AVX-512 converts on load, and odd depths fall back."""
    layer = _paired_layer()
    w = layer.init_weights(0)
    m = mhagen.build(layer, NATIVE, batch=1, seq_len=16, weights=w)
    asm = m.inspect("source")
    # two GEMMs of 8 x 32 tiles, the attention's S^T (8 x 32) and P V (8 x 32 or 8 x 16)
    assert asm.count("vdpbf16ps") >= 4 * 16
    assert not spills_in_fma_loops(asm, "vdpbf16ps"), "the pair loop spills"
    loops = multiply_add_loops(asm, "vdpbf16ps")
    assert len(loops) >= 4, "GEMMs' and attention's pair loops"
    # operands straight from bfloat16 memory: no narrowing in the pair loops
    assert not [i for body in loops for i in body if "vcvt" in i]
    assert m.program.buffers["qkv"].dtype == "bfloat16"
    assert "the attention's Q K^T and P V too" in m.precision
    assert {b.name for b in m.program.buffers.values() if (b.pack or {}).get("pairs")} == {
        "w_qkv", "w_o"}
    paired = m.program.buffers["w_qkv"]     # [N / 32, K / 2, 32, 2] bfloat16 pairs
    assert paired.shape[-1] == 2 and paired.dtype == "bfloat16"
    plain = mhagen.build(layer, "x86-avx512", batch=1, seq_len=16, weights=w)
    assert "vdpbf16ps" not in plain.inspect("source")
    # the pair GEMMs keep 8-row tiles (12 took 1.00-1.04x their time); float32 ones take 12
    for module, rows in ((m, 8), (plain, 12)):
        assert {d["config"]["tile_rows"] for d in module.decisions
                if d["rule"] == "matmul"} == {rows}, module.decisions
    assert plain.precision.startswith("bfloat16 storage, converted to float32 on load")
    odd = mhagen.mha(45, 3, dtype="bfloat16")     # depth 45: no pairs, converts on load
    m = mhagen.build(odd, NATIVE, batch=1, seq_len=5, weights=odd.init_weights(0))
    assert "vdpbf16ps" not in m.inspect("source")
    for f16 in (mhagen.mha(64, 4, dtype="float16"), mhagen.mha(64, 4)):
        m = mhagen.build(f16, NATIVE, batch=1, seq_len=5, weights=f16.init_weights(0))
        assert "vdpbf16ps" not in m.inspect("source")


def test_bfloat16_pairs_only_where_vdpbf16ps_beats_the_fma():
    """Compile-only: an AVX-512 BF16 CPU whose vdpbf16ps does fewer multiply-adds a cycle
    than its float32 FMA (the Intel Xeon with AMX: 0.50x in register-only loops, the
    bfloat16 layer on pairs 1.5-1.6x the float32 layer's time) converts on load, and says
    why; the same code for Zen 4 multiplies pairs."""
    layer = _paired_layer()
    w = layer.init_weights(0)
    intel = dataclasses.replace(resolve(NATIVE), cpu="sapphirerapids")
    assert "avx512bf16" in intel.features and intel.cpu not in PAIRS_PAY
    m = mhagen.build(layer, intel, batch=1, seq_len=16, weights=w)
    assert "vdpbf16ps" not in m.inspect("source")
    assert not [b for b in m.program.buffers.values() if (b.pack or {}).get("pairs")]
    assert "avx512bf16 is present but not used (bfloat16 pairs run only on CPUs" in m.precision
    assert "znver4" in PAIRS_PAY and bf16_pairs(resolve(NATIVE), "bfloat16", 80)


@pytest.mark.skipif(not resolve(NATIVE).runs_here(),
                    reason="needs a CPU that runs Zen 4 code (AVX-512 BF16, VBMI, ...: Zen 4+, "
                           "Sapphire Rapids); compiled on every host by the test above")
@pytest.mark.parametrize("build", ["any-length", "cross", "odd rows", "artifact",
                                   "attention long"])
def test_bfloat16_pair_gemms_match_the_reference(build, tmp_path):
    """The vdpbf16ps GEMMs run: any-length builds, cross-attention (the K/V GEMM too), rows
    that are not whole tiles, and a saved artifact (weights repacked in pairs on load);
    "attention long": unmasked at seq 1100, the pair attention's key blocks of ~512 (two,
    the second cut at the last key)."""
    if build == "attention long":
        layer = mhagen.mha(80, 2, head_dim=40, dtype="bfloat16")
        w = layer.init_weights(6)
        m = mhagen.build(layer, NATIVE, batch=1, seq_len=1100, weights=w)
        config = next(d["config"] for d in m.decisions if d["kernel"] == "attention")
        assert 512 <= config["kv_block"] < 1100 < 2 * config["kv_block"], config
        assert "the attention's Q K^T and P V too" in m.precision
        _check(layer, m, _x((1, 1100, 80), "bfloat16"), w, "bfloat16")
        return
    if build == "cross":
        layer = mhagen.mha(64, 4, cross=True, dtype="bfloat16")
        w = layer.init_weights(3)
        m = mhagen.build(layer, NATIVE, batch=2, seq_len=11, kv_seq_len=9, weights=w)
        assert "w_kv" in m.precision
        _check(layer, m, _x((2, 11, 64), "bfloat16"), w, "bfloat16",
               context=_x((2, 9, 64), "bfloat16", seed=7))
        return
    layer = _paired_layer()
    w = layer.init_weights(4)
    if build == "any-length":
        m = mhagen.build(layer, NATIVE, batch=2, seq_len=None, max_seq_len=64, weights=w)
        for seq in (1, 13, 64):
            _check(layer, m, _x((2, seq, 80), "bfloat16", seed=seq), w, "bfloat16")
        return
    m = mhagen.build(layer, NATIVE, batch=3, seq_len=7, weights=w)   # 21 rows: 3 tiles
    if build == "artifact":
        m.save(tmp_path / "m")
        m = mhagen.load(tmp_path / "m")
        assert "multiply bfloat16 pairs" in m.precision
        m.bind(w)      # new weights are repacked by the manifest's recipe
    _check(layer, m, _x((3, 7, 80), "bfloat16"), w, "bfloat16")


@pytest.mark.parametrize("preset, method", [(NATIVE, "vdpbf16ps"), (AMX, "AMX tiles")])
def test_tuning_a_bfloat16_layer_keeps_the_intrinsic_gemms_on_their_template(preset, method,
                                                                             tmp_path):
    """MetaSchedule's generic space cannot express the vdpbf16ps or AMX intrinsics (the
    former crashed inside TVM): tuning reports those GEMMs as not tunable and tunes the
    attention."""
    if not resolve(preset).runs_here():
        pytest.skip(f"needs a CPU that runs {preset} code (tuning measures on this host)")
    layer = mhagen.mha(64, 4, dtype="bfloat16")
    report = mhagen.tune(layer, preset, shapes=[(1, 16)], trials=2, progress=False,
                         database=tmp_path / "db.json")
    kept = {r.kernel: (r.method, r.kept) for r in report.results}
    assert kept["qkv_projection"] == (method, "default (not tunable)")
    assert kept["output_projection"] == (method, "default (not tunable)")
    assert kept["attention"][0] == "config sweep"
    w = layer.init_weights(0)
    m = mhagen.build(layer, preset, batch=1, seq_len=16, weights=w, tuning=tmp_path / "db.json")
    _check(layer, m, _x((1, 16, 64), "bfloat16"), w, "bfloat16")


def _tile_layer(**kw):
    """Depths of whole 32s (d_model 64, 4 heads of 40: 160) for AMX, awkward otherwise
    (head_dim=None: 4 heads of 16... of 32 where d_model is 128)."""
    kw = {"head_dim": 40, "kv_heads": 2, **kw}
    d_model = 128 if kw["head_dim"] is None else 64
    return mhagen.mha(d_model, 4, causal=True, dtype="bfloat16", **kw)


def test_bfloat16_gemms_compile_to_amx_tiles_on_any_host():
    """Compile-only (any host): a bfloat16 layer for Sapphire Rapids runs its GEMMs on AMX
    tiles: 4 tdpbf16ps a step of 32, the tile configuration loaded once per GEMM task and
    released at its end (not per tile: 20-30% of a tile's time), A packed in 32 x 32 tiles,
    the weights in pairs; float32 and float16 layers, depths not whole 32s and decoding
    layers (few rows a step) keep the FMA GEMMs."""
    layer = _tile_layer()
    w = layer.init_weights(0)
    m = mhagen.build(layer, AMX, batch=1, seq_len=40, weights=w)
    asm = m.inspect("source")
    assert "the GEMMs of w_qkv, w_o run on AMX tiles" in m.precision
    assert {d["config"]["tile_rows"] for d in m.decisions if d["rule"] == "matmul"} == {32}
    tir = m.inspect("tir")
    for kernel in ("qkv_projection", "output_projection"):
        code = function_asm(asm, f"{kernel}_compute_")
        assert code.count("ldtilecfg") == 1 and code.count("tilerelease") == 1, kernel
        n = sum(line.strip().startswith("tdpbf16ps") for line in code.splitlines())
        assert n and n % 4 == 0, (kernel, n)    # 2 x 2 tiles a step of 32 (unrolled or not)
        # a task: configure, its row tiles (2 here: 64 rows), release
        text = tir[tir.index(f"def {kernel}("):]
        order = [text.index(s) for s in ("T.parallel", "mhagen_amx_config", "for m_0 in",
                                          "mhagen_amx_tile_32x32", "mhagen_amx_release")]
        assert order == sorted(order) and text.count("mhagen_amx_config") >= 1, kernel
        # A's copy into tiles: a tile row (32 bfloat16) a vector, not 1,024 unrolled copies
        # (LLVM took 6 s to compile those)
        pack = text[:text.index("mhagen_amx_config")]
        assert "T.vectorized(32)" in pack and "T.unroll" not in pack, (kernel, pack)
    assert "tdpbf16ps" not in function_asm(asm, "attention_compute_")   # head_dim 40
    assert "attention converts to float32 on load" in m.precision
    assert {n for n, b in m.program.buffers.items() if (b.pack or {}).get("amx")} == {
        "w_qkv", "w_o"}
    assert m.program.buffers["w_qkv"].shape[-1] == 2     # [N / 32, K / 2, 32, 2] pairs
    for other in (mhagen.mha(64, 4), mhagen.mha(64, 4, dtype="float16"),
                  mhagen.mha(80, 4, dtype="bfloat16"),
                  mhagen.mha(64, 4, kv_cache=64, dtype="bfloat16")):
        built = mhagen.build(other, AMX, batch=1, seq_len=8, weights=other.init_weights(0))
        assert "tdpbf16ps" not in built.inspect("source"), other
        if other.dtype == "bfloat16":    # and the build says why
            assert "amx-bf16 is present but not used here" in built.precision
    # the same layer for a target without AMX converts on load
    plain = mhagen.build(layer, "x86-avx512", batch=1, seq_len=40, weights=w)
    assert "tdpbf16ps" not in plain.inspect("source")
    # head_dim 32: the attention's S^T = K Q^T and P V on AMX tiles too, each task
    # configuring them
    grouped = _tile_layer(head_dim=None, kv_heads=2)
    m = mhagen.build(grouped, AMX, batch=1, seq_len=97, weights=grouped.init_weights(0))
    assert "the attention's Q K^T and P V on AMX tiles" in m.precision
    assert m.program.buffers["qkv"].dtype == "bfloat16"
    code = function_asm(m.inspect("source"), "attention_compute_")
    assert code.count("ldtilecfg") == 1 and code.count("tilerelease") == 1
    n = sum(line.strip().startswith("tdpbf16ps") for line in code.splitlines())
    assert n >= 8 and n % 4 == 0, n      # S^T's tiles and P V's
    # unmasked, long: AMX attention takes key blocks of ~256 keys, the pairs' ~512, the
    # float32 one ~128
    blocks = {}
    for preset, dtype in ((AMX, "bfloat16"), ("x86-avx512-bf16", "bfloat16"),
                          ("x86-avx512", "float32")):
        layer = mhagen.mha(128, 4, dtype=dtype)
        m = mhagen.build(layer, preset, batch=1, seq_len=1024, weights=layer.init_weights(0))
        blocks[preset] = next(d["config"]["kv_block"] for d in m.decisions
                              if d["kernel"] == "attention")
    assert blocks == {AMX: 256, "x86-avx512-bf16": 512, "x86-avx512": 128}, blocks
    # GEMMs whose weight panel outgrows L1 (depth 768: 48 KiB of a 48 KiB L1d) run in blocks
    # of 256 of the depth outside the row tiles, accumulating; depth 512's (32 KiB) do not
    for d_model, blocked in ((768, True), (512, False)):
        deep = mhagen.mha(d_model, 12 if d_model == 768 else 8, dtype="bfloat16")
        m = mhagen.build(deep, AMX, batch=1, seq_len=64, weights=deep.init_weights(0))
        tir = m.inspect("tir")
        for kernel in ("qkv_projection", "output_projection"):
            text = tir[tir.index(f"def {kernel}("):]
            text = text[:text.index("mhagen_amx_release")]
            assert ("mhagen_amx_tile_32x32_acc" in text) == blocked, (d_model, kernel)
            if blocked:   # the depth blocks outside the row tiles, the write-back after
                assert text.index("for kt_0, m_0") < text.index("_acc") < text.rindex(
                    "T.sblock("), kernel


@pytest.mark.skipif(not resolve(AMX).runs_here(),
                    reason="needs a CPU with AMX-BF16 (Sapphire Rapids and later) and Linux "
                           "5.16+; compiled on every host by the test above")
@pytest.mark.parametrize("build", ["awkward", "any-length", "cross", "artifact", "c api",
                                   "attention", "attention any-length", "attention modifiers",
                                   "attention long", "deep"])
def test_amx_gemms_match_the_reference(build, tmp_path):
    """The AMX GEMMs run (2 threads: each task configures its own tiles): seq 97 with head
    dim 40, any-length builds (1 to 64 rows: the rows padded to 32-row tiles), cross-attention
    (the K/V GEMM and the attention's S^T from kv), and a saved artifact from Python
    (weights repacked on load) and from the C API (mha_create asks Linux for the tile
    state). "attention": head_dim 32, so S^T = K Q^T and P V run on AMX tiles too: seq 97
    (a key block cut at the last key: its tile's K rows clamped and copied, P V over the
    block's whole 32s with P 0 past the last key), grouped K/V heads, a causal mask; any
    lengths; ALiBi with key padding (scores modified and masked after the tile is
    stored); unmasked at seq 600, in AMX's key blocks of ~256 (two of 320, the second cut
    at the last key). "deep": d_model 768, GEMMs in blocks of the depth (amx.gemm_depth_block)."""
    layer = _tile_layer(head_dim=None) if build.startswith("attention") else _tile_layer()
    w = layer.init_weights(4)
    d_model = 128 if build.startswith("attention") else 64
    if build == "attention modifiers":
        layer = mhagen.mha(128, 4, score_mod=mhagen.alibi(4), key_padding=True,
                           dtype="bfloat16")
        w = layer.init_weights(2)
        m = mhagen.build(layer, AMX, batch=2, seq_len=70, weights=w)
        assert "Q K^T and P V on AMX tiles" in m.precision
        _check(layer, m, _x((2, 70, 128), "bfloat16"), w, "bfloat16",
               kv_lens=np.array([70, 13], np.int32))
        return
    if build == "attention long":
        layer = mhagen.mha(128, 4, dtype="bfloat16")    # head_dim 32, no mask
        w = layer.init_weights(6)
        m = mhagen.build(layer, AMX, batch=1, seq_len=600, weights=w)
        config = next(d["config"] for d in m.decisions if d["kernel"] == "attention")
        assert config["kv_block"] >= 256 and 600 > config["kv_block"], config
        _check(layer, m, _x((1, 600, 128), "bfloat16"), w, "bfloat16")
        return
    if build == "deep":   # depth 768: the GEMMs in blocks of 256 of the depth
        layer = mhagen.mha(768, 12, causal=True, dtype="bfloat16")
        w = layer.init_weights(5)
        m = mhagen.build(layer, AMX, batch=2, seq_len=97, weights=w)
        assert "_acc" in m.inspect("tir")
        _check(layer, m, _x((2, 97, 768), "bfloat16"), w, "bfloat16")
        return
    if build == "attention any-length":
        # up to 3 x 264 rows: GEMMs whose row blocks would be symbolic (the random AMX
        # layers found TVM's tensorize failing under them: such GEMMs run one block)
        m = mhagen.build(layer, AMX, batch=3, seq_len=None, max_seq_len=264, weights=w)
        assert "Q K^T and P V on AMX tiles" in m.precision
        for seq in (1, 31, 33, 264):
            _check(layer, m, _x((3, seq, d_model), "bfloat16", seed=seq), w, "bfloat16")
        return
    if build == "cross":
        layer = mhagen.mha(64, 2, cross=True, dtype="bfloat16")    # head_dim 32
        w = layer.init_weights(3)
        m = mhagen.build(layer, AMX, batch=2, seq_len=11, kv_seq_len=45, weights=w)
        assert "w_kv" in m.precision and "Q K^T and P V on AMX tiles" in m.precision
        _check(layer, m, _x((2, 11, 64), "bfloat16"), w, "bfloat16",
               context=_x((2, 45, 64), "bfloat16", seed=7))
        return
    if build == "any-length":
        m = mhagen.build(layer, AMX, batch=2, seq_len=None, max_seq_len=64, weights=w)
        for seq in (1, 13, 64):
            _check(layer, m, _x((2, seq, 64), "bfloat16", seed=seq), w, "bfloat16")
        return
    m = mhagen.build(layer, AMX, batch=2, seq_len=97, weights=w)
    assert "run on AMX tiles" in m.precision
    assert ("Q K^T and P V on AMX tiles" in m.precision) == (build == "attention")
    x = _x((2, 97, d_model), "bfloat16")
    y = _check(layer, m, x, w, "bfloat16")
    if build == "artifact":
        loaded = mhagen.load(m.save(tmp_path / "m"))
        loaded.bind(w)      # new weights are repacked by the manifest's recipe
        np.testing.assert_array_equal(loaded(x).view(np.uint16), y.view(np.uint16))
    if build == "c api":
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            pytest.skip("needs a C compiler")
        art = m.save(tmp_path / "m")
        exe = build_c_app(cc, art, tmp_path / "app")
        x.tofile(tmp_path / "x.bin")
        r = subprocess.run([str(exe), str(art), str(tmp_path / "x.bin"),
                            str(tmp_path / "y.bin")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got = np.fromfile(tmp_path / "y.bin", ml_dtypes.bfloat16).reshape(y.shape)
        np.testing.assert_array_equal(got.view(np.uint16), y.view(np.uint16))


def test_amx_gemms_of_one_step_convert_on_load():
    """A GEMM of depth 32 (one tdpbf16ps step) stays off the tiles: TVM's tensorize did not
    match the intrinsic over one step (the random AMX layers found d_model 32, head_dim 32:
    a ScheduleError from the build); its attention still runs on them. Compiled on every
    host, compared where AMX runs."""
    layer = mhagen.mha(32, 1, dtype="bfloat16")
    w = layer.init_weights(5)
    m = mhagen.build(layer, AMX, batch=2, seq_len=45, weights=w)
    assert m.precision.startswith("bfloat16 storage; the GEMMs convert to float32 on load")
    assert "the attention's Q K^T and P V on AMX tiles" in m.precision
    assert not [b for b in m.program.buffers.values() if (b.pack or {}).get("amx")]
    if m.target.runs_here():
        _check(layer, m, _x((2, 45, 32), "bfloat16"), w, "bfloat16")


def test_amx_code_is_refused_where_linux_refuses_the_tile_state(monkeypatch):
    """No SIGILL: where Linux does not grant AMX's tile state (before 5.16, or refused),
    code using AMX tiles is refused with the reason and the way out, before any kernel
    runs. The check is the AMX permission request itself (amx_permitted), faked here."""
    t = resolve(AMX)
    assert {"amx-tile", "amx-bf16"} <= set(t.required_features())
    monkeypatch.setattr(host, "amx_permitted", lambda: False)
    monkeypatch.setattr(host, "missing_features", lambda arch, required: [])
    why = t.cannot_run()
    assert "arch_prctl" in why and "without amx-tile" in why
    with pytest.raises(TargetError, match="AMX tiles"):
        t.check_runs_here()
    # a target without AMX is not asked about it
    assert resolve("x86-avx2").cannot_run() is None or "amx" not in resolve(
        "x86-avx2").cannot_run()


@pytest.mark.parametrize("seq", [1, 3, 7])
def test_bfloat16_pair_gemms_of_fewer_rows_than_a_tile(seq):
    """A GEMM of fewer rows than the 8-row register tile runs one shorter tile; its pair
    pack stage did not follow and had no rows at all (the long fuzz found batch 1, seq 1:
    TVM's ScheduleError from the build). Compiled on any host, run where AVX-512 BF16 is."""
    layer = mhagen.mha(8, 1, dtype="bfloat16")
    w = layer.init_weights(0)
    m = mhagen.build(layer, NATIVE, batch=1, seq_len=seq, weights=w)
    assert "multiply bfloat16 pairs" in m.precision
    if m.target.runs_here():
        _check(layer, m, _x((1, seq, 8), "bfloat16", seed=seq), w, "bfloat16")
