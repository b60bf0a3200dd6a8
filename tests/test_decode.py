"""Decoding with a K/V cache (mhagen.mha(..., kv_cache=N)): reference semantics, compiled
cache append + split-KV attention against the reference, errors, artifacts."""
import dataclasses
import json

import numpy as np
import pytest

import mhagen
from mhagen import KVCache
from mhagen.errors import GraphError, InputError, TargetError
from mhagen.dtypes import numpy_dtype
from mhagen.target import resolve
from mhagen.ir import rope
from mhagen.tolerances import assert_close, judged_as

from conftest import in_chunks, mha_by_hand, random_cache



def runnable(preset):
    t = resolve(preset)
    if not t.runs_here():
        pytest.skip(f"{preset} code cannot run on this CPU: {t.cannot_run()}")
    return preset


def test_reference_decoding_step_by_step_is_the_causal_layer():
    """A prompt of 7 then 13 single tokens through the cache == the causal layer on all 20
    tokens (rotary and ALiBi at absolute positions, grouped K/V)."""
    kw = dict(kv_heads=2, causal=True, rotary=True, score_mod=mhagen.alibi(4))
    full, dec = mhagen.mha(64, 4, **kw), mhagen.mha(64, 4, kv_cache=32, **kw)
    w = full.init_weights(0)
    x = np.random.default_rng(0).standard_normal((2, 20, 64)).astype(np.float32)
    cache = KVCache.empty(dec, 2, np.float64)
    got = in_chunks(dec, None, w, x, [7] + [1] * 13, cache)
    np.testing.assert_allclose(got, full.reference(x, w), rtol=1e-12, atol=1e-12)
    assert cache.lens.tolist() == [20, 20]


def test_reference_cache_holds_the_rows_by_hand():
    dec = mhagen.mha(32, 2, kv_cache=8, bias=True)
    w = dec.init_weights(1)
    x = np.random.default_rng(1).standard_normal((1, 3, 32))
    cache = KVCache.empty(dec, 1, np.float64)
    cache.lens[0] = 2
    dec.reference(x, w, cache=cache)
    k_by_hand = x[0] @ w["w_k"][1] + w["b_k"][1]
    np.testing.assert_allclose(cache.k[0, 1, 2:5], k_by_hand, rtol=1e-12)
    assert cache.lens.tolist() == [5]
    assert not cache.k[0, :, 5:].any()


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("case", [
    dict(d=80, heads=2, kv_heads=2, kw=dict(causal=True, rotary=True)),      # head_dim 40
    dict(d=160, heads=4, kv_heads=1, kw=dict(causal=True, score_mod=mhagen.alibi(4),
                                             mask=mhagen.sliding_window(20))),
    # 8 query heads a K/V head: rows in the lanes (8 rows; 5 tokens: 40 rows, tiles of 16)
    dict(d=320, heads=8, kv_heads=1, kw=dict(causal=True, rotary=True,
                                             score_mod=mhagen.softcap(5.0))),
    # 12 and 13 query rows a K/V head: tiles of 16 rows (AVX2; 13 on AVX-512), 3-4 copies
    dict(d=384, heads=12, kv_heads=1, kw=dict(causal=True)),
    dict(d=208, heads=13, kv_heads=1, kw=dict(causal=True)),
], ids=["hd40-rotary", "mqa-alibi-window", "mqa8-hd40-softcap", "mqa12", "mqa13"])
@pytest.mark.parametrize("new_tokens", [1, 5])
def test_compiled_decoding_matches_the_reference(target, case, new_tokens):
    """Batch 2 with different cached lengths (random cache contents below them), 4 calls:
    outputs and the cache rows written match the float64 reference."""
    layer = mhagen.mha(case["d"], case["heads"], kv_heads=case["kv_heads"], kv_cache=97,
                       **case["kw"])
    target = runnable(target)
    w = layer.init_weights(0)
    m = mhagen.build(layer, target, batch=2, seq_len=new_tokens, weights=w)
    rng = np.random.default_rng(2)
    cache = m.new_cache()
    random_cache(cache, rng)
    cache.lens[...] = [0, 61]
    ref = cache.copy()
    for _ in range(4):
        x = rng.standard_normal((2, new_tokens, case["d"])).astype(np.float32)
        assert_close(m(x, cache=cache), layer.reference(x, w, cache=ref))
    assert cache.lens.tolist() == ref.lens.tolist() == [4 * new_tokens, 61 + 4 * new_tokens]
    assert_close(cache.k, ref.k)
    assert_close(cache.v, ref.v)


