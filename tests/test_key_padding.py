"""Key padding by length (issue 14, part): per-batch key lengths given at call time, no S x S
mask; the kernels mask keys past the length and skip the key blocks past it."""
import json

import numpy as np
import pytest
from conftest import mha_by_hand, random_input

import mhagen
from mhagen.blockmask import FULL, PARTIAL, SKIP, block_table
from mhagen.passes import run_passes
from mhagen.target import resolve
from mhagen.tolerances import assert_close

LENGTHS = np.array([97, 40, 1, 0], np.int32)   # full, cut inside a block, one key, none


def test_reference_semantics():
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, key_padding=True)
    w, x = layer.init_weights(1), random_input(layer, 4, 97)
    y = layer.reference(x, w, kv_lens=LENGTHS)
    padding = np.arange(97) < LENGTHS[:, None, None]
    np.testing.assert_allclose(y, mha_by_hand(w, x, 4, causal=True, keep=padding),
                               rtol=1e-12, atol=1e-12)
    # a batch row with no key gives zero attention: only the output bias is left
    np.testing.assert_array_equal(y[3], np.broadcast_to(w["b_o"], y[3].shape))


def runnable(preset):
    t = resolve(preset)
    if not t.runs_here():
        pytest.skip(f"{preset} code cannot run on this CPU: {t.cannot_run()}")
    return preset


@pytest.mark.parametrize("preset", ["x86", "x86-avx2"])
@pytest.mark.parametrize("causal,fuse", [(True, True), (False, True), (True, False)])
def test_compiled_matches_the_reference(preset, causal, fuse):
    layer = mhagen.mha(320, 8, head_dim=40, kv_heads=2, causal=causal, key_padding=True)
    w, x = layer.init_weights(2), random_input(layer, 4, 97)
    m = mhagen.build(layer, runnable(preset), batch=4, seq_len=97, weights=w, fuse=fuse)
    assert m.program.fusion.startswith("fused" if fuse else "not fused")
    assert m.program.buffers["kv_lens"].role == "input"
    for lens in (LENGTHS, np.full(4, 97, np.int32), np.array([3, 96, 0, 64])):
        assert_close(m(x, kv_lens=lens), layer.reference(x, w, kv_lens=lens))


def test_blocks_past_the_length_are_skipped_at_run_time():
    """The build-time table cannot know the lengths: it is built from the other mask parts
    (causal), and the kernel skips blocks past the length of each call."""
    mask = mhagen.causal() & (mhagen.kv_idx < mhagen.ir.kv_len)
    padded = block_table(mask, 1, 1, 256, 64, 64, lengths=True)
    assert (padded == block_table(mhagen.causal(), 1, 1, 256, 64, 64)).all()
    assert {SKIP, PARTIAL, FULL} <= set(np.unique(padded))
    # another mask part reading kv_len: no block may be FULL any more
    odd = mhagen.kv_idx > mhagen.ir.kv_len - 8
    assert FULL not in block_table(odd, 1, 1, 256, 64, 64, lengths=True)


def test_lengths_that_read_kv_len_otherwise_match_the_reference():
    """A mask using kv_len beyond padding (the last 8 keys of each row's length)."""
    g = mhagen.Graph("recent")
    x = g.input("x", 32)
    lens = g.lengths()
    outs = []
    for h in range(2):
        q, k, v = (g.head_projection(x, f"w_{r}", h, 16) for r in "qkv")
        s = g.mask(g.scale(g.scores(q, k), 0.25),
                   (mhagen.kv_idx < mhagen.ir.kv_len) & (mhagen.kv_idx >= mhagen.ir.kv_len - 8),
                   head=h, lengths=lens)
        outs.append(g.weighted_sum(g.softmax(s), v))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 32))
    w, xs = g.init_weights(0), random_input(g, 3, 70)
    m = mhagen.build(g, runnable("x86-avx2"), batch=3, seq_len=70, weights=w)
    assert m.program.fusion.startswith("fused")
    lens_ = np.array([70, 13, 5], np.int32)
    assert_close(m(xs, kv_lens=lens_), g.reference(xs, w, kv_lens=lens_))


def test_bad_lengths_are_refused_clearly():
    layer = mhagen.mha(32, 2, key_padding=True)
    m = mhagen.build(layer, runnable("x86-avx2"), batch=2, seq_len=8,
                     weights=layer.init_weights(0))
    x = random_input(layer, 2, 8)
    for bad, match in ((None, "pass kv_lens"), (np.array([1, 2, 3]), "shape \\(2,\\)"),
                       (np.array([1.0, 2.0]), "integers"), (np.array([9, 1]), "in 0..8"),
                       (np.array([-1, 1]), "in 0..8")):
        with pytest.raises(mhagen.InputError, match=match):
            m(x, kv_lens=bad)
    plain = mhagen.build(mhagen.mha(32, 2), runnable("x86-avx2"), batch=2, seq_len=8,
                         weights=layer.init_weights(0))
    with pytest.raises(mhagen.InputError, match="takes no key lengths"):
        plain(x, kv_lens=np.array([1, 2]))


def test_saved_and_loaded_with_its_lengths_input(tmp_path):
    layer = mhagen.mha(32, 2, causal=True, key_padding=True)
    w, x = layer.init_weights(0), random_input(layer, 2, 17)
    path = mhagen.build(layer, runnable("x86-avx2"), batch=2, seq_len=17,
                        weights=w).save(tmp_path / "m")
    man = json.loads((path / "manifest.json").read_text())
    assert "skipped" not in man["c_api"]      # mha_run_padded (tests/test_c_api.py)
    assert "#define MHA_KEY_PADDING 1" in (path / "mha.h").read_text()
    lens = np.array([17, 6], np.int32)
    assert_close(mhagen.load(path)(x, kv_lens=lens), layer.reference(x, w, kv_lens=lens))


@pytest.mark.parametrize("fused_graph", [False, True], ids=["decomposed", "fused-graph"])
def test_onnx_export_takes_the_lengths_as_an_input(tmp_path, fused_graph):
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(48, 6, kv_heads=2, causal=True, key_padding=True)
    w, x = layer.init_weights(0), random_input(layer, 3, 11)
    lens = np.array([11, 5, 0], np.int32)
    graph = run_passes(layer, fuse=True).graph if fused_graph else layer
    path = mhagen.export_onnx(graph, tmp_path / "m.onnx", weights=w, seq_len=11, batch=3,
                              dynamic_seq=True)
    y = ort.InferenceSession(str(path)).run(None, {"x": x, "kv_lens": lens})[0]
    assert_close(y, layer.reference(x, w, kv_lens=lens))
    with pytest.raises(mhagen.onnx.OnnxError, match="key lengths.*form='decomposed'"):
        mhagen.export_onnx(layer, tmp_path / "f.onnx", weights=w, seq_len=11, form="fused")
