"""The float64 numpy reference against an independent, straightforward einsum implementation,
plus its input checks and init_weights."""
import numpy as np
import pytest

import mhagen
from mhagen import InputError
from mhagen.ir import expr as ex
from mhagen.reference import run_reference


def naive_mha(x, w, num_heads, kv_heads, allowed=None):
    """Multi-head attention written out with einsum on whole tensors, float64.

    w: mhagen per-head weights (w_q [H,D,d], w_k/w_v [G,D,d], w_o [H*d,D], optional biases).
    allowed: boolean [B, H, S, T] (True = visible) or None.
    """
    x = np.asarray(x, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    b_, s_, _ = x.shape
    d = w["w_q"].shape[-1]
    q = np.einsum("bsD,hDd->bhsd", x, w["w_q"])
    k = np.einsum("bsD,gDd->bgsd", x, w["w_k"])
    v = np.einsum("bsD,gDd->bgsd", x, w["w_v"])
    if "b_q" in w:
        q = q + w["b_q"][None, :, None, :]
        k = k + w["b_k"][None, :, None, :]
        v = v + w["b_v"][None, :, None, :]
    k = np.repeat(k, num_heads // kv_heads, axis=1)   # query head h reads K/V head h // group
    v = np.repeat(v, num_heads // kv_heads, axis=1)
    s = np.einsum("bhsd,bhtd->bhst", q, k) / np.sqrt(d)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    p = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:3]):          # row by row; a row with no key stays 0
        row = s[idx]
        if np.isfinite(row).any():
            e = np.exp(row - row[np.isfinite(row)].max())
            p[idx] = e / e.sum()
    o = np.einsum("bhst,bhtd->bhsd", p, v)
    concat = o.transpose(0, 2, 1, 3).reshape(b_, s_, num_heads * d)
    y = concat @ w["w_o"]
    if "b_o" in w:
        y = y + w["b_o"]
    return y


def positions(seq):
    q, k = np.indices((seq, seq))
    return q[None, None], k[None, None]     # broadcast to [B, H, S, T]


def causal_allowed(seq):
    q, k = positions(seq)
    return k <= q


def window_allowed(seq, window):
    q, k = positions(seq)
    return (k <= q) & (q - k < window)


def data(layer, batch, seq, seed=0):
    d_model = layer.inputs[0].attrs["shape"][2]
    x = np.random.default_rng(seed + 100).standard_normal((batch, seq, d_model)).astype(np.float32)
    return x, layer.init_weights(seed)


CASES = {
    # id: (mha kwargs, batch, seq, allowed(seq) or None)
    "plain": (dict(d_model=64, num_heads=4), 2, 9, None),
    "causal": (dict(d_model=64, num_heads=4, causal=True), 2, 9, causal_allowed),
    "grouped-kv-2-of-8": (dict(d_model=64, num_heads=8, kv_heads=2), 2, 7, None),
    "multi-query": (dict(d_model=64, num_heads=8, kv_heads=1, causal=True), 1, 7, causal_allowed),
    "head_dim-40-seq-97-batch-3": (dict(d_model=64, num_heads=4, head_dim=40), 3, 97, None),
    "no-bias": (dict(d_model=32, num_heads=4, bias=False), 2, 8, None),
    "sliding-window-3": (dict(d_model=32, num_heads=2, mask=mhagen.sliding_window(3)), 2, 10,
                         lambda s: window_allowed(s, 3)),
    "causal+window-1": (dict(d_model=32, num_heads=2, causal=True,
                             mask=mhagen.sliding_window(1)), 1, 6,
                        lambda s: window_allowed(s, 1)),
}


@pytest.mark.parametrize("kwargs, batch, seq, allowed", CASES.values(), ids=CASES.keys())
def test_reference_matches_naive(kwargs, batch, seq, allowed):
    layer = mhagen.mha(**kwargs)
    x, w = data(layer, batch, seq)
    got = layer.reference(x, w)
    assert got.dtype == np.float64
    assert got.shape == (batch, seq, kwargs["d_model"])
    kv = kwargs.get("kv_heads", kwargs["num_heads"])
    expected = naive_mha(x, w, kwargs["num_heads"], kv,
                         None if allowed is None else allowed(seq))
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_masks_change_the_result():
    """Guards the cases above: causal and windowed results really differ from plain ones."""
    x, w = data(mhagen.mha(32, 2), 1, 6)
    plain = mhagen.mha(32, 2).reference(x, w)
    causal = mhagen.mha(32, 2, causal=True).reference(x, w)
    window = mhagen.mha(32, 2, mask=mhagen.sliding_window(2)).reference(x, w)
    assert np.abs(plain - causal).max() > 1e-3
    assert np.abs(causal - window).max() > 1e-3
    # the last query sees every key under causal masking
    np.testing.assert_allclose(causal[:, -1], plain[:, -1], rtol=1e-12, atol=1e-12)


def test_mask_depending_on_head_and_batch():
    """Heads 0 and 1 see everything; other heads are causal, except batch 1 which sees kv 0..2."""
    mask = (ex.head < 2) | (ex.batch.eq(0) & (mhagen.kv_idx <= mhagen.q_idx)) | \
        (ex.batch.eq(1) & (mhagen.kv_idx < 3))
    layer = mhagen.mha(d_model=32, num_heads=4, mask=mask)
    x, w = data(layer, 2, 6)
    q, k = np.indices((6, 6))
    allowed = np.zeros((2, 4, 6, 6), bool)
    allowed[:, :2] = True
    allowed[0, 2:] = k <= q
    allowed[1, 2:] = k < 3
    np.testing.assert_allclose(layer.reference(x, w), naive_mha(x, w, 4, 4, allowed),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mask, hidden_rows, allowed", [
    (mhagen.kv_idx > mhagen.q_idx + 100, slice(None), lambda q, k: k > q + 100),
    ((mhagen.q_idx >= 2) & (mhagen.kv_idx <= mhagen.q_idx), slice(0, 2),
     lambda q, k: (q >= 2) & (k <= q)),
    (mhagen.causal() & (mhagen.kv_idx >= 3), slice(0, 3), lambda q, k: (k <= q) & (k >= 3)),
], ids=["all-rows-hidden", "first-two-queries-hidden", "keys-before-3-hidden"])
def test_fully_masked_rows_are_zero_not_nan(mask, hidden_rows, allowed):
    layer = mhagen.mha(d_model=32, num_heads=4, mask=mask)
    x, w = data(layer, 2, 7)
    vals = run_reference(layer, x, w, return_all=True)
    assert np.isneginf(vals["masked0"][:, hidden_rows]).all()
    for h in range(4):
        p, o = vals[f"p{h}"], vals[f"o{h}"]
        assert not np.isnan(p).any()
        assert (p[:, hidden_rows] == 0).all()
        assert (o[:, hidden_rows] == 0).all()
        visible = np.ones(7, bool)
        visible[hidden_rows] = False
        np.testing.assert_allclose(p[:, visible].sum(-1), 1.0, rtol=1e-12)
    y = vals[layer.output]
    assert np.isfinite(y).all()
    # no attention at all: the output is the output bias
    np.testing.assert_array_equal(y[:, hidden_rows],
                                  np.broadcast_to(w["b_o"].astype(np.float64),
                                                  y[:, hidden_rows].shape))
    np.testing.assert_allclose(y, naive_mha(x, w, 4, 4, allowed(*positions(7))),
                               rtol=1e-10, atol=1e-12)


