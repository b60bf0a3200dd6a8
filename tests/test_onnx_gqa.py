"""The gqa ONNX form: decoding layers as onnxruntime's com.microsoft.GroupQueryAttention,
run in onnxruntime (CPU) on a mhagen KVCache with rows of different lengths and per-row
new-token counts, against the float64 reference of the same calls row by row; what the
contract cannot carry is refused with the reason and nothing written."""
import numpy as np
import onnx
import pytest

import mhagen
from mhagen import KVCache
from mhagen.errors import InputError
from mhagen.onnx import gqa_binding, gqa_feeds, gqa_step
from mhagen.onnx._common import OnnxError
from mhagen.tolerances import assert_close, judged_as

ort = pytest.importorskip("onnxruntime")

T5_TABLE = np.random.default_rng(7).standard_normal((4, 8)).round(3).tolist()

LAYERS = {
    # name: (mha keywords, batch, calls: new tokens per row -- x padded to the largest,
    #        what the node carries: do_rotary, local_window_size, softcap, attention_bias)
    "rotary-gqa": (dict(d_model=64, num_heads=4, kv_heads=2, head_dim=16, causal=True,
                        rotary=True, kv_cache=64),
                   3, [(7, 3, 0), (1, 1, 1), (1, 1, 1), (1, 4, 0), (2, 1, 1)],
                   dict(do_rotary=1)),
    "window-softcap-scale": (dict(d_model=64, num_heads=4, kv_heads=2, head_dim=16,
                                  causal=True, mask=mhagen.sliding_window(3),
                                  score_mod=mhagen.softcap(1.5), scale=0.7, kv_cache=24),
                             2, [(6, 2), (1, 1), (1, 1), (3, 1)],
                             dict(local_window_size=3, softcap=1.5)),
    # rotary_dim 16 of head_dim 32: GroupQueryAttention's own partial rotary (do_rotary)
    "partial-rotary": (dict(d_model=64, num_heads=2, kv_heads=1, head_dim=32, causal=True,
                            rotary=mhagen.rotary(base=500.0, rotary_dim=16), kv_cache=24),
                       2, [(5, 1), (1, 1), (1, 3)], dict(do_rotary=1)),
    # head_dim 40: rotary in the graph (the op's tables need multiples of 16); float16 layer
    "hd40-graph-rotary-fp16": (dict(d_model=80, num_heads=2, kv_heads=1, head_dim=40,
                                    causal=True, rotary=True, kv_cache=24, dtype="float16"),
                               2, [(4, 2), (1, 1), (1, 0), (1, 1)], {}),
    # a float16 cache: new K/V rows rounded before the op reads them (rotary in the graph)
    "fp16-cache": (dict(d_model=64, num_heads=4, kv_heads=2, head_dim=16, causal=True,
                        rotary=True, kv_cache=24, cache_dtype="float16"),
                   2, [(5, 2), (1, 1), (1, 1), (2, 2)], {}),
    # softcap, then ALiBi as attention_bias at each row's positions (the op's order)
    "softcap-alibi": (dict(d_model=64, num_heads=4, kv_heads=2, head_dim=16, causal=True,
                           score_mod=[mhagen.softcap(1.5), mhagen.alibi(4)], kv_cache=24),
                      2, [(5, 2), (1, 1), (3, 1)], dict(softcap=1.5, attention_bias=True)),
    # no mask: causal=0 and no query_seqlens input (a right-padded first call, then single
    # tokens); T5's relative-position buckets as attention_bias
    "non-causal-t5-bias": (dict(d_model=64, num_heads=4, kv_heads=2, head_dim=16,
                                rotary=True, kv_cache=24,
                                score_mod=mhagen.relative_bias(T5_TABLE, max_distance=6)),
                           2, [(5, 3), (1, 1), (1, 1)], dict(do_rotary=1, attention_bias=True)),
}


