"""Decoding calls where each cache row adds its own number of new tokens (a chunk of a
prompt, one token, k speculative ones, none), packed as FlashAttention's varlen form:
module(x [1, total, d], cache=cache, cu_seqlens=[0, n0, n0 + n1, ...])."""
import numpy as np
import pytest

import mhagen
from mhagen.tolerances import assert_close

from decode_modules import LAYER, MAX_LEN, W, packed_module, reference_cache
from conftest import random_cache


def filled_cache(module, lens, seed=0):
    """The module's cache with random rows and the given lengths."""
    cache = random_cache(module.new_cache(), np.random.default_rng(seed))
    cache.lens[...] = lens
    return cache


def one_row(b, rows=4):
    """cu_seqlens of a call where only row b adds one token."""
    return [0] * (b + 1) + [1] * (rows - b)


def test_mixed_counts_match_the_reference_and_step_by_step_decoding():
    """Row 0 adds a 9-token chunk of its prompt (more than max_seq_len 3: the call's 12
    tokens are what is bounded), row 1 one token, row 2 none, row 3 two speculative tokens
    up to max_len exactly: outputs, cache rows and lengths equal the float64 reference, and
    equal the same tokens fed one call per token (the other rows adding none)."""
    m = packed_module()
    cache = filled_cache(m, [0, 7, 30, MAX_LEN - 2])
    ref, steps = reference_cache(cache), cache.copy()
    cu = [0, 9, 10, 10, 12]
    x = np.random.default_rng(1).standard_normal((1, 12, 64)).astype(np.float32)
    y = m(x, cache=cache, cu_seqlens=cu)
    assert y.shape == (1, 12, 64)
    assert_close(y, LAYER.reference(x, W, cache=ref, cu_seqlens=cu))
    assert cache.lens.tolist() == ref.lens.tolist() == [9, 8, 30, MAX_LEN]
    assert_close(cache.k, ref.k)
    assert_close(cache.v, ref.v)
    rows = [b for b in range(4) for _ in range(cu[b], cu[b + 1])]
    one_by_one = [m(x[:, t:t + 1], cache=steps, cu_seqlens=one_row(b))
                  for t, b in enumerate(rows)]
    assert_close(np.concatenate(one_by_one, axis=1), y)
    assert steps.lens.tolist() == cache.lens.tolist()
    assert_close(steps.k, cache.k)


@pytest.mark.parametrize("cu,lens", [
    ([0, 0, 0, 0, 1], [0, 5, 9, 0]),            # one token, last row; the others none
    ([0, 12, 12, 12, 12], [1, 0, 0, 0]),        # one row's 12 tokens (key blocks 0 and 1)
    ([0, 3, 6, 9, 12], [15, 16, 17, 31]),       # uniform; key-block edges around 16
    ([0, 1, 2, 3, 4], [0, 0, 0, MAX_LEN - 1]),  # an empty cache; one row filled to the end
], ids=["one-token", "one-row", "block-edges", "empty-and-full"])
def test_awkward_counts_and_lengths_match_the_reference(cu, lens):
    m = packed_module()
    cache = filled_cache(m, lens, seed=len(cu) + cu[-1])
    ref = reference_cache(cache)
    x = np.random.default_rng(cu[1]).standard_normal((1, cu[-1], 64)).astype(np.float32)
    assert_close(m(x, cache=cache, cu_seqlens=cu), LAYER.reference(x, W, cache=ref,
                                                                     cu_seqlens=cu))
    assert cache.lens.tolist() == ref.lens.tolist()
    assert_close(cache.k, ref.k)


def test_uniform_call_of_a_packed_module_equals_its_packed_form():
    """x [rows, S, d] without cu_seqlens is every row adding S: the same numbers as the
    packed call, answered as [rows, S, d]."""
    m = packed_module()
    a, b = filled_cache(m, [3, 0, 20, 9]), filled_cache(m, [3, 0, 20, 9])
    x = np.random.default_rng(2).standard_normal((4, 3, 64)).astype(np.float32)
    y = m(x, cache=a)
    assert y.shape == (4, 3, 64)
    np.testing.assert_array_equal(y.reshape(1, 12, 64),
                                  m(x.reshape(1, 12, 64), cache=b, cu_seqlens=[0, 3, 6, 9, 12]))
    assert a.lens.tolist() == b.lens.tolist() == [6, 3, 23, 12]


