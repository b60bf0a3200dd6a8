"""Module.attention_maps: every head's probabilities from the compiled layer."""
import numpy as np
import pytest

import mhagen
from mhagen.artifact.load import read_artifact
from mhagen.module import Module
from mhagen.reference import run_reference
from mhagen.tolerances import assert_close

from conftest import random_input


@pytest.mark.parametrize("target", ["x86", "x86-avx2"])
def test_maps_match_the_reference_probabilities(target):
    layer = mhagen.mha(80, 2, head_dim=40, kv_heads=1, causal=True, rotary=True,
                       score_mod=mhagen.alibi(2), key_padding=True)
    w = layer.init_weights(1)
    m = mhagen.build(layer, target, batch=3, seq_len=17, weights=w)
    x, lens = random_input(layer, 3, 17, seed=2), np.array([17, 4, 0])
    p = m.attention_maps(x, kv_lens=lens)
    vals = run_reference(layer, x, w, return_all=True, kv_lens=lens)
    assert p.shape == (3, 2, 17, 17) and p.dtype == np.float32
    assert_close(p, np.stack([vals["p0"], vals["p1"]], axis=1))
    assert not p[1, :, :, 4:].any() and not p[2].any()    # padded keys; a row with no key
    np.testing.assert_allclose(p[0].sum(-1), 1.0, rtol=1e-5)
    assert_close(m(x, kv_lens=lens), layer.reference(x, w, kv_lens=lens))   # y unchanged
    other = layer.init_weights(7)          # maps follow weights bound after the first use
    m.bind(other)
    vals = run_reference(layer, x, other, return_all=True, kv_lens=lens)
    assert_close(m.attention_maps(x, kv_lens=lens), np.stack([vals["p0"], vals["p1"]], axis=1))


def test_maps_refusals():
    dec = mhagen.mha(32, 2, kv_cache=8)
    m = mhagen.build(dec, "x86", batch=1, seq_len=1, weights=dec.init_weights(0))
    with pytest.raises(mhagen.GraphError, match="decoding layers"):
        m.attention_maps(np.zeros((1, 1, 32), np.float32))
    plain = mhagen.mha(32, 2)
    unbound = mhagen.build(plain, "x86", batch=1, seq_len=4)
    with pytest.raises(mhagen.InputError, match="bind them"):
        unbound.attention_maps(np.zeros((1, 4, 32), np.float32))


def test_loaded_modules_give_maps_too(tmp_path):
    """A loaded artifact compiles its maps program with the compiler mhagen.load hands it;
    a Module made without one says what to do."""
    layer = mhagen.mha(32, 2, causal=True)
    w = layer.init_weights(0)
    path = mhagen.build(layer, "x86", batch=1, seq_len=6, weights=w).save(tmp_path / "m")
    loaded = mhagen.load(path)
    x = random_input(layer, 1, 6)
    vals = run_reference(layer, x, w, return_all=True)
    assert_close(loaded.attention_maps(x)[0], np.stack([vals["p0"][0], vals["p1"][0]]))
    without = Module.from_artifact(read_artifact(path))   # no compile_maps given
    with pytest.raises(mhagen.InputError, match="need the compiler"):
        without.attention_maps(x)