@pytest.fixture(scope="module", params=list(LAYERS))
def exported(request, tmp_path_factory):
    kw, batch, calls, _ = LAYERS[request.param]
    layer = mhagen.mha(**kw)
    w = layer.init_weights(1)
    path = mhagen.export_onnx(layer, tmp_path_factory.mktemp("gqa") / "m.onnx", w, form="gqa",
                              dynamic_batch=True, dynamic_seq=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return request.param, layer, w, onnx.load(str(path)), sess, batch, calls


def reference_rows(layer, w, ref, x, counts):
    """The reference of one call row by row: row b adds its first counts[b] tokens of x to
    its own slice of the float64 cache `ref`."""
    out = np.zeros(x.shape[:2] + (layer.inputs[0].attrs["shape"][2],))
    for b, n in enumerate(counts):
        if n:
            row = KVCache(ref.k[b:b + 1], ref.v[b:b + 1], ref.lens[b:b + 1])
            out[b, :n] = layer.reference(x[b:b + 1, :n], w, cache=row)[0]
    return out


def test_decode_calls_with_ragged_rows_equal_the_reference(exported):
    """A right-padded first call (rows of 7, 3 and 0 tokens...), single tokens, mixed counts
    and idle rows: y, cache.k/v and cache.lens equal the reference of the same calls; the
    past is mhagen's cache buffer, written in place (IO binding)."""
    name, layer, w, model, sess, batch, calls = exported
    rng = np.random.default_rng(0)
    cache, ref = KVCache.empty(layer, batch), KVCache.empty(layer, batch, np.float64)
    k_buffer = cache.k
    for counts in calls:
        x = rng.standard_normal((batch, max(counts), layer.inputs[0].attrs["shape"][2]))
        x = x.astype(np.float32)
        y = gqa_step(sess, cache, x, counts)
        expected = reference_rows(layer, w, ref, x, counts)
        # judged by the layer's dtype even with a float16 cache: the op reads the new K/V
        # rows rounded as the reference does (unrounded they were 6e-4 off here)
        assert_close(y.astype(np.float64), expected, layer.dtype)
        assert not y[np.arange(x.shape[1])[None, :] >= np.array(counts)[:, None]].any()
        assert cache.lens.tolist() == ref.lens.tolist()
    assert cache.k is k_buffer and cache.lens.tolist() == [sum(c) for c in zip(*calls)]
    for b, n in enumerate(cache.lens):
        for mine, theirs in ((cache.k, ref.k), (cache.v, ref.v)):
            assert_close(mine[b, :, :n].astype(np.float64), theirs[b, :, :n],
                         judged_as(layer))


def test_the_contract_in_the_model(exported):
    """Inputs, outputs and the node's attributes as the contract names them."""
    name, layer, w, model, sess, batch, calls = exported
    kw, carried = LAYERS[name][0], LAYERS[name][3]
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "com.microsoft"
    assert attrs.pop("num_heads") == kw["num_heads"]
    assert attrs.pop("kv_num_heads") == kw["kv_heads"]
    assert attrs.pop("scale") == pytest.approx(kw.get("scale", kw["head_dim"] ** -0.5))
    assert attrs.pop("causal") == int(kw.get("causal", False))
    if attrs.pop("rotary_interleaved", 0):
        pytest.fail("mhagen's rotary is the half-split layout")
    assert attrs == {k: v for k, v in carried.items() if k != "attention_bias"}
    assert (len(node.input) > 10 and node.input[10] != "") == ("attention_bias" in carried)
    inputs = [i.name for i in model.graph.input]
    assert inputs == ["x", "past_key", "past_value", "seqlens_k", "total_sequence_length"] + \
        (["query_seqlens"] if kw.get("causal") else [])
    assert [o.name for o in model.graph.output] == ["y", "present_key", "present_value"]
    dims = [d.dim_param or d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
    assert dims == ["batch", kw["kv_heads"], kw["kv_cache"], kw["head_dim"]]
    if carried.get("do_rotary"):      # cos/sin caches [max_len, rotary_dim / 2]: mhagen's
        cos = next(i for i in model.graph.initializer if i.name == node.input[7])
        rd = kw["head_dim"] if kw["rotary"] is True else kw["rotary"].rotary_dim
        assert list(cos.dims) == [kw["kv_cache"], rd // 2]
    assert [op.domain for op in model.opset_import] == ["", "com.microsoft"]


def test_session_run_with_gqa_feeds_gives_the_cache_after_the_call(exported):
    """session.run(None, gqa_feeds(...)): y and present_key/value (the whole buffers after
    the call, the past copied) equal what the in-place call gives and writes; packed tokens
    with cu_seqlens give the padded call's rows."""
    name, layer, w, model, sess, batch, calls = exported
    rng = np.random.default_rng(5)
    d = layer.inputs[0].attrs["shape"][2]
    start = KVCache.empty(layer, batch)
    lens = np.arange(batch) + 2
    gqa_step(sess, start, rng.standard_normal((batch, lens.max(), d)).astype(np.float32), lens)
    causal = "query_seqlens" in [i.name for i in model.graph.input]
    counts = [2] + [1] * (batch - 1) if causal else [1] * batch
    x = rng.standard_normal((batch, max(counts), d)).astype(np.float32)
    inputs = [i.name for i in sess.get_inputs()]
    x_run = x.astype(np.float16) if layer.dtype == "float16" else x    # the model's dtype
    y_run, present_k, present_v = sess.run(None, gqa_feeds(start, x_run, counts, inputs=inputs))
    in_place = KVCache.from_arrays(start.k, start.v, start.lens)
    y = gqa_step(sess, in_place, x, counts)
    for b, n in enumerate(counts):
        np.testing.assert_array_equal(y_run[b, :n], y[b, :n])
        np.testing.assert_array_equal(present_k[b, :, :lens[b] + n], in_place.k[b, :, :lens[b] + n])
        np.testing.assert_array_equal(present_v[b, :, :lens[b] + n], in_place.v[b, :, :lens[b] + n])
    packed = np.concatenate([x[b, :n] for b, n in enumerate(counts)])[None]
    again = KVCache.from_arrays(start.k, start.v, start.lens)
    y_packed = gqa_step(sess, again, packed, cu_seqlens=np.cumsum([0] + counts))
    np.testing.assert_array_equal(y_packed[0], np.concatenate([y[b, :n]
                                                               for b, n in enumerate(counts)]))
    assert again.lens.tolist() == in_place.lens.tolist() == (lens + counts).tolist()


@pytest.mark.parametrize("kw, fragment", [
    (dict(causal=True), "decoding layers"),
    (dict(head_dim=20, causal=True, kv_cache=16), "multiple of 8"),
    (dict(causal=True, kv_cache=16, cache_dtype="bfloat16"), "bfloat16 cache"),
    (dict(causal=True, kv_cache=16, score_mod=[mhagen.alibi(2), mhagen.softcap(5.0)]),
     "a bias before the cap"),
    (dict(causal=True, kv_cache=16, score_mod=[mhagen.softcap(5.0), mhagen.softcap(3.0)]),
     "a bias before the cap"),
    (dict(causal=True, kv_cache=16, score_mod=mhagen.score * 2), "a product with the score"),
    (dict(causal=True, kv_cache=16, score_mod=mhagen.score + mhagen.where(
        mhagen.kv_idx < 1, float("-inf"), 0.0)), "can be infinite"),
    (dict(causal=True, kv_cache=16, mask=mhagen.kv_idx >= 2), "nothing else"),
    (dict(causal=True, kv_cache=16, mask=mhagen.kv_idx <= mhagen.head), "differs per head"),
    (dict(causal=True, kv_cache=16, mask=mhagen.kv_idx < mhagen.q_len), "q_len"),
    (dict(kv_cache=16, mask=mhagen.q_idx - mhagen.kv_idx < 3), "nothing else"),  # no causal
    (dict(cross=True), "cross-attention"),
], ids=["no-cache", "head-dim-20", "bf16-cache", "alibi-then-softcap", "two-softcaps",
        "score-times-2", "infinite-bias", "mask", "per-head", "q-len", "window-without-causal",
        "cross"])
def test_what_the_contract_cannot_carry_is_refused(tmp_path, kw, fragment):
    kw = {"head_dim": 16, **kw}
    layer = mhagen.mha(2 * kw["head_dim"], 2, **kw)
    with pytest.raises(OnnxError, match=fragment):
        mhagen.export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), form="gqa",
                           kv_seq_len=8 if kw.get("cross") else None)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("mask, window", [
    (mhagen.q_idx >= mhagen.kv_idx, None),                       # causal, written by hand
    (mhagen.kv_idx > mhagen.q_idx - 5, 5),                       # with causal=True: a window
    (mhagen.sliding_window(40), None),                           # wider than the cache
], ids=["causal", "window-5", "window-past-max-len"])
def test_masks_are_read_by_what_they_select(tmp_path, mask, window):
    """A mask is read as causal or a causal window by the positions it keeps (checked at
    every position pair of the cache), however it is written."""
    layer = mhagen.mha(32, 2, head_dim=16, causal=True, mask=mask, kv_cache=32)
    path = mhagen.export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), form="gqa")
    node = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["causal"] == 1 and attrs.get("local_window_size", -1) == (window or -1)