def test_decode_tasks_share_the_calls_key_blocks_evenly():
    """The split-KV template cuts the call's key blocks (every group's: batch row, K/V head,
    row tile, in order) into one even, contiguous share per task, whatever the rows' cache
    lengths: modelled for rows of 4000 and 100 cached keys on 2 threads (8 tasks, as a tuned
    config may have), each thread runs half the blocks, where splits of the cache left one
    thread 31x the other's. Builds for 1, 2 (x86), 3, 16 and 64 cores (x86-avx2; a task a
    core) match the reference on
    rows of 0, 1, 300, 700 and 1023 - S cached keys (pieces that start and end inside
    groups, and tasks with nothing to do), causal and not, for 1 and 3 new tokens."""
    from mhagen.schedules.cpu.decode import balanced_share
    blocks = [-(-4001 // 64)] * 8 + [-(-101 // 64)] * 8    # row 0's 8 K/V heads, row 1's
    total = sum(blocks)
    shares = [balanced_share(t, 8, total) for t in range(8)]
    assert shares[0][0] == 0 and shares[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    threads = [sum(hi - lo for lo, hi in shares[4 * t:4 * t + 4]) for t in range(2)]
    assert max(threads) - min(threads) <= 1
    # computed without products past total or workers^2 (the kernel's int32), exactly
    assert all(balanced_share(t, 256, 2**31 - 1) == (t * (2**31 - 1) // 256,
                                                     (t + 1) * (2**31 - 1) // 256)
               for t in range(256))
    for causal in (False, True):
        layer = mhagen.mha(64, 4, kv_heads=1, kv_cache=1024, causal=causal)
        w = layer.init_weights(7)
        for preset, cores, new_tokens in (("x86", 1, 1), ("x86", 2, 3), ("x86-avx2", 3, 1),
                                          ("x86-avx2", 16, 3), ("x86-avx2", 64, 1)):
            t = dataclasses.replace(resolve(runnable(preset)), cores=cores)
            m = mhagen.build(layer, t, batch=5, seq_len=new_tokens, weights=w)
            cfg = next(d["config"] for d in m.info.decisions if d["rule"] == "decode_attention")
            assert cfg["workers"] == cores, cfg
            rng = np.random.default_rng(new_tokens)
            cache = m.new_cache()
            random_cache(cache, rng)
            cache.lens[...] = [0, 1, 300, 700, 1024 - new_tokens]
            ref = cache.copy()
            x = rng.standard_normal((5, new_tokens, 64)).astype(np.float32)
            assert_close(m(x, cache=cache), layer.reference(x, w, cache=ref))


def test_compiled_decoding_step_by_step_is_the_causal_layer():
    """Prefill (seq 9) and 12 decode steps (seq 1), two modules sharing one cache, match the
    causal layer's reference on all 21 tokens."""
    kw = dict(kv_heads=2, causal=True, rotary=True)
    full, dec = mhagen.mha(96, 4, **kw), mhagen.mha(96, 4, kv_cache=40, **kw)
    w = full.init_weights(3)
    x = np.random.default_rng(3).standard_normal((1, 21, 96)).astype(np.float32)
    prefill = mhagen.build(dec, "x86", batch=1, seq_len=9, weights=w)
    step = mhagen.build(dec, "x86", batch=1, seq_len=1, weights=w)
    cache = step.new_cache()
    outs = [prefill(x[:, :9], cache=cache)] + [step(x[:, t:t + 1], cache=cache)
                                               for t in range(9, 21)]
    got = np.concatenate(outs, axis=1)
    assert_close(got, full.reference(x, w))
    assert_close(got, mha_by_hand(w, x, 4, causal=True,
                                  rotate=lambda t: rope.apply(t, 24, 10000.0)))


def test_a_cache_whose_arrays_are_replaced_is_written_where_they_now_are():
    """A call keeps the TVM tensors over a cache's k and v for the next call; arrays put in
    their place (cache.k = ...) are the ones the next step reads and writes, and two caches
    in turn each keep their own rows."""
    layer = mhagen.mha(64, 4, kv_heads=2, kv_cache=16, causal=True)
    w = layer.init_weights(1)
    m = mhagen.build(layer, "x86", batch=1, seq_len=1, weights=w)
    a, b = m.new_cache(), m.new_cache()
    ref_a, ref_b = KVCache.empty(layer, 1, np.float64), KVCache.empty(layer, 1, np.float64)
    rng = np.random.default_rng(5)
    for step in range(4):
        if step == 2:        # new arrays holding the same rows
            old_k, old_v = a.k, a.v
            fresh = KVCache.from_arrays(a.k, a.v, a.lens)
            a.k, a.v = fresh.k, fresh.v
        for cache, ref in ((a, ref_a), (b, ref_b)):
            x = rng.standard_normal((1, 1, 64)).astype(np.float32)
            assert_close(m(x, cache=cache), layer.reference(x, w, cache=ref))
    assert a.lens.tolist() == b.lens.tolist() == [4]
    assert_close(a.k[:, :, :4], ref_a.k[:, :, :4])
    assert_close(a.v[:, :, :4], ref_a.v[:, :, :4])
    assert_close(b.k[:, :, :4], ref_b.k[:, :, :4])
    # rows 2 and 3 went to the new arrays only
    assert not old_k[:, :, 2:4].any() and not old_v[:, :, 2:4].any()


def test_a_full_cache_and_rows_that_see_nothing():
    """A row at max_len - 1 (the last free slot) and a non-causal window that hides every
    key of the other row: zeros, not NaN."""
    layer = mhagen.mha(32, 2, kv_cache=16, mask=mhagen.kv_idx < 0)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=2, seq_len=1, weights=w)
    cache = m.new_cache()
    cache.lens[...] = [15, 3]
    ref = cache.copy()
    x = np.random.default_rng(0).standard_normal((2, 1, 32)).astype(np.float32)
    y = m(x, cache=cache)
    assert_close(y, layer.reference(x, w, cache=ref))
    np.testing.assert_allclose(y, np.broadcast_to(w["b_o"], y.shape), rtol=1e-6)


def test_bad_caches_and_layers_are_refused():
    layer = mhagen.mha(32, 2, kv_cache=8, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=1, seq_len=3, weights=w)
    x = np.zeros((1, 3, 32), np.float32)
    with pytest.raises(InputError, match="KVCache.empty"):
        m(x)
    cache = m.new_cache()
    cache.lens[0] = 6
    with pytest.raises(InputError, match="lens <= 5"):
        m(x, cache=cache)
    assert cache.lens[0] == 6                        # nothing written, nothing advanced
    bad = KVCache(cache.k[:, :, :4], cache.v, cache.lens.copy())
    with pytest.raises(InputError, match="shape"):
        m(x, cache=bad)
    unaligned = KVCache(cache.k.astype(np.float64), cache.v, np.zeros(1, np.int32))
    with pytest.raises(InputError, match="aligned float32"):
        m(x, cache=unaligned)
    with pytest.raises(InputError, match="int32"):
        m(x, cache=KVCache(cache.k, cache.v, [0]))
    plain = mhagen.build(mhagen.mha(32, 2), "x86", batch=1, seq_len=3,
                         weights=mhagen.mha(32, 2).init_weights(0))
    with pytest.raises(InputError, match="keeps no K/V cache"):
        plain(x, cache=cache)
    with pytest.raises(InputError, match="keeps no K/V cache"):
        KVCache.empty(mhagen.mha(32, 2))
    with pytest.raises(GraphError, match="do not fit the K/V cache"):
        mhagen.build(layer, "x86", batch=1, seq_len=9, weights=w)
    with pytest.raises(GraphError, match="fused kernels only"):
        mhagen.build(layer, "x86", batch=1, seq_len=1, weights=w, fuse=False)
    with pytest.raises(GraphError, match="key_padding"):
        mhagen.mha(32, 2, kv_cache=8, key_padding=True)
    with pytest.raises(TargetError, match="decoding layers"):
        mhagen.build(layer, "cuda-sm90", batch=1, seq_len=1, weights=w)
    with pytest.raises(mhagen.MhagenError, match="form=.fused. or form=.gqa."):
        mhagen.export_onnx(layer, "/nonexistent/never-written.onnx", w)


def test_saved_decoding_module_loads_and_continues(tmp_path):
    """Save, load (no compiler), continue decoding from the same cache: same numbers as the
    built module; the artifact has a C API (mha_run_cached: tests/test_c_api.py)."""
    layer = mhagen.mha(64, 4, kv_heads=2, kv_cache=24, causal=True, rotary=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=1, seq_len=1, weights=w)
    m.save(tmp_path / "dec")
    loaded = mhagen.load(tmp_path / "dec")
    manifest = json.loads((tmp_path / "dec" / "manifest.json").read_text())
    assert "skipped" not in manifest["c_api"]
    assert "#define MHA_KV_CACHE 24" in (tmp_path / "dec" / "mha.h").read_text()
    rng = np.random.default_rng(0)
    a, b = m.new_cache(), loaded.new_cache()
    for _ in range(5):
        x = rng.standard_normal((1, 1, 64)).astype(np.float32)
        np.testing.assert_array_equal(m(x, cache=a), loaded(x, cache=b))
    np.testing.assert_array_equal(a.k, b.k)
    assert b.lens.tolist() == [5]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-mask"])
def test_onnx_past_present_export_runs_in_onnxruntime(tmp_path, causal):
    """The fused ONNX form of a decoding layer (Attention with past_key/past_value, symbolic
    past length): onnxruntime on two past lengths == the reference with cache.lens = past."""
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(64, 4, kv_heads=2, causal=causal, kv_cache=40)
    w = layer.init_weights(0)
    path = mhagen.export_onnx(layer, tmp_path / "dec.onnx", w, form="fused", batch=2,
                              seq_len=3)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x", "past_key", "past_value"]
    assert sess.get_inputs()[1].shape == [2, 2, "past_seq", 16]
    rng = np.random.default_rng(0)
    for past in (0, 11):
        cache = KVCache.empty(layer, 2, np.float64)
        random_cache(cache, rng)
        cache.lens[...] = past
        x = rng.standard_normal((2, 3, 64)).astype(np.float32)
        feeds = {"x": x, "past_key": cache.k[:, :, :past].astype(np.float32),
                 "past_value": cache.v[:, :, :past].astype(np.float32)}
        y, present_k, present_v = sess.run(None, feeds)
        assert_close(y, layer.reference(x, w, cache=cache))
        assert_close(present_k, cache.k[:, :, :past + 3])
        assert_close(present_v, cache.v[:, :, :past + 3])


def test_onnx_export_of_decoding_layers_refuses_what_it_cannot_carry(tmp_path):
    for kwargs, match in ((dict(mask=mhagen.sliding_window(8)), "causal or no mask"),
                          (dict(rotary=True), "rotary"),
                          (dict(score_mod=mhagen.softcap(5.0)), "score modifier")):
        layer = mhagen.mha(32, 2, kv_cache=16, causal=True, **kwargs)
        with pytest.raises(mhagen.MhagenError, match=match):
            mhagen.export_onnx(layer, tmp_path / "no.onnx", layer.init_weights(0), form="fused")
    assert not (tmp_path / "no.onnx").exists()


def test_a_prepared_call_runs_decode_steps_in_place():
    """module.prepare(x, cache=...) binds the arrays once: 6 steps, each writing the next
    token into x in place, equal the reference step by step (cache rows and lens too); a
    bad cache length, an unaligned x and weights bound again are refused with the fix."""
    layer = mhagen.mha(64, 4, kv_heads=2, kv_cache=24, causal=True, rotary=True)
    w = layer.init_weights(3)
    m = mhagen.build(layer, "x86", batch=2, seq_len=1, weights=w)
    cache, ref = m.new_cache(), KVCache.empty(layer, 2, np.float64)
    cache.lens[...] = ref.lens[...] = [0, 5]
    x = mhagen.aligned_empty((2, 1, 64))
    step = m.prepare(x, cache=cache)
    rng = np.random.default_rng(4)
    for _ in range(6):
        x[...] = rng.standard_normal(x.shape)
        y = step()
        assert y is step.result
        assert_close(y, layer.reference(x, w, cache=ref))
    assert cache.lens.tolist() == ref.lens.tolist() == [6, 11]
    assert_close(cache.k, ref.k)
    cache.lens[...] = [0, 24]
    with pytest.raises(InputError, match="lens <= 23"):
        step()
    with pytest.raises(InputError, match="aligned"):      # 4 bytes past an allocation
        m.prepare(np.zeros(2 * 64 + 1, np.float32)[1:].reshape(2, 1, 64), cache=cache)
    cache.lens[...] = 0
    m.bind(layer.init_weights(5))
    with pytest.raises(InputError, match="prepare the call again"):
        step()


def test_a_prepared_call_with_key_lengths_reads_them_every_run():
    """Key padding: kv_lens bound by prepare() are read anew each run (changed in place)."""
    layer = mhagen.mha(64, 4, key_padding=True)
    w = layer.init_weights(1)
    m = mhagen.build(layer, "x86", batch=2, seq_len=9, weights=w)
    x = mhagen.aligned_empty((2, 9, 64))
    x[...] = np.random.default_rng(2).standard_normal(x.shape)
    lens = np.array([9, 3], np.int32)
    run = m.prepare(x, kv_lens=lens)
    for now in ([9, 3], [1, 7], [0, 9]):
        lens[...] = now
        assert_close(run(), layer.reference(x, w, kv_lens=lens))
    lens[...] = [10, 1]
    with pytest.raises(InputError, match="0..9"):
        run()


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
def test_half_precision_caches_match_the_reference(target, cache_dtype):
    """cache_dtype: the cache stores the new K/V rows rounded to it (nearest even) and the
    kernels read them back as float32. 8 query heads on 2 and on 1 K/V head (head_dim lanes,
    rows in lanes), head_dim 40, rotary, causal; 1 and 3 new tokens, 3 calls on rows cached
    0 and 40 deep: outputs and the cache rows match the float64 reference, whose cache rows
    are rounded the same way (the graph says so), whatever its arrays hold; within the cache
    dtype's tolerance (rows rounded from float32 here and float64 there may fall an ulp
    apart)."""
    target = runnable(target)
    for kv_heads, new in ((2, 1), (1, 3)):
        layer = mhagen.mha(80, 8, head_dim=40, kv_heads=kv_heads, causal=True, rotary=True,
                           kv_cache=97, cache_dtype=cache_dtype)
        w = layer.init_weights(0)
        m = mhagen.build(layer, target, batch=2, seq_len=new, weights=w)
        cache = m.new_cache()
        assert cache.k.dtype == cache.v.dtype == numpy_dtype(cache_dtype)
        cache.lens[...] = [0, 40]
        ref = KVCache.empty(layer, 2, np.float64)
        ref.lens[...] = [0, 40]
        rng = np.random.default_rng(5)
        for _ in range(3):
            x = rng.standard_normal((2, new, 80)).astype(np.float32)
            assert_close(m(x, cache=cache), layer.reference(x, w, cache=ref),
                         judged_as(layer))
        assert judged_as(layer) == cache_dtype
        assert np.array_equal(ref.k, ref.k.astype(numpy_dtype(cache_dtype)).astype(np.float64))
        assert_close(cache.k, ref.k, cache_dtype)
        assert_close(cache.v, ref.v, cache_dtype)


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_onnx_past_present_of_a_half_precision_cache(tmp_path, cache_dtype):
    """A half-precision cache exports as past/present in its dtype, Cast around Attention and
    the new K/V rounded before it (as the kernels read them from the cache): onnxruntime
    against the reference on a past of 11 rows; present holds the reference's cache rows."""
    import onnx
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, kv_cache=40, cache_dtype=cache_dtype)
    w = layer.init_weights(0)
    model = onnx.load(str(mhagen.export_onnx(layer, tmp_path / "dec.onnx", w, form="fused",
                                             batch=2, seq_len=3)))
    elem = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}
    assert [i.type.tensor_type.elem_type for i in model.graph.input][1:] == \
        [elem[cache_dtype]] * 2
    for name in ("present_key", "present_value"):   # read back as float32 (numpy's bridge)
        model.graph.node.append(onnx.helper.make_node("Cast", [name], [name + "_read"],
                                                      to=onnx.TensorProto.FLOAT))
        model.graph.output.append(onnx.helper.make_tensor_value_info(
            name + "_read", onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cache = KVCache.empty(layer, 2)             # arrays of the cache dtype
    random_cache(cache, rng)
    cache.lens[...] = 11
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    past = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
        np.ascontiguousarray(a[:, :, :11]).view(np.uint16), elem[cache_dtype])
        for n, a in (("past_key", cache.k), ("past_value", cache.v))}
    outs = sess.run_with_ort_values(
        ["y", "present_key_read", "present_value_read"],
        {"x": ort.OrtValue.ortvalue_from_numpy(x), **past})
    y, present_k, present_v = (o.numpy() for o in outs)
    assert_close(y, layer.reference(x, w, cache=cache), judged_as(layer))
    np.testing.assert_array_equal(present_k, cache.k[:, :, :14].astype(np.float32))
    np.testing.assert_array_equal(present_v, cache.v[:, :, :14].astype(np.float32))


def test_a_half_precision_cache_refuses_other_arrays_and_survives_save_load(tmp_path):
    """A bfloat16 cache: KVCache.empty gives bfloat16 arrays, a float32 cache is refused with
    the fix, a saved module keeps its cache dtype."""
    layer = mhagen.mha(32, 2, kv_cache=8, causal=True, cache_dtype="bfloat16")
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=1, seq_len=1, weights=w)
    x = np.ones((1, 1, 32), np.float32)
    wrong = KVCache.empty(layer, 1, np.float32)
    with pytest.raises(InputError, match="aligned bfloat16"):
        m(x, cache=wrong)
    cache = m.new_cache()
    y = m(x, cache=cache)
    loaded = mhagen.load(m.save(tmp_path / "m"))
    again = loaded.new_cache()
    assert again.k.dtype == cache.k.dtype
    np.testing.assert_array_equal(loaded(x, cache=again), y)
    np.testing.assert_array_equal(again.k.view(np.uint16), cache.k.view(np.uint16))
    with pytest.raises(GraphError, match="pass kv_cache=N too"):
        mhagen.mha(32, 2, cache_dtype="float16")
    with pytest.raises(GraphError, match="not supported"):
        mhagen.mha(32, 2, kv_cache=8, cache_dtype="int8")
