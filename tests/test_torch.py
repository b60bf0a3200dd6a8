"""mhagen's reference against torch.nn.MultiheadAttention, via mhagen.weights_from_torch.

NOTE: torch is a *test dependency* (pyproject: [project.optional-dependencies] test, installed
by CI with `pip install -e .[test]`). The importorskip below only exists so that a bare local
checkout without torch can still run the rest of the suite; in CI this file always runs.
"""
import numpy as np
import pytest

import mhagen
from mhagen import InputError
from mhagen.tolerances import assert_close, max_error

torch = pytest.importorskip(
    "torch", reason="torch is not installed: `pip install -e .[test]` (CI installs it, so these "
                    "tests never skip there)")

ATOL = 1e-5   # float32 torch vs the float64 reference


def make_module(embed_dim, num_heads, bias=True, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True).eval()
    if bias:   # torch initialises biases to zero; make them count
        with torch.no_grad():
            m.in_proj_bias.uniform_(-0.5, 0.5)
            m.out_proj.bias.uniform_(-0.5, 0.5)
    return m


def torch_forward(m, x, causal=False):
    seq = x.shape[1]
    attn_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1) if causal else None
    xt = torch.from_numpy(x)
    with torch.no_grad():
        out, weights = m(xt, xt, xt, need_weights=False, attn_mask=attn_mask)
    assert weights is None
    return out.numpy()


CASES = {
    # id: (embed_dim, num_heads, batch, seq, causal, bias)
    "plain-d64-h4": (64, 4, 2, 10, False, True),
    "causal-d64-h4": (64, 4, 2, 10, True, True),
    "no-bias-d64-h4": (64, 4, 2, 10, False, False),
    "seq97-d320-h8-head_dim40": (320, 8, 2, 97, False, True),
}


@pytest.mark.parametrize("embed_dim, num_heads, batch, seq, causal, bias", CASES.values(),
                         ids=CASES.keys())
def test_reference_matches_torch(embed_dim, num_heads, batch, seq, causal, bias):
    m = make_module(embed_dim, num_heads, bias=bias)
    x = np.random.default_rng(1).standard_normal((batch, seq, embed_dim)).astype(np.float32)
    expected = torch_forward(m, x, causal=causal)

    w = mhagen.weights_from_torch(m)
    layer = mhagen.mha(d_model=embed_dim, num_heads=num_heads, causal=causal, bias=bias)
    assert layer.options["head_dim"] == embed_dim // num_heads
    assert {k: v.shape for k, v in w.items()} == {s.name: s.shape for s in layer.weight_specs()}
    assert all(v.dtype == np.float32 for v in w.values())
    got = layer.reference(x, w)

    assert_close(got, expected)
    assert max_error(got, expected) <= ATOL


def test_causal_mask_matters():
    """Guards the causal case: without the mask torch's result really is different."""
    m = make_module(64, 4)
    x = np.random.default_rng(2).standard_normal((1, 10, 64)).astype(np.float32)
    w = mhagen.weights_from_torch(m)
    causal = mhagen.mha(64, 4, causal=True).reference(x, w)
    assert max_error(causal, torch_forward(m, x, causal=False)) > 1e-2
    assert max_error(causal, torch_forward(m, x, causal=True)) <= ATOL


def test_weights_from_torch_layout():
    """w_q[h] is rows h*d:(h+1)*d of torch's query projection, transposed."""
    m = make_module(16, 2)
    w = mhagen.weights_from_torch(m)
    in_w = m.in_proj_weight.detach().numpy()
    in_b = m.in_proj_bias.detach().numpy()
    np.testing.assert_array_equal(w["w_q"][1], in_w[8:16].T)
    np.testing.assert_array_equal(w["w_k"][0], in_w[16:24].T)
    np.testing.assert_array_equal(w["w_v"][1], in_w[40:48].T)
    np.testing.assert_array_equal(w["b_v"][1], in_b[40:48])
    np.testing.assert_array_equal(w["w_o"], m.out_proj.weight.detach().numpy().T)
    np.testing.assert_array_equal(w["b_o"], m.out_proj.bias.detach().numpy())


def _partial_bias():
    m = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    m.out_proj.bias = None
    return m


@pytest.mark.parametrize("make, fragments", [
    (lambda: torch.nn.Linear(16, 16), ["takes a torch.nn.MultiheadAttention", "Linear"]),
    (lambda: torch.nn.MultiheadAttention(16, 2, add_bias_kv=True, batch_first=True),
     ["add_bias_kv", "not supported", "without them"]),
    (lambda: torch.nn.MultiheadAttention(16, 2, add_zero_attn=True, batch_first=True),
     ["add_zero_attn", "not supported"]),
    (lambda: torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True),
     ["kdim=8 and vdim=12 differ", "one context", "kdim == vdim"]),
    (_partial_bias, ["bias on only some projections", "bias="]),
], ids=["not-mha", "add_bias_kv", "add_zero_attn", "kdim-differs", "partial-bias"])
def test_weights_from_torch_errors(make, fragments):
    with pytest.raises(InputError) as info:
        mhagen.weights_from_torch(make())
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
