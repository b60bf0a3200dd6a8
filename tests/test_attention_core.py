"""The attention core alone (mhagen.attention_core): q, k, v as Hugging Face's attention
interface and torch's scaled_dot_product_attention hand them over. Its float64 reference
against torch SDPA (an independent implementation), its compiled module against the
reference (any batch, q_len and kv_len; strided torch views read in place; key padding;
half precision), and its refusals."""
import numpy as np
import pytest

import mhagen
from mhagen import GraphError, InputError, TargetError
from mhagen.tolerances import assert_close

torch = pytest.importorskip(
    "torch", reason="torch is not installed: `pip install -e .[test]` (CI installs it, so these "
                    "tests never skip there)")
F = torch.nn.functional


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's ops on one thread here: its pool and TVM's spinning for the same two cores
    made every op of these tiny models ~10x slower (a test run 74 s instead of ~25 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def qkv(rng, batch, heads, kv_heads, q_len, kv_len, d, dtype=np.float32):
    return (rng.standard_normal((batch, heads, q_len, d)).astype(dtype),
            rng.standard_normal((batch, kv_heads, kv_len, d)).astype(dtype),
            rng.standard_normal((batch, kv_heads, kv_len, d)).astype(dtype))


def sdpa(q, k, v, mask=None, scale=None):
    """torch SDPA in float64, as [batch, q_len, heads, d] (grouped K/V repeated)."""
    q, k, v = (torch.from_numpy(np.asarray(a, np.float64)) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    m = None if mask is None else torch.from_numpy(np.array(mask))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale).transpose(1, 2
                                                                                    ).numpy()


def bottom_right(q_len, kv_len):
    """[q_len, kv_len]: query t (at kv_len - q_len + t) sees keys up to its position."""
    return np.arange(kv_len)[None, :] <= kv_len - q_len + np.arange(q_len)[:, None]


# -- the reference against torch SDPA -------------------------------------------------------

def test_reference_is_sdpa_with_grouped_heads_bottom_right_causal_and_a_window(rng):
    q, k, v = qkv(rng, 2, 6, 2, 5, 12, 8)
    plain = mhagen.attention_core(6, 8, kv_heads=2)
    np.testing.assert_allclose(plain.reference(q, k, v), sdpa(q, k, v), atol=1e-12)
    causal = mhagen.attention_core(6, 8, kv_heads=2, causal=True)
    np.testing.assert_allclose(causal.reference(q, k, v),
                               sdpa(q, k, v, np.broadcast_to(bottom_right(5, 12), (2, 5, 12))),
                               atol=1e-12)
    windowed = mhagen.attention_core(6, 8, kv_heads=2, causal=True, window=3, scale=0.3)
    pos = np.arange(7, 12)[:, None]
    keep = bottom_right(5, 12) & (pos - np.arange(12)[None, :] < 3)
    np.testing.assert_allclose(windowed.reference(q, k, v),
                               sdpa(q, k, v, np.broadcast_to(keep, (2, 5, 12)), scale=0.3),
                               atol=1e-12)


def test_reference_key_padding_is_a_padding_mask_and_empty_rows_give_zeros(rng):
    q, k, v = qkv(rng, 3, 4, 4, 6, 6, 8)
    core = mhagen.attention_core(4, 8, causal=True, key_padding=True)
    starts, ends = np.array([0, 2, 0]), np.array([6, 6, 3])
    keep = bottom_right(6, 6)[None] & (np.arange(6) >= starts[:, None, None]) \
        & (np.arange(6) < ends[:, None, None])
    got = core.reference(q, k, v, kv_lens=ends, kv_starts=starts)
    np.testing.assert_allclose(got, sdpa(q, k, v, keep), atol=1e-12)
    assert not got[1, :2].any()           # left-padded queries see no key: zeros (as SDPA)
    assert got[1, 2:].any()


def test_reference_softcap_is_applied_to_the_scaled_score(rng):
    q, k, v = qkv(rng, 1, 2, 1, 4, 4, 8)
    core = mhagen.attention_core(2, 8, kv_heads=1, score_mod=mhagen.softcap(0.5), scale=2.0)
    s = np.einsum("bhqd,bkd->bhqk", q.astype(np.float64), k[:, 0].astype(np.float64)) * 2.0
    p = np.exp(0.5 * np.tanh(s / 0.5))
    want = np.einsum("bhqk,bkd->bqhd", p / p.sum(-1, keepdims=True), v[:, 0])
    np.testing.assert_allclose(core.reference(q, k, v), want, atol=1e-12)


# -- compiled, against the reference ----------------------------------------------------------

@pytest.fixture(scope="module")
def padded_core():
    """Grouped K/V, causal with a window and a softcap, key padding: all three kernels."""
    core = mhagen.attention_core(4, 32, kv_heads=2, causal=True, window=6,
                                 score_mod=mhagen.softcap(3.0), key_padding=True)
    return core, mhagen.build(core, "x86", max_seq_len=128)


@pytest.mark.parametrize("batch, q_len, kv_len, kernel", [
    (2, 1, 9, "core_step"), (1, 1, 1, "core_step"), (1, 7, 7, "core_prefill"),
    (3, 5, 13, "core"), (2, 17, 40, "core"), (2, 97, 97, "core_prefill"),
    (1, 128, 128, "core_prefill")])
def test_compiled_any_length_with_key_padding(padded_core, rng, batch, q_len, kv_len, kernel):
    core, module = padded_core
    assert module.kernel_for(batch, q_len, kv_len) == kernel
    q, k, v = qkv(rng, batch, 4, 2, q_len, kv_len, 32)
    assert_close(module(q, k, v), core.reference(q, k, v))
    ends = rng.integers(0, kv_len + 1, batch)
    starts = np.minimum(rng.integers(0, 9, batch), ends)
    got = module(q, k, v, kv_lens=ends, kv_starts=starts)
    assert_close(got, core.reference(q, k, v, kv_lens=ends, kv_starts=starts))


def test_compiled_reads_strided_torch_views_in_place(padded_core, rng):
    """Hugging Face's q, k, v are [batch, len, heads, d] projections transposed: read where
    they lie (a torch answer), equal to reading contiguous copies; out= is written in
    place."""
    core, module = padded_core
    base = [torch.from_numpy(a) for a in (rng.standard_normal((2, 9, 4, 32)),
                                          rng.standard_normal((2, 14, 2, 32)),
                                          rng.standard_normal((2, 14, 2, 32)))]
    q, k, v = (t.float().transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    got = module(q, k, v, kv_starts=[0, 3])
    assert isinstance(got, torch.Tensor) and got.shape == (2, 9, 4, 32)
    assert_close(got.numpy(), core.reference(q.contiguous(), k.contiguous(), v.contiguous(),
                                             kv_starts=[0, 3]))
    out = torch.empty(2, 9, 4, 32)
    assert module(q, k, v, kv_starts=[0, 3], out=out) is out
    assert torch.equal(out, got)
    # a prompt (the prefill template) over views too
    k, v = k[:, :, :9], v[:, :, :9]
    assert module.kernel_for(2, 9, 9) == "core_prefill" and not k.is_contiguous()
    assert_close(module(q, k, v, kv_starts=[0, 3]).numpy(),
                 core.reference(q.contiguous(), k.contiguous(), v.contiguous(),
                                kv_starts=[0, 3]))
    # numpy views with strides too, answered in numpy
    got_np = module(q.numpy(), k.numpy(), v.numpy(), kv_starts=[0, 3])
    assert isinstance(got_np, np.ndarray)
    assert np.array_equal(got_np, module(q, k, v, kv_starts=[0, 3]).numpy())


def test_compiled_empty_calls(padded_core, rng):
    core, module = padded_core
    q, k, v = qkv(rng, 2, 4, 2, 0, 5, 32)
    assert module(q, k, v).shape == (2, 0, 4, 32)
    q, k, v = qkv(rng, 0, 4, 2, 3, 5, 32)
    assert module(q, k, v).shape == (0, 3, 4, 32)


@pytest.fixture(scope="module")
def cross_core():
    """No position in the mask: q_len may exceed kv_len (cross-attention); a custom mask on
    kv_idx; a scale of its own; no key padding; head_dim 40 (not whole P V vectors: no
    prefill kernel, prompts run the decode template)."""
    core = mhagen.attention_core(2, 40, mask=mhagen.kv_idx >= 1, scale=0.7)
    return core, mhagen.build(core, "x86", lazy=True)


def test_compiled_cross_attention_lengths_and_custom_mask(cross_core, rng):
    core, module = cross_core
    assert "core_prefill" not in module.kernels
    for batch, q_len, kv_len in ((2, 9, 4), (1, 1, 6), (3, 4, 4)):
        q, k, v = qkv(rng, batch, 2, 2, q_len, kv_len, 40)
        want = core.reference(q, k, v)
        keep = np.broadcast_to(np.arange(kv_len) >= 1, (batch, q_len, kv_len))
        np.testing.assert_allclose(want, sdpa(q, k, v, np.ascontiguousarray(keep), scale=0.7),
                                   atol=1e-12)
        assert_close(module(q, k, v), want)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16",
                                                             marks=pytest.mark.slow)])
