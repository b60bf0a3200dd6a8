"""The input policy (mhagen/inputs.py): x, context, weights and kv_lens are converted or refused
the same way, each message naming the argument; in-place arguments are never converted."""
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

import mhagen
from mhagen import InputError
from mhagen.tolerances import assert_close

BATCH, SEQ, D = 2, 8, 64


@pytest.fixture(scope="module")
def plain():
    layer = mhagen.mha(D, 2)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ, weights=w)
    x = np.random.default_rng(1).standard_normal((BATCH, SEQ, D)).astype(np.float32)
    return layer, w, m, x


@pytest.fixture(scope="module")
def unbound(plain):
    """A second module of the plain layer, for bind()."""
    return mhagen.build(plain[0], "x86", batch=BATCH, seq_len=SEQ)


@pytest.fixture(scope="module")
def cross():
    """A cross-attention layer with key padding: takes context= and kv_lens=."""
    layer = mhagen.mha(D, 2, cross=True, key_padding=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ, kv_seq_len=SEQ, weights=w)
    rng = np.random.default_rng(2)
    x, context = (rng.standard_normal((BATCH, SEQ, D)).astype(np.float32) for _ in "xc")
    return layer, w, m, x, context, np.array([SEQ, 3], np.int32)


class HasArray:
    """A foreign array type that numpy reads through __array__."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)


def _grad_free(a):
    """A tensor that requires grad, used under torch.no_grad() (see the test)."""
    return torch.tensor(a, requires_grad=True)


# (id, make the argument from a float32 array, the values it holds in float64)
CONVERTED = [
    ("float64", lambda a: a.astype(np.float64), lambda a: a.astype(np.float64)),
    ("float16", lambda a: a.astype(np.float16), lambda a: a.astype(np.float16)),
    ("int32", lambda a: np.round(a * 4).astype(np.int32), lambda a: np.round(a * 4)),
    ("uint8", lambda a: np.abs(np.round(a * 4)).astype(np.uint8),
     lambda a: np.abs(np.round(a * 4))),
    ("list", lambda a: a.tolist(), lambda a: a),
    ("tuple", lambda a: tuple(a.tolist()), lambda a: a),
    ("strided", lambda a: np.stack([a, a], -1)[..., 0], lambda a: a),
    ("torch-float32", torch.from_numpy, lambda a: a),
    ("torch-float64", lambda a: torch.from_numpy(a.astype(np.float64)), lambda a: a),
    ("torch-bfloat16", lambda a: torch.from_numpy(a).to(torch.bfloat16),
     lambda a: a.astype(ml_dtypes.bfloat16)),
    ("torch-grad-under-no_grad", _grad_free, lambda a: a),
    ("__array__", HasArray, lambda a: a),
]
IDS = [c[0] for c in CONVERTED]


@pytest.mark.parametrize("make, values", [c[1:] for c in CONVERTED], ids=IDS)
def test_converted_x_gives_the_float32_arrays_answer(plain, make, values):
    layer, w, m, x = plain
    same = values(x).astype(np.float32)             # the float32 array it converts to
    given = make(x)
    with torch.no_grad():
        y = m(given)
    assert isinstance(y, torch.Tensor) == isinstance(given, torch.Tensor)  # torch in, out
    y = np.asarray(y)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, m(same))
    assert_close(y, layer.reference(values(x).astype(np.float64), w))


@pytest.mark.parametrize("make, values", [c[1:] for c in CONVERTED], ids=IDS)
def test_converted_weights_give_the_float32_arrays_answer(plain, unbound, make, values):
    """Weights go the same way as x: passed per call and bound."""
    layer, w, m, x = plain
    with torch.no_grad():
        given = {k: make(v) for k, v in w.items()}
    same = {k: values(v).astype(np.float32) for k, v in w.items()}
    with torch.no_grad():
        y = m(x, weights=given)
    np.testing.assert_array_equal(y, m(x, weights=same))
    assert_close(y, layer.reference(x, {k: values(v).astype(np.float64) for k, v in w.items()}))
    with torch.no_grad():
        unbound.bind(given)
    assert all(a.dtype == np.float32 for a in unbound.weights.values())
    np.testing.assert_array_equal(unbound(x), y)


@pytest.mark.parametrize("make, values", [c[1:] for c in CONVERTED], ids=IDS)
def test_converted_context_gives_the_float32_arrays_answer(cross, make, values):
    layer, w, m, x, context, lens = cross
    with torch.no_grad():
        y = m(x, context=make(context), kv_lens=lens)
    same = values(context).astype(np.float32)
    np.testing.assert_array_equal(y, m(x, context=same, kv_lens=lens))
    assert_close(y, layer.reference(x, w, context=values(context).astype(np.float64),
                                    kv_lens=lens))


@pytest.mark.parametrize("lens", [
    [SEQ, 3], (SEQ, 3), np.array([SEQ, 3], np.int64), np.array([SEQ, 3], np.uint16),
    torch.tensor([SEQ, 3]), HasArray(np.array([SEQ, 3], np.int64))],
    ids=["list", "tuple", "int64", "uint16", "torch-int64", "__array__"])
def test_converted_kv_lens_give_the_int32_arrays_answer(cross, lens):
    layer, w, m, x, context, int32 = cross
    y = m(x, context=context, kv_lens=lens)
    np.testing.assert_array_equal(y, m(x, context=context, kv_lens=int32))
    assert_close(y, layer.reference(x, w, context=context, kv_lens=lens))


def test_a_float32_array_or_tensor_is_read_where_it_lies(plain):
    """No copy for a float32 C-contiguous x, nor for a float32 torch CPU tensor."""
    layer, w, m, x = plain
    aligned = mhagen.aligned_empty(x.shape)
    aligned[...] = x
    assert m._check_x(aligned)[0] is aligned
    t = torch.from_numpy(aligned)
    assert np.shares_memory(m._check_x(t)[0], aligned)
    np.testing.assert_array_equal(m(t), m(x))


def test_a_half_layer_answers_converted_inputs_in_float32():
    """bfloat16 layer: lists and float64 arrays go in as float32 (rounded into storage) and
    are answered in float32; a bfloat16 torch tensor is its own dtype, answered so."""
    layer = mhagen.mha(D, 2, dtype="bfloat16")
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ,
                     weights={k: v.astype(np.float64) for k, v in w.items()})
    x = np.random.default_rng(3).standard_normal((BATCH, SEQ, D)).astype(np.float32)
    y32 = m(x)
    for given in (x.tolist(), x.astype(np.float64)):
        y = m(given)
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, y32)
    y = m(torch.from_numpy(x))            # torch in, torch out
    assert y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), y32)
    yh = m(torch.from_numpy(x).to(torch.bfloat16))
    assert yh.dtype == torch.bfloat16
    np.testing.assert_array_equal(yh.view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                                  m(x.astype(ml_dtypes.bfloat16)))
    assert_close(y32, layer.reference(x, w), "bfloat16")


def _object(shape):
    a = np.empty(shape, object)
    a[...] = 1.0
    return a


# (id, make a bad argument of `shape` for argument `name`, what its message says)
REFUSED = [
    ("bool", lambda s: np.zeros(s, bool), "{name} is a bool array; pass numbers"),
    ("complex", lambda s: np.zeros(s, np.complex64), "{name} is complex (complex64)"),
    ("object", _object, "{name} is an object array"),
    ("strings", lambda s: np.full(s, "a"), "{name} holds strings (<U1)"),
    ("ragged", lambda s: [[0.0] * s[-1], [0.0]], "{name} is a ragged list: rows of "
                                                  "different lengths"),
    ("dict", lambda s: {"x": np.zeros(s)}, "{name} is a dict; pass a numpy array"),
    ("str", lambda s: "x.npy", "{name} is a str; pass a numpy array"),
    ("torch-grad", lambda s: torch.zeros(s, requires_grad=True),
     "{name} requires grad; mhagen is inference-only: pass {name}.detach() or call under "
     "torch.no_grad()/torch.inference_mode()"),
    ("torch-meta", lambda s: torch.zeros(s, device="meta"),
     "{name} is on meta; mhagen's CPU modules take CPU tensors: {name}.cpu()"),
    ("torch-complex", lambda s: torch.zeros(s, dtype=torch.complex64),
     "{name} is complex (complex64)"),
    ("too-large", lambda s: np.full(s, 1e39), "{name} has values beyond float32's range"),
]
REFUSED_IDS = [r[0] for r in REFUSED]


@pytest.mark.parametrize("make, message", [r[1:] for r in REFUSED], ids=REFUSED_IDS)
def test_refused_x_and_weights_say_what_was_passed(plain, make, message):
    """By a module call, bind() and the reference (which reads 1e39 as it is: float64)."""
    layer, w, m, x = plain
    bad = dict(w, w_q=make(w["w_q"].shape))
    calls = [("x", lambda: m(make(x.shape))), ("weights['w_q']", lambda: m(x, weights=bad)),
             ("weights['w_q']", lambda: m.bind(bad))]
    if "range" not in message:
        calls += [("x", lambda: layer.reference(make(x.shape), w)),
                  ("weights['w_q']", lambda: layer.reference(x, bad))]
    for name, call in calls:
        with pytest.raises(InputError) as info:
            call()
        expected = message.format(name=name)
        assert expected in str(info.value), (expected, str(info.value))
    assert m.weights["w_q"] is not bad["w_q"]        # nothing bound by a refused bind


@pytest.mark.parametrize("make, message", [r[1:] for r in REFUSED if r[0] != "too-large"],
                         ids=[i for i in REFUSED_IDS if i != "too-large"])
def test_refused_context_says_what_was_passed(cross, make, message):
    layer, w, m, x, context, lens = cross
    with pytest.raises(InputError) as info:
        m(x, context=make(context.shape), kv_lens=lens)
    assert message.format(name="context") in str(info.value)


@pytest.mark.parametrize("lens, message", [
    (np.array([2.0, 3.0]), "kv_lens must be integers of shape (2,), got float64"),
    ([2.5, 3], "kv_lens must be integers of shape (2,), got float64"),
    (np.array([2**40, 3]), "kv_lens has values beyond int32"),
    (np.array([True, False]), "kv_lens is a bool array"),
    ({"a": 1}, "kv_lens is a dict; pass a numpy array of shape (2,)"),
    (torch.tensor([2, 3], device="meta"), "kv_lens is on meta"),
    ([[1, 2], [3]], "kv_lens is a ragged list"),
], ids=["float", "float-list", "beyond-int32", "bool", "dict", "torch-meta", "ragged"])
def test_refused_kv_lens_say_what_was_passed(cross, lens, message):
    layer, w, m, x, context, _ = cross
    for call in (lambda: m(x, context=context, kv_lens=lens),
                 lambda: layer.reference(x, w, context=context, kv_lens=lens)):
        with pytest.raises(InputError) as info:
            call()
        assert message in str(info.value), str(info.value)


def test_in_place_arguments_are_never_converted(plain, cross):
    """out=, prepare()'s arrays and a KVCache's are used in place: another dtype or layout is
    refused with the one needed, not copied."""
    layer, w, m, x = plain
    with pytest.raises(InputError, match=r"out= must be a float32 numpy array of shape "
                                         r"\(2, 8, 64\) \(the call writes its answer into it\), "
                                         r"got float64"):
        m(x, out=np.zeros((BATCH, SEQ, D)))
    with pytest.raises(InputError, match="out= must be .* got a list"):
        m(x, out=np.zeros((BATCH, SEQ, D), np.float32).tolist())
    with pytest.raises(InputError, match="x must be a C-contiguous, writable, 64-byte aligned "
                                         "float32 numpy array .prepare.. reads it in place"):
        m.prepare(x.astype(np.float64))
    with pytest.raises(InputError, match="x must be .* got a torch.Tensor float64"):
        m.prepare(torch.from_numpy(x.astype(np.float64)))
    _, _, mc, xc, context, lens = cross
    aligned = mhagen.aligned_empty(xc.shape)
    aligned[...] = xc
    with pytest.raises(InputError, match="kv_lens must be a numpy integer array .prepare"):
        mc.prepare(aligned, context=mhagen.aligned_empty(context.shape), kv_lens=[SEQ, 3])
    decoder = mhagen.mha(32, 2, kv_cache=8, causal=True)
    md = mhagen.build(decoder, "x86", batch=1, seq_len=1, weights=decoder.init_weights(0))
    cache = md.new_cache()
    step = np.ones((1, 1, 32), np.float32)
    with pytest.raises(InputError, match="cache.lens must be an int32 numpy array of shape "
                                         r"\(1,\) \(each call advances it in place\), got a list"):
        md(step, cache=mhagen.KVCache(cache.k, cache.v, [0]))
    with pytest.raises(InputError, match="cache.k must be a C-contiguous, writable, 64-byte "
                                         "aligned float32 numpy array .the kernels write it"):
        md(step, cache=mhagen.KVCache(cache.k.astype(np.float64), cache.v, cache.lens))
    # KVCache.from_arrays makes copies: there lists and tensors are converted
    copied = mhagen.KVCache.from_arrays(torch.from_numpy(cache.k), cache.v.tolist(), [0])
    assert copied.k.dtype == np.float32 and copied.v.dtype == np.float64
    assert copied.lens.dtype == np.int32


def test_mhagen_imports_torch_only_when_given_a_tensor():
    """The policy and the reference never import torch; a module builds and runs with torch
    unimportable (tvm_ffi itself imports torch when it can, so that is how a module call is
    checked)."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import mhagen
        layer = mhagen.mha(64, 2)
        w = layer.init_weights(0)
        x = np.ones((2, 8, 64))
        layer.reference(x, w)
        layer.reference(x.tolist(), {k: v.tolist() for k, v in w.items()})
        assert "torch" not in sys.modules, "the reference imported torch"
        sys.modules["torch"] = None            # import torch now fails
        m = mhagen.build(layer, "x86", batch=2, seq_len=8, weights=w)
        assert m(x).shape == (2, 8, 64) and m(x.tolist()).shape == (2, 8, 64)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