@pytest.mark.parametrize("x_shape,cu,lens,message", [
    ((1, 12, 64), [0, 5, 3, 8, 12], [0] * 4, "never decrease"),
    ((1, 12, 64), [0, 6, 12], [0] * 4, "4 sequences need 5"),
    ((1, 12, 64), [0, 1, 2, 3, 11], [0] * 4, "end at 12"),
    ((1, 12, 64), [1, 2, 3, 4, 12], [0] * 4, "start at 0"),
    ((2, 6, 64), [0, 3, 6, 9, 12], [0] * 4, r"packed: \[1, total, 64\]"),
    ((1, 12, 64), [0, 3, 6, 9, 12], [MAX_LEN - 2, 0, 0, 0], "row 0 of the cache holds 46"),
    ((1, 13, 64), [0, 4, 7, 10, 13], [0] * 4, r"runs 1..12 a call"),
    ((4, 4, 64), None, [0] * 4, r"seq_len 1..3"),
    ((3, 2, 64), None, [0] * 4, "x has 3 rows; this call runs 4"),
], ids=["decreasing", "entries", "end", "start", "not-packed", "no-room", "too-many",
        "uniform-too-long", "rows"])
def test_bad_calls_are_refused_before_anything_is_written(x_shape, cu, lens, message):
    m = packed_module()
    cache = filled_cache(m, lens)
    before = cache.copy()
    x = np.zeros(x_shape, np.float32)
    with pytest.raises(mhagen.InputError, match=message):
        m(x, cache=cache, cu_seqlens=cu)
    np.testing.assert_array_equal(cache.lens, before.lens)
    np.testing.assert_array_equal(cache.k, before.k)
    np.testing.assert_array_equal(cache.v, before.v)



def test_context_offsets_are_refused_on_a_decoding_module():
    """cu_seqlens_k= (a packed cross-attention call's context) means nothing to a decoding
    module: refused with nothing written."""
    m = packed_module()
    cache = filled_cache(m, [1, 2, 3, 4])
    before = cache.copy()
    with pytest.raises(mhagen.InputError, match="cu_seqlens_k= is a packed cross-attention"):
        m(np.zeros((1, 4, 64), np.float32), cache=cache, cu_seqlens=[0, 1, 2, 3, 4],
          cu_seqlens_k=[0, 1, 2, 3, 4])
    np.testing.assert_array_equal(cache.lens, before.lens)
    np.testing.assert_array_equal(cache.k, before.k)

def test_prepared_packed_call_runs_the_same_counts_each_step():
    """prepare() binds x (written in place between runs) and the rows' counts once: rows 0,
    2 and 3 add a token each run, row 1 none; each run equals the reference call, and runs
    past a row's room are refused with nothing written."""
    m = packed_module()
    cache = filled_cache(m, [10, 4, 0, MAX_LEN - 3])
    ref = reference_cache(cache)
    cu = [0, 1, 1, 2, 3]
    x = mhagen.aligned_empty((1, 3, 64), "float32")
    run = m.prepare(x, cache=cache, cu_seqlens=cu)
    rng = np.random.default_rng(3)
    for _ in range(3):
        x[...] = rng.standard_normal(x.shape)
        assert_close(run(), LAYER.reference(x, W, cache=ref, cu_seqlens=cu))
    assert cache.lens.tolist() == ref.lens.tolist() == [13, 4, 3, MAX_LEN]
    with pytest.raises(mhagen.InputError, match="row 3 of the cache holds 48"):
        run()
    assert cache.lens.tolist() == [13, 4, 3, MAX_LEN]



def test_torch_x_of_a_packed_call_is_answered_with_a_tensor():
    """A torch x gets a torch answer through the packed path as through module(x): the
    same numbers as the numpy call; out= a tensor is written in place and returned (also
    [rows, S, d] of a uniform call, the kernels' packed rows a view of it); a prepared call
    of a tensor x returns a tensor over its output each run."""
    torch = pytest.importorskip("torch")
    m = packed_module()
    cu = [0, 2, 3, 3, 6]
    x = np.random.default_rng(7).standard_normal((1, 6, 64)).astype(np.float32)
    a, b = filled_cache(m, [5, 0, 9, 30]), filled_cache(m, [5, 0, 9, 30])
    expected = m(x, cache=a, cu_seqlens=cu)
    y = m(torch.from_numpy(x.copy()), cache=b, cu_seqlens=torch.tensor(cu))
    assert isinstance(y, torch.Tensor) and tuple(y.shape) == (1, 6, 64)
    np.testing.assert_array_equal(y.numpy(), expected)
    assert a.lens.tolist() == b.lens.tolist() == [7, 1, 9, 33]
    out = torch.zeros(4, 2, 64)
    xu = np.random.default_rng(8).standard_normal((4, 2, 64)).astype(np.float32)
    assert m(torch.from_numpy(xu), cache=a, out=out) is out
    np.testing.assert_array_equal(out.numpy(), m(xu, cache=b))
    xt = torch.from_numpy(mhagen.aligned_empty((1, 6, 64), "float32"))
    run = m.prepare(xt, cache=a, cu_seqlens=cu)
    for seed in (9, 10):
        xt.copy_(torch.from_numpy(
            np.random.default_rng(seed).standard_normal((1, 6, 64)).astype(np.float32)))
        y = run()
        assert isinstance(y, torch.Tensor)
        np.testing.assert_array_equal(y.numpy(), m(xt.numpy(), cache=b, cu_seqlens=cu))
    assert a.lens.tolist() == b.lens.tolist() == [13, 5, 11, 41]

