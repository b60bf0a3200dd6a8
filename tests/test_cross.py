"""Cross-attention (mhagen.mha(..., cross=True)): queries from x, keys and values from a
context of its own length and width. Reference against torch, compiled (fused and unfused,
both x86 classes) against the reference, artifacts, the C API, ONNX, errors."""
import shutil
import subprocess

import numpy as np
import pytest

import mhagen
from mhagen.tolerances import assert_close
from tests.conftest import build_c_app, random_input

CC = shutil.which("gcc") or shutil.which("cc")


def _context(layer, batch, kv_seq, seed=1):
    width = layer.context_input.attrs["shape"][2]
    return np.random.default_rng(seed).standard_normal((batch, kv_seq, width)).astype(
        np.float32)


def test_reference_matches_torch_multihead_attention_with_kdim():
    torch = pytest.importorskip("torch")
    layer = mhagen.mha(64, 4, cross=True, kv_dim=48)
    w = layer.init_weights(0)
    x, c = random_input(layer, 2, 7).astype(np.float64), _context(layer, 2, 11).astype(
        np.float64)
    m = torch.nn.MultiheadAttention(64, 4, kdim=48, vdim=48, batch_first=True,
                                    dtype=torch.float64)
    cat = {k: np.concatenate(list(w[k]), axis=1).T for k in ("w_q", "w_k", "w_v")}
    with torch.no_grad():
        m.q_proj_weight.copy_(torch.from_numpy(cat["w_q"]))
        m.k_proj_weight.copy_(torch.from_numpy(cat["w_k"]))
        m.v_proj_weight.copy_(torch.from_numpy(cat["w_v"]))
        m.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
            [w["b_q"].ravel(), w["b_k"].ravel(), w["b_v"].ravel()])))
        m.out_proj.weight.copy_(torch.from_numpy(np.asarray(w["w_o"], np.float64).T))
        m.out_proj.bias.copy_(torch.from_numpy(np.asarray(w["b_o"], np.float64)))
    expected, _ = m(torch.from_numpy(x), torch.from_numpy(c), torch.from_numpy(c))
    np.testing.assert_allclose(layer.reference(x, w, context=c), expected.detach().numpy(),
                               atol=1e-10)


