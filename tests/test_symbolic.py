"""Symbolic lengths: one build (seq_len=None, max_seq_len=N; batch=None, max_batch=B) serves
every shape up to its maximum, in Python and through the C API, against the reference."""
import shutil
import subprocess

import numpy as np
import pytest

import mhagen
from mhagen import ir
from mhagen.tolerances import assert_close
from tests.conftest import build_c_app, random_input

LENGTHS = (1, 17, 97, 512)
CC = shutil.which("gcc") or shutil.which("cc")


def _build(layer, target="x86", **kw):
    w = layer.init_weights(seed=1)
    options = dict(batch=None, max_batch=2, seq_len=None, max_seq_len=512, tuning=None)
    options.update(kw)
    return mhagen.build(layer, target, weights=w, **options), w


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
def test_one_build_serves_every_length(target):
    """Causal grouped K/V heads, head_dim 40, RoPE and ALiBi: lengths 1, 17, 97, 512 and
    batch 1 and 2 from one build."""
    layer = mhagen.mha(160, 4, head_dim=40, kv_heads=2, causal=True, rotary=True,
                       score_mod=mhagen.alibi(4))
    module, w = _build(layer, target)
    assert module.symbolic["seq"] and module.symbolic["batch"]
    for i, seq in enumerate(LENGTHS):
        batch = 1 + i % 2
        x = random_input(layer, batch, seq, seed=seq)
        y = module(x)
        assert y.shape == (batch, seq, 160)
        assert_close(y, layer.reference(x, w))


@pytest.mark.parametrize("mask", [
    None,
    mhagen.sliding_window(24),
    # reads q_len: left to the kernel (no block is FULL), valid at every length
    ir.kv_idx >= ir.q_len - 20,
], ids=["none", "window", "reads-q_len"])
def test_masks_at_every_length(mask):
    layer = mhagen.mha(64, 2, mask=mask)
    module, w = _build(layer, max_seq_len=130)
    for seq in (1, 5, 64, 97, 130):
        x = random_input(layer, 2, seq, seed=seq)
        assert_close(module(x), layer.reference(x, w))


def test_key_padding_with_symbolic_lengths():
    layer = mhagen.mha(64, 4, key_padding=True, causal=True)
    module, w = _build(layer, max_batch=3, max_seq_len=100)
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 1), (3, 97), (2, 100)):
        x = random_input(layer, batch, seq, seed=seq)
        lens = rng.integers(0, seq + 1, batch).astype(np.int32)
        assert_close(module(x, kv_lens=lens), layer.reference(x, w, kv_lens=lens))


def test_fixed_batch_symbolic_seq_and_out():
    layer = mhagen.mha(40, 4)      # output columns padded in the kernels: y copied out
    module, w = _build(layer, batch=2, max_batch=None, max_seq_len=33)
    x = random_input(layer, 2, 9, seed=2)
    out = np.empty((2, 9, 40), np.float32)
    assert module(x, out=out) is out
    assert_close(out, layer.reference(x, w))
    with pytest.raises(mhagen.InputError, match="built for batch=2"):
        module(random_input(layer, 1, 9))
    with pytest.raises(mhagen.InputError, match="seq_len 1..33"):
        module(random_input(layer, 2, 34))
    with pytest.raises(mhagen.InputError, match=r"shape \(2, 9, 40\)"):
        module(x, out=np.empty((2, 33, 40), np.float32))


def test_save_load_keeps_every_length(tmp_path):
    layer = mhagen.mha(64, 4, causal=True)
    module, w = _build(layer, max_seq_len=64)
    loaded = mhagen.load(module.save(tmp_path / "sym"))
    assert loaded.symbolic == module.symbolic
    for seq in (3, 64):
        x = random_input(layer, 2, seq, seed=seq)
        np.testing.assert_array_equal(loaded(x), module(x))


def test_attention_maps_follow_the_call():
    layer = mhagen.mha(32, 2, causal=True)
    module, w = _build(layer, max_seq_len=40)
    p = module.attention_maps(random_input(layer, 1, 7))
    assert p.shape == (1, 2, 7, 7)
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-5)
    assert module.attention_maps(random_input(layer, 2, 11)).shape == (2, 2, 11, 11)


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
def test_decoding_prompt_and_steps_from_one_module(target):
    """A decoding layer built with seq_len=None: a prompt of any length in one call, then
    single tokens, from one module and one cache; equals the causal layer on everything."""
    kw = dict(kv_heads=2, causal=True, rotary=True, score_mod=mhagen.alibi(4))
    layer = mhagen.mha(96, 4, kv_cache=64, **kw)
    w = layer.init_weights(seed=2)
    module = mhagen.build(layer, target, batch=2, seq_len=None, max_seq_len=40, weights=w,
                          tuning=None)
    x = random_input(layer, 2, 45, seed=9)
    cache = module.new_cache()
    ys = [module(x[:, :37], cache=cache)]
    ys += [module(x[:, t:t + 1], cache=cache) for t in range(37, 42)]
    ys.append(module(x[:, 42:], cache=cache))
    assert list(cache.lens) == [45, 45]
    assert_close(np.concatenate(ys, axis=1), mhagen.mha(96, 4, **kw).reference(x, w))
    with pytest.raises(mhagen.InputError, match="seq_len 1..40"):
        module(random_input(layer, 2, 41), cache=module.new_cache())