def test_a_mask_written_by_hand_on_a_long_cache_is_refused(tmp_path):
    """Masks not written as causal=True / sliding_window(W) are read at every position pair,
    up to caches of 8192."""
    layer = mhagen.mha(32, 2, head_dim=16, mask=mhagen.q_idx >= mhagen.kv_idx, kv_cache=8193)
    with pytest.raises(OnnxError, match="up to kv_cache=8192"):
        mhagen.export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), form="gqa")
    assert not list(tmp_path.iterdir())


def test_bad_calls_are_refused_before_onnxruntime_runs(tmp_path):
    layer = mhagen.mha(32, 2, head_dim=16, causal=True, kv_cache=8)
    cache = KVCache.empty(layer, 2)
    x = np.zeros((2, 3, 32), np.float32)
    with pytest.raises(InputError, match="within 0..3"):
        gqa_feeds(cache, x, [4, 1])
    cache.lens[:] = [6, 0]   # row 0 has room for 2 tokens, but the padded chunk is 3
    with pytest.raises(InputError, match="padding included"):
        gqa_feeds(cache, x, [1, 3])
    with pytest.raises(InputError, match="KVCache"):
        gqa_feeds({"k": 0}, x)
    with pytest.raises(InputError, match="cu_seqlens"):
        gqa_feeds(cache.reset(), x[:1], cu_seqlens=[0, 2, 4])
    with pytest.raises(InputError, match="past_len"):
        mhagen.export_onnx(layer, tmp_path / "m.onnx", layer.init_weights(0), form="gqa",
                           past_len=4)
    plain = mhagen.mha(32, 2, head_dim=16, kv_cache=8)          # no query_seqlens input
    path = mhagen.export_onnx(plain, tmp_path / "p.onnx", plain.init_weights(0), form="gqa",
                              dynamic_seq=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache = KVCache.empty(plain, 2)
    cache.lens[:] = [3, 1]
    with pytest.raises(InputError, match="no query_seqlens"):
        gqa_step(sess, cache, np.zeros((2, 2, 32), np.float32), [2, 1])
    assert cache.lens.tolist() == [3, 1]


def test_a_bfloat16_layer_decodes_and_a_cache_of_another_dtype_is_refused(tmp_path):
    """x, y and the weights in bfloat16 (onnxruntime's numpy bridge has none: bound as bits);
    a float32 cache on a float16-cache model is refused with the fix."""
    layer = mhagen.mha(64, 4, kv_heads=2, head_dim=16, causal=True, kv_cache=16,
                       dtype="bfloat16", cache_dtype="float16")
    w = layer.init_weights(0)
    path = mhagen.export_onnx(layer, tmp_path / "m.onnx", w, form="gqa", batch=2, seq_len=3)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache, ref = KVCache.empty(layer, 2), KVCache.empty(layer, 2, np.float64)
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    y = gqa_step(sess, cache, x, [3, 2])
    assert y.dtype == mhagen.dtypes.numpy_dtype("bfloat16") and cache.k.dtype == np.float16
    expected = reference_rows(layer, w, ref, x, [3, 2])
    assert_close(y.astype(np.float64), expected, judged_as(layer))
    wrong = KVCache.empty(mhagen.mha(64, 4, kv_heads=2, head_dim=16, causal=True,
                                     kv_cache=16), 2)
    with pytest.raises(InputError, match="this model's past is tensor.float16."):
        gqa_step(sess, wrong, x)
    assert wrong.lens.tolist() == [0, 0]


def test_gqa_binding_reruns_the_same_call(tmp_path):
    """gqa_binding: the same call run twice gives the same y and writes the same rows (what a
    timing loop does); it leaves cache.lens to the caller."""
    layer = mhagen.mha(64, 4, kv_heads=2, head_dim=16, causal=True, rotary=True, kv_cache=32)
    w = layer.init_weights(2)
    path = mhagen.export_onnx(layer, tmp_path / "m.onnx", w, form="gqa", dynamic_batch=True,
                              dynamic_seq=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache = KVCache.empty(layer, 2)
    cache.lens[:] = [9, 4]
    rng = np.random.default_rng(3)
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    ref = KVCache.from_arrays(cache.k.astype(np.float64), cache.v.astype(np.float64), cache.lens)
    x = rng.standard_normal((2, 1, 64)).astype(np.float32)
    binding, y = gqa_binding(sess, cache, x)
    sess.run_with_iobinding(binding)
    first = y.copy()
    sess.run_with_iobinding(binding)
    np.testing.assert_array_equal(y, first)
    assert cache.lens.tolist() == [9, 4]
    assert_close(y.astype(np.float64), reference_rows(layer, w, ref, x, [1, 1]))


def test_the_command_line_writes_and_checks_the_gqa_form(tmp_path, capsys):
    from mhagen.cli import main
    out = tmp_path / "dec.onnx"
    assert main(["export-onnx", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
                 "--causal", "--kv-cache", "32", "--form", "gqa", "--batch", "3",
                 "--seq-len", "2", "--check", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gqa form" in text and "ok" in text and "FAILED" not in text
    assert any(n.op_type == "GroupQueryAttention" for n in onnx.load(str(out)).graph.node)