CASES = {
    "gqa-d40": dict(d_model=160, num_heads=4, head_dim=40, kv_heads=2, kv_dim=24),
    "window-padding": dict(d_model=64, num_heads=4, mask=mhagen.sliding_window(8),
                           key_padding=True),
    "causal-softcap": dict(d_model=64, num_heads=2, causal=True,
                           score_mod=mhagen.softcap(5.0), kv_dim=40),
}


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq,kv_seq", [(97, 33), (5, 200), (1, 1)])
def test_fused_cross_attention_matches_the_reference(target, case, seq, kv_seq):
    layer = mhagen.mha(cross=True, **CASES[case])
    w = layer.init_weights(1)
    module = mhagen.build(layer, target, batch=3, seq_len=seq, kv_seq_len=kv_seq, weights=w,
                          tuning=None)
    assert module.program.fusion.startswith("fused")
    assert [k.name for k in module.program.kernels][:2] == ["qkv_projection", "kv_projection"]
    x, c = random_input(layer, 3, seq, seed=seq), _context(layer, 3, kv_seq, seed=kv_seq)
    lens = None
    if layer.lengths_input is not None:   # a full row, a fully padded one (zeros), a half
        lens = np.array([kv_seq, 0, kv_seq // 2])
    assert_close(module(x, context=c, kv_lens=lens), layer.reference(x, w, context=c,
                                                                    kv_lens=lens))


def test_unfused_cross_attention_matches_the_reference():
    layer = mhagen.mha(48, 4, cross=True, kv_dim=20, kv_heads=1, causal=True)
    w = layer.init_weights(2)
    module = mhagen.build(layer, "x86", batch=2, seq_len=9, kv_seq_len=14, weights=w,
                          fuse=False, tuning=None)
    x, c = random_input(layer, 2, 9), _context(layer, 2, 14)
    assert_close(module(x, context=c), layer.reference(x, w, context=c))


def test_save_load_and_onnx_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    layer = mhagen.mha(64, 4, cross=True, kv_dim=24, key_padding=True,
                       mask=mhagen.ir.kv_idx >= mhagen.ir.q_len - 5)
    w = layer.init_weights(3)
    module = mhagen.build(layer, "x86", batch=2, seq_len=9, kv_seq_len=13, weights=w)
    loaded = mhagen.load(module.save(tmp_path / "art"))
    x, c, lens = random_input(layer, 2, 9), _context(layer, 2, 13), np.array([13, 4])
    np.testing.assert_array_equal(loaded(x, context=c, kv_lens=lens),
                                  module(x, context=c, kv_lens=lens))
    for dynamic in (False, True):
        path = mhagen.export_onnx(layer, tmp_path / "m.onnx", w, batch=2, seq_len=9,
                                  kv_seq_len=None if dynamic else 13, dynamic_seq=dynamic)
        session = ort.InferenceSession(str(path))
        for seq, kv_seq in ((9, 13),) + (((4, 21),) if dynamic else ()):
            x, c = random_input(layer, 2, seq, seed=seq), _context(layer, 2, kv_seq)
            lens = np.array([kv_seq, 2], np.int32)
            y = session.run(None, {"x": x, "context": c, "kv_lens": lens})[0]
            assert_close(y, layer.reference(x, w, context=c, kv_lens=lens))


@pytest.mark.parametrize("make,message", [
    (lambda: mhagen.mha(64, 4, cross=True, rotary=True), "does not combine with rotary"),
    (lambda: mhagen.mha(64, 4, cross=True, kv_cache=8), "does not combine with kv_cache"),
    (lambda: mhagen.mha(64, 4, kv_dim=32), "pass cross=True too"),
    (lambda: mhagen.mha(64, 4, cross=1), "cross= takes True or False"),
    (lambda: mhagen.build(mhagen.mha(64, 4, cross=True), "x86", seq_len=8),
     "give kv_seq_len=T"),
    (lambda: mhagen.build(mhagen.mha(64, 4), "x86", seq_len=8, kv_seq_len=8),
     "drop kv_seq_len"),
    (lambda: mhagen.build(mhagen.mha(64, 4, cross=True), "x86", seq_len=8,
                          kv_seq_len=8, max_kv_seq_len=9), "drop one"),
    (lambda: mhagen.build(mhagen.mha(64, 4, cross=True), "cuda-sm90", seq_len=8,
                          kv_seq_len=8, tuning=None), "does not compile fused for cuda"),
    (lambda: mhagen.tune(mhagen.mha(64, 4, cross=True), "x86", shapes=[(1, 8)], trials=1,
                         progress=False), "tuning cross-attention layers"),
])
def test_bad_cross_layers_are_refused(make, message):
    with pytest.raises(mhagen.MhagenError, match=message):
        make()


def test_bad_calls_are_refused():
    layer = mhagen.mha(32, 2, cross=True, kv_dim=16)
    w = layer.init_weights(0)
    module = mhagen.build(layer, "x86", batch=1, seq_len=4, kv_seq_len=6, weights=w,
                          tuning=None)
    x = random_input(layer, 1, 4)
    with pytest.raises(mhagen.InputError, match="pass context="):
        module(x)
    with pytest.raises(mhagen.InputError, match="kv_seq_len=7"):
        module(x, context=_context(layer, 1, 7))
    with pytest.raises(mhagen.InputError, match=r"\[batch, kv_seq, 16\]"):
        module(x, context=np.zeros((1, 6, 17), np.float32))
    with pytest.raises(mhagen.InputError, match="context= is for cross-attention"):
        mhagen.mha(32, 2).reference(x, mhagen.mha(32, 2).init_weights(0),
                                    context=_context(layer, 1, 6))


DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "mha.h"

/* argv: artifact, x file, context file, y file, case (ok | plain | short | nullctx) */
int main(int argc, char **argv) {
  if (argc != 6) return 2;
  mha_handle *h = mha_create(argv[1]);
  if (!h) return 3;
  float *x = malloc(MHA_INPUT_SIZE * sizeof(float)), *y = malloc(MHA_OUTPUT_SIZE * sizeof(float));
  float *c = malloc((MHA_CONTEXT_SIZE + 1) * sizeof(float));
  FILE *f = fopen(argv[2], "rb");
  if (!f || fread(x, sizeof(float), MHA_INPUT_SIZE, f) != MHA_INPUT_SIZE) return 4;
  fclose(f);
  f = fopen(argv[3], "rb");
  if (!f || fread(c + 1, sizeof(float), MHA_CONTEXT_SIZE, f) != MHA_CONTEXT_SIZE) return 4;
  fclose(f);
  int32_t lens[MHA_BATCH];
  for (int b = 0; b < MHA_BATCH; ++b) lens[b] = MHA_KV_SEQ_LEN - b;
  const char *k = argv[5];
  int rc = k[0] == 'p' ? mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y)
         : k[0] == 's' ? mha_run_cross(h, x, MHA_BATCH, MHA_SEQ_LEN, c + 1, MHA_KV_SEQ_LEN - 1,
                                       lens, y)
         : k[0] == 'n' ? mha_run_cross(h, x, MHA_BATCH, MHA_SEQ_LEN, NULL, MHA_KV_SEQ_LEN, lens, y)
                       : mha_run_cross(h, x, MHA_BATCH, MHA_SEQ_LEN, c + 1, MHA_KV_SEQ_LEN,
                                       lens, y);   /* c + 1: unaligned, staged */
  printf("%s|%s\n", mha_status_name(rc), mha_last_error());
  f = fopen(argv[4], "wb");
  fwrite(y, sizeof(float), rc == MHA_OK ? MHA_OUTPUT_SIZE : 0, f);
  fclose(f);
  mha_destroy(h);
  return 0;
}
"""


@pytest.mark.skipif(not (CC and shutil.which("g++")), reason="needs gcc and g++")
def test_c_api_runs_cross_attention(tmp_path):
    layer = mhagen.mha(48, 4, cross=True, kv_dim=20, kv_heads=2, key_padding=True)
    w = layer.init_weights(4)
    module = mhagen.build(layer, "x86", batch=2, seq_len=7, kv_seq_len=19, weights=w)
    d = module.save(tmp_path / "art")
    assert "#define MHA_CROSS 1" in (d / "mha.h").read_text()
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = build_c_app(CC, d, tmp_path / "driver", tmp_path / "driver.c")
    x, c = random_input(layer, 2, 7), _context(layer, 2, 19)
    x.tofile(tmp_path / "x")
    c.tofile(tmp_path / "c")

    def run(case):
        r = subprocess.run([str(exe), str(d), str(tmp_path / "x"), str(tmp_path / "c"),
                            str(tmp_path / "y"), case], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.strip().split("|")

    status, message = run("ok")
    assert status == "MHA_OK", message
    y = np.fromfile(tmp_path / "y", np.float32).reshape(2, 7, 48)
    lens = np.array([19, 18])
    np.testing.assert_array_equal(y, module(x, context=c, kv_lens=lens))
    assert_close(y, layer.reference(x, w, context=c, kv_lens=lens))
    for case, status, text in (("plain", "MHA_ERR_ARGUMENT", "runs with mha_run_cross"),
                               ("short", "MHA_ERR_SHAPE", "runs kv_seq_len 19"),
                               ("nullctx", "MHA_ERR_NULL_ARGUMENT", "context is NULL")):
        got, message = run(case)
        assert got == status and text in message, message


def test_cli_builds_a_cross_attention_layer(capsys):
    from mhagen.cli import main
    rc = main(["build", "--d-model", "64", "--heads", "2", "--cross", "--kv-dim", "40",
               "--seq-len", "9", "--kv-seq-len", "30", "--repeat", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "kv_projection" in out and "ok" in out, out
    assert main(["build", "--d-model", "64", "--heads", "2", "--cross"]) == 2
    assert "--kv-seq-len" in capsys.readouterr().err


def test_one_build_serves_every_query_and_context_length():
    """batch=None, seq_len=None, kv_seq_len=None: one module, any (batch, seq, kv_seq) up to
    the maxima; key padding over the context."""
    layer = mhagen.mha(160, 4, head_dim=40, kv_heads=2, cross=True, kv_dim=24,
                       key_padding=True, causal=True)
    w = layer.init_weights(5)
    module = mhagen.build(layer, "x86-avx2", batch=None, max_batch=3, seq_len=None,
                          max_seq_len=100, kv_seq_len=None, max_kv_seq_len=150, weights=w,
                          tuning=None)
    rng = np.random.default_rng(0)
    for batch, seq, kv_seq in ((1, 1, 1), (3, 97, 33), (2, 5, 150), (3, 100, 149)):
        x, c = random_input(layer, batch, seq, seed=seq), _context(layer, batch, kv_seq)
        lens = rng.integers(0, kv_seq + 1, batch)
        assert_close(module(x, context=c, kv_lens=lens),
                     layer.reference(x, w, context=c, kv_lens=lens))
    with pytest.raises(mhagen.InputError, match="kv_seq_len 1..150"):
        module(random_input(layer, 1, 4), context=_context(layer, 1, 151),
               kv_lens=[151])


SYMBOLIC_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "mha.h"

/* argv: artifact, batch, seq, kv_seq, x file, context file, y file */
int main(int argc, char **argv) {
  if (argc != 8) return 2;
  int b = atoi(argv[2]), s = atoi(argv[3]), t = atoi(argv[4]);
  mha_handle *h = mha_create(argv[1]);
  if (!h) return 3;
  size_t nx = (size_t)b * s * MHA_D_MODEL, nc = (size_t)b * t * MHA_KV_DIM;
  float *x = malloc(nx * sizeof(float)), *c = malloc(nc * sizeof(float));
  float *y = malloc((size_t)b * s * MHA_OUT_D_MODEL * sizeof(float));
  FILE *f = fopen(argv[5], "rb");
  if (!f || fread(x, sizeof(float), nx, f) != nx) return 4;
  fclose(f);
  f = fopen(argv[6], "rb");
  if (!f || fread(c, sizeof(float), nc, f) != nc) return 4;
  fclose(f);
  int rc = mha_run_cross(h, x, b, s, c, t, NULL, y);
  printf("%s|%s\n", mha_status_name(rc), mha_last_error());
  f = fopen(argv[7], "wb");
  fwrite(y, sizeof(float), rc == MHA_OK ? (size_t)b * s * MHA_OUT_D_MODEL : 0, f);
  fclose(f);
  mha_destroy(h);
  return 0;
}
"""


@pytest.mark.skipif(not (CC and shutil.which("g++")), reason="needs gcc and g++")
def test_c_api_runs_every_context_length(tmp_path):
    layer = mhagen.mha(48, 4, cross=True, kv_dim=20)
    w = layer.init_weights(6)
    module = mhagen.build(layer, "x86", batch=2, seq_len=None, max_seq_len=30,
                          kv_seq_len=None, max_kv_seq_len=40, weights=w)
    d = module.save(tmp_path / "art")
    assert "#define MHA_SYMBOLIC_KV_SEQ_LEN 1" in (d / "mha.h").read_text()
    (tmp_path / "driver.c").write_text(SYMBOLIC_DRIVER)
    exe = build_c_app(CC, d, tmp_path / "driver", tmp_path / "driver.c")
    for seq, kv_seq in ((1, 40), (30, 3), (17, 41)):
        x, c = random_input(layer, 2, seq, seed=seq), _context(layer, 2, kv_seq)
        x.tofile(tmp_path / "x")
        c.tofile(tmp_path / "c")
        r = subprocess.run([str(exe), str(d), "2", str(seq), str(kv_seq), str(tmp_path / "x"),
                            str(tmp_path / "c"), str(tmp_path / "y")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        status, message = r.stdout.strip().split("|")
        if kv_seq > 40:
            assert status == "MHA_ERR_SHAPE" and "kv_seq_len 1..40" in message, message
            continue
        assert status == "MHA_OK", message
        y = np.fromfile(tmp_path / "y", np.float32).reshape(2, seq, 48)
        np.testing.assert_array_equal(y, module(x, context=c))
        assert_close(y, layer.reference(x, w, context=c))