def test_compiled_half_precision(rng, dtype):
    core = mhagen.attention_core(4, 16, kv_heads=1, causal=True, dtype=dtype)
    module = mhagen.build(core, "x86", lazy=True)
    tdtype = getattr(torch, dtype)
    for q_len, kv_len in ((1, 20), (6, 6)):
        q, k, v = (torch.from_numpy(a).to(tdtype) for a in qkv(rng, 2, 4, 1, q_len, kv_len, 16))
        got = module(q, k, v)
        assert got.dtype == tdtype
        assert_close(got.float().numpy(), core.reference(q, k, v), dtype)
    assert sorted(module.texts) == ["core_prefill", "core_step"]   # compiled when called
    # prompts past the prefill kernel's block table (max_seq_len, default 4096) run `core`
    assert [module.kernel_for(1, n, n) for n in (4096, 4097)] == ["core_prefill", "core"]


# -- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_heads=4), "does not divide"),
    (dict(window=4), "causal=True"),
    (dict(causal=True, window=0), "positive integer"),
    (dict(scale=0.0), "finite positive"),
    (dict(scale=float("nan")), "finite positive"),
    (dict(mask=mhagen.score > 0), "boolean expression of integers"),
    (dict(score_mod=mhagen.kv_idx < 3), "numeric expression"),
    (dict(dtype="float64"), "not supported"),
    (dict(causal=1), "True or False"),
])
def test_bad_options_are_refused(kwargs, words):
    with pytest.raises(GraphError, match=words):
        mhagen.attention_core(6, 8, **kwargs)