def test_return_all_has_every_node():
    layer = mhagen.mha(32, 2)
    x, w = data(layer, 1, 5)
    vals = run_reference(layer, x, w, return_all=True)
    assert set(vals) == {n.name for n in layer.nodes}
    assert vals["s0"].shape == (1, 5, 5) and vals["q1"].shape == (1, 5, 16)
    np.testing.assert_array_equal(vals["y"], layer.reference(x, w))


def test_reference_accepts_float64_and_lists():
    layer = mhagen.mha(16, 2)
    x, w = data(layer, 1, 3)
    expected = layer.reference(x, w)
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    np.testing.assert_array_equal(layer.reference(x.astype(np.float64), w64), expected)
    np.testing.assert_array_equal(layer.reference(x.tolist(), w), expected)


# -- input errors --------------------------------------------------------------------------------
LAYER = mhagen.mha(d_model=32, num_heads=4)


def _weights(**changes):
    w = LAYER.init_weights(0)
    for k, v in changes.items():
        if v is None:
            del w[k]
        else:
            w[k] = v(w[k]) if callable(v) else v
    return w


X = np.zeros((2, 5, 32), np.float32)

INPUT_ERRORS = [
    ("x-2d", np.zeros((5, 32), np.float32), _weights(), ["(5, 32)", "[batch, seq, 32]"]),
    ("x-wrong-d_model", np.zeros((2, 5, 16), np.float32), _weights(),
     ["(2, 5, 16)", "'mha'", "[batch, seq, 32]"]),
    ("x-bool", np.zeros((2, 5, 32), bool), _weights(), ["x is a bool array", "pass numbers"]),
    ("weights-missing", X, _weights(w_q=None), ["missing ['w_q']", "expected names"]),
    ("weights-extra", X, {**_weights(), "w_extra": np.zeros(3)},
     ["unexpected ['w_extra']", "expected names"]),
    ("weights-misspelled", X, {("W_Q" if k == "w_q" else k): v for k, v in _weights().items()},
     ["missing ['w_q']", "unexpected ['W_Q']"]),
    ("weights-not-dict", X, list(_weights().values()),
     ["dict of name -> array", "init_weights", "weights_from_torch"]),
    ("weight-shape", X, _weights(w_q=lambda a: a.transpose(0, 2, 1)),
     ["'w_q'", "(4, 8, 32)", "expected (4, 32, 8)", "heads x in x out"]),
    ("weight-shape-unstacked", X, _weights(w_o=lambda a: a[:, :16]),
     ["'w_o'", "(32, 16)", "expected (32, 32)"]),
    ("bias-shape", X, _weights(b_o=lambda a: a[None]), ["'b_o'", "(1, 32)", "expected (32,)"]),
    ("weight-complex", X, _weights(w_k=lambda a: a.astype(np.complex128)),
     ["weights['w_k'] is complex (complex128)", "real numbers"]),
    ("weight-nan", X, _weights(w_v=lambda a: np.where(np.arange(8) == 3, np.nan, a)),
     ["'w_v'", "NaN"]),
    ("weight-inf", X, _weights(b_q=lambda a: np.full_like(a, np.inf)), ["'b_q'", "inf"]),
]