def test_reference_of_packed_rows_is_each_row_alone():
    """The float64 reference of a packed call equals each row's own batch-1 call (what a
    left-padded batch's real tokens, packed, compute: no padding tokens exist)."""
    rng = np.random.default_rng(4)
    cache = mhagen.KVCache.empty(LAYER, 3, np.float64)
    cache.k[...], cache.v[...] = rng.standard_normal((2,) + cache.k.shape)
    cache.lens[...] = [4, 0, 11]
    alone = [mhagen.KVCache.from_arrays(cache.k[b:b + 1], cache.v[b:b + 1], cache.lens[b:b + 1])
             for b in range(3)]
    cu = [0, 2, 7, 7]
    x = rng.standard_normal((1, 7, 64))
    packed = LAYER.reference(x, W, cache=cache, cu_seqlens=cu)
    rows = [LAYER.reference(x[:, cu[b]:cu[b + 1]], W, cache=alone[b]) for b in (0, 1)]
    np.testing.assert_allclose(packed, np.concatenate(rows, axis=1), rtol=1e-13, atol=1e-13)
    assert cache.lens.tolist() == [6, 5, 11]
    np.testing.assert_array_equal(cache.k[0], alone[0].k[0])


@pytest.mark.slow
def test_c_api_runs_packed_rows_as_python_does(tmp_path):
    """mha_run_cached_varlen of the saved module: the same call as Python's gives the same
    bits (output, caches, lengths); offsets that decrease are refused with nothing written
    or advanced; mha_run_paged of this contiguous artifact says which entry it needs."""
    from decode_modules import c_driver, run_c_call
    m = packed_module()
    artifact, exe = c_driver(m, tmp_path)
    header = (artifact / "mha.h").read_text()
    assert "#define MHA_VARLEN 1" in header and "#define MHA_KV_BLOCK_SIZE 0" in header
    cache = filled_cache(m, [3, 0, 40, 20])
    cu = np.array([0, 7, 8, 8, 11], np.int32)
    x = np.random.default_rng(9).standard_normal((1, 11, 64)).astype(np.float32)
    arrays = dict(x=x, cu=cu, lens=cache.lens, k=cache.k, v=cache.v)
    status, message, out = run_c_call(artifact, exe, tmp_path / "ok", arrays, (4, 11, 0))
    assert status == "MHA_OK", message
    expected = m(x, cache=cache, cu_seqlens=cu)
    np.testing.assert_array_equal(np.frombuffer(out["y"], np.float32), expected.reshape(-1))
    np.testing.assert_array_equal(np.frombuffer(out["k.out"], np.float32), cache.k.reshape(-1))
    np.testing.assert_array_equal(np.frombuffer(out["v.out"], np.float32), cache.v.reshape(-1))
    assert np.frombuffer(out["lens.out"], np.int32).tolist() == cache.lens.tolist()
    bad = dict(arrays, cu=np.array([0, 7, 6, 8, 11], np.int32))
    status, message, out = run_c_call(artifact, exe, tmp_path / "bad", bad, (4, 11, 0))
    assert status == "MHA_ERR_ARGUMENT" and "never decrease" in message, message
    assert out["k.out"] == cache.k.tobytes() and out["lens.out"] == cache.lens.tobytes()
    status, message, _ = run_c_call(artifact, exe, tmp_path / "other", arrays, (4, 11, 0),
                                    mode="other")
    assert status == "MHA_ERR_ARGUMENT" and "mha_run_cached" in message, message