def test_bad_builds_are_refused():
    core = mhagen.attention_core(2, 8)
    with pytest.raises(TargetError, match="CPU targets only"):
        mhagen.build(core, "cuda-sm80")
    with pytest.raises(GraphError, match="no weights"):
        mhagen.build(core, "x86", weights={"w_q": np.zeros(1)})
    with pytest.raises(GraphError, match="max_seq_len"):
        mhagen.build(core, "x86", max_len=4)


def test_bad_calls_are_refused(padded_core, cross_core, rng):
    core, module = padded_core
    q, k, v = qkv(rng, 2, 4, 2, 3, 5, 32)
    with pytest.raises(InputError, match=r"q has shape \(2, 3, 3, 32\)"):
        module(q[:, :3], k, v)
    with pytest.raises(InputError, match="k .* and v .* differ"):
        module(q, k, v[:, :, :4])
    with pytest.raises(InputError, match="q_len 3 > kv_len 2"):
        module(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(InputError, match="seq_len 129 is beyond this module's max_seq_len=128"):
        module(*qkv(rng, 1, 4, 2, 129, 129, 32))
    with pytest.raises(InputError, match=r"kv_lens must lie in 0..5"):
        module(q, k, v, kv_lens=[6, 5])
    with pytest.raises(InputError, match=r"kv_starts must be integers of shape \(2,\)"):
        module(q, k, v, kv_starts=[0])
    with pytest.raises(InputError, match="out= must be"):
        module(q, k, v, out=np.empty((2, 3, 4, 32), np.float64))
    with pytest.raises(InputError, match="inference-only"):
        module(torch.from_numpy(q).requires_grad_(), torch.from_numpy(k), torch.from_numpy(v))
    with pytest.raises(InputError, match="pass q, k and v alike"):
        module(torch.from_numpy(q), k, v)
    _, cross = cross_core
    q, k, v = qkv(rng, 1, 2, 2, 3, 5, 40)
    with pytest.raises(InputError, match="takes no key lengths"):
        cross(q, k, v, kv_lens=[5])