@pytest.mark.parametrize("x, weights, fragments", [e[1:] for e in INPUT_ERRORS],
                         ids=[e[0] for e in INPUT_ERRORS])
def test_reference_input_errors(x, weights, fragments):
    with pytest.raises(InputError) as info:
        LAYER.reference(x, weights)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError) and issubclass(InputError, mhagen.MhagenError)


# -- init_weights --------------------------------------------------------------------------------
def test_init_weights_deterministic_per_seed_and_float32():
    layer = mhagen.mha(d_model=64, num_heads=4, kv_heads=2)
    a, b, c = layer.init_weights(seed=5), layer.init_weights(seed=5), layer.init_weights(seed=6)
    specs = {s.name: s for s in layer.weight_specs()}
    assert set(a) == set(specs) == set(c)
    for name, spec in specs.items():
        assert a[name].dtype == np.float32, name
        assert a[name].shape == spec.shape, name
        np.testing.assert_array_equal(a[name], b[name])
        assert not np.array_equal(a[name], c[name]), name
        if spec.role == "bias":
            assert np.abs(a[name]).max() <= 0.1
        else:
            bound = np.sqrt(6.0 / (spec.fan_in + spec.fan_out))
            assert np.abs(a[name]).max() <= bound
            assert np.abs(a[name]).max() > 0.5 * bound   # Xavier-uniform, not tiny
    assert layer.init_weights().keys() == layer.init_weights(0).keys()
    np.testing.assert_array_equal(layer.init_weights()["w_q"], layer.init_weights(0)["w_q"])