@pytest.mark.parametrize("kwargs,options,error,message", [
    ({}, dict(max_seq_len=None), mhagen.GraphError, "give max_seq_len=N"),
    ({}, dict(seq_len=8, max_seq_len=16), mhagen.GraphError, "drop one"),
    ({}, dict(max_seq_len=0), ValueError, "max_seq_len"),
    ({}, dict(fuse=False), mhagen.GraphError, "need the fused kernels"),
    (dict(kv_cache=32), dict(batch=None, max_batch=2), mhagen.GraphError, "fixed batch"),
])
def test_bad_symbolic_builds_are_refused(kwargs, options, error, message):
    layer = mhagen.mha(32, 2, **kwargs)
    opts = dict(seq_len=None, max_seq_len=16, tuning=None)
    opts.update(options)
    with pytest.raises(error, match=message):
        mhagen.build(layer, "x86", **opts)


def test_cuda_refuses_symbolic_lengths():
    with pytest.raises(mhagen.TargetError, match="symbolic lengths"):
        mhagen.build(mhagen.mha(64, 2), "cuda-sm90", seq_len=None, max_seq_len=64,
                     tuning=None)


DRIVER = r"""
/* mha_run at the batch and seq_len given on the command line; prints the status and message,
   writes y. */
#include <stdio.h>
#include <stdlib.h>
#include "mha.h"

int main(int argc, char **argv) {
  if (argc != 6) return 2;
  int batch = atoi(argv[2]), seq = atoi(argv[3]);
  mha_handle *h = mha_create(argv[1]);
  if (!h) return 3;
  size_t n_in = (size_t)batch * seq * MHA_D_MODEL, n_out = (size_t)batch * seq * MHA_OUT_D_MODEL;
  float *x = malloc((n_in + 1) * sizeof(float)), *y = malloc((n_out + 1) * sizeof(float));
  FILE *f = fopen(argv[4], "rb");
  if (!f || fread(x + 1, sizeof(float), n_in, f) != n_in) return 4;   /* unaligned: staged */
  fclose(f);
  int rc = mha_run(h, x + 1, batch, seq, y + 1);
  printf("%s|%s\n", mha_status_name(rc), mha_last_error());
  f = fopen(argv[5], "wb");
  fwrite(y + 1, sizeof(float), rc == MHA_OK ? n_out : 0, f);
  fclose(f);
  mha_destroy(h);
  return 0;
}
"""


@pytest.mark.skipif(not (CC and shutil.which("g++")), reason="needs gcc and g++")
def test_c_api_runs_every_length(tmp_path):
    layer = mhagen.mha(48, 4, kv_heads=2, causal=True)
    module, w = _build(layer, max_batch=3, max_seq_len=97)
    d = module.save(tmp_path / "sym")
    header = (d / "mha.h").read_text()
    assert "#define MHA_SYMBOLIC_SEQ_LEN 1" in header and "#define MHA_SEQ_LEN 97" in header
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = build_c_app(CC, d, tmp_path / "driver", tmp_path / "driver.c")

    def run(batch, seq):
        x = random_input(layer, batch, seq, seed=batch * seq)
        x.tofile(tmp_path / "x")
        r = subprocess.run([str(exe), str(d), str(batch), str(seq), str(tmp_path / "x"),
                            str(tmp_path / "y")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        status, message = r.stdout.strip().split("|")
        return status, message, x, np.fromfile(tmp_path / "y", np.float32)

    for batch, seq in ((1, 1), (3, 17), (2, 97), (1, 40)):
        status, message, x, y = run(batch, seq)
        assert status == "MHA_OK", message
        y = y.reshape(batch, seq, 48)
        np.testing.assert_array_equal(y, module(x))
        assert_close(y, layer.reference(x, w))
    status, message, _, _ = run(2, 98)
    assert status == "MHA_ERR_SHAPE" and "seq_len 1..97" in message, message


def test_cli_builds_for_every_length(capsys, tmp_path):
    from mhagen.cli import main
    rc = main(["build", "--d-model", "64", "--heads", "2", "--causal", "--max-seq-len", "80",
               "--seq-len", "33", "--batch", "2", "--out", str(tmp_path / "art"),
               "--repeat", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "input (batch 2, any seq_len 1..80, 64)" in out and "ok" in out
    assert "at input (2, 33, 64)" in out
    assert mhagen.load(tmp_path / "art").symbolic["seq"]
    assert main(["build", "--d-model", "64", "--heads", "2", "--max-seq-len", "16"]) == 2
    assert "--seq-len 128 is outside 1..--max-seq-len 16" in capsys.readouterr().err
