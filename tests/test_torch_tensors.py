"""Torch tensors and DLPack arrays in and out of a module without copies (mhagen/inputs.py,
mhagen/dlpack.py): a torch x gets a torch answer over the kernels' memory, out= a tensor is
written in place, prepare() and a KVCache bind tensors' memory, float16 and bfloat16 go
both ways, grad-requiring tensors are refused as mhagen is inference-only, capsules and
__dlpack__ objects are read where they lie; torch is imported only when a tensor is given.
"""
import ctypes
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import mhagen
from mhagen import InputError
from mhagen.tolerances import assert_close

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e .[test])")

BATCH, SEQ, D = 2, 8, 64


@pytest.fixture(scope="module")
def plain():
    layer = mhagen.mha(D, 2)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ, weights=w)
    x = np.random.default_rng(1).standard_normal((BATCH, SEQ, D)).astype(np.float32)
    return layer, w, m, x


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half(request):
    layer = mhagen.mha(D, 2, dtype=request.param)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ, weights=layer.init_weights(0))
    x = np.random.default_rng(2).standard_normal((BATCH, SEQ, D)).astype(np.float32)
    return request.param, m, x


@pytest.fixture(scope="module")
def cross():
    """A cross-attention layer with key padding: context= and kv_lens= as tensors."""
    layer = mhagen.mha(D, 2, cross=True, kv_dim=48, key_padding=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=BATCH, seq_len=SEQ, kv_seq_len=12, weights=w)
    return layer, w, m


def as_numpy(t):
    """A tensor's values as numpy (bfloat16 as ml_dtypes')."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def test_a_tensor_is_answered_with_a_tensor_over_the_kernels_memory(plain):
    layer, w, m, x = plain
    t = torch.from_numpy(x).clone()     # torch's allocator (from_numpy keeps numpy's memory)
    assert t.data_ptr() % 64 == 0       # 64-byte aligned: read in place
    seen = m._check_x(t)[0]
    assert np.shares_memory(seen, t.numpy()) and mhagen.arrays.is_aligned(seen)
    y = m(t)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), m(x))
    assert_close(y.numpy(), layer.reference(x, w))
    # the answer is the numpy buffer the kernels wrote, shared (torch.from_numpy)
    assert y.numpy().base is not None and y.data_ptr() % 64 == 0


def test_out_tensor_is_written_in_place(plain):
    layer, w, m, x = plain
    out = torch.full((BATCH, SEQ, D), 7.0)
    where = out.data_ptr()
    got = m(torch.from_numpy(x), out=out)
    assert got is out and out.data_ptr() == where
    np.testing.assert_array_equal(out.numpy(), m(x))
    # a numpy x with a tensor out= gets the tensor back; an unaligned tensor still works
    # (the kernels write the module's buffer, copied into it)
    odd = torch.zeros(BATCH * SEQ * D + 1)[1:].view(BATCH, SEQ, D)
    assert m(x, out=odd) is odd
    np.testing.assert_array_equal(odd.numpy(), m(x))
    with pytest.raises(InputError, match=r"out= must be a float32 numpy array of shape "
                                         r"\(2, 8, 64\) .* got a torch.Tensor float64"):
        m(x, out=torch.zeros(BATCH, SEQ, D, dtype=torch.float64))


def test_half_tensors_both_ways(half):
    """float16 and bfloat16 tensors are the layer's storage: read in place (bfloat16
    through a zero-copy int16 view) and answered in the same dtype; out= of that dtype
    keeps its data pointer. A float32 tensor is answered in float32."""
    dtype, m, x = half
    tdtype = getattr(torch, dtype)
    t = torch.from_numpy(x).to(tdtype)
    assert np.shares_memory(m._check_x(t)[0], as_numpy(t))
    y = m(t)
    assert y.dtype == tdtype
    stored = as_numpy(t)
    np.testing.assert_array_equal(as_numpy(y), m(stored))
    out = torch.empty(BATCH, SEQ, D, dtype=tdtype)
    where = out.data_ptr()
    assert m(t, out=out) is out and out.data_ptr() == where
    assert torch.equal(out, y)
    y32 = m(torch.from_numpy(x))
    assert y32.dtype == torch.float32
    np.testing.assert_array_equal(y32.numpy(), m(x))


def test_prepare_binds_tensors_memory(plain, cross):
    """prepare() reads x, context and kv_lens where the tensors lie: writes into them
    between runs are seen; every run returns the same tensor (out=, or one made once)."""
    layer, w, m, x = plain
    t = mhagen.aligned_empty(x.shape, like="torch")
    t.copy_(torch.from_numpy(x))
    run = m.prepare(t)
    first = run()
    assert isinstance(first, torch.Tensor)
    np.testing.assert_array_equal(first.numpy(), m(x))
    t.mul_(0.5)
    assert run() is first
    np.testing.assert_array_equal(first.numpy(), m(x * 0.5))
    out = torch.empty(BATCH, SEQ, D)
    assert m.prepare(t, out=out)() is out

    layer, w, mc, = cross
    rng = np.random.default_rng(3)
    # clone(): torch's allocator (64-byte aligned); from_numpy keeps numpy's alignment
    xc = torch.from_numpy(rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)).clone()
    context = torch.from_numpy(rng.standard_normal((BATCH, 12, 48)).astype(np.float32)).clone()
    lens = torch.tensor([12, 5], dtype=torch.int32)
    run = mc.prepare(xc, context=context, kv_lens=lens)
    lens[1] = 3                                   # changed in place after prepare
    np.testing.assert_array_equal(run().numpy(),
                                  mc(xc.numpy(), context=context.numpy(), kv_lens=[12, 3]))


def test_context_and_kv_lens_as_tensors(cross):
    layer, w, m = cross
    rng = np.random.default_rng(4)
    x = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
    context = rng.standard_normal((BATCH, 12, 48)).astype(np.float32)
    y = m(torch.from_numpy(x), context=torch.from_numpy(context),
          kv_lens=torch.tensor([12, 4]))
    assert isinstance(y, torch.Tensor)
    expected = layer.reference(x, w, context=context, kv_lens=[12, 4])
    assert_close(y.numpy(), expected)
    # numpy x with tensor context: the answer follows x
    assert isinstance(m(x, context=torch.from_numpy(context), kv_lens=[12, 4]), np.ndarray)
    with torch.no_grad():
        tw = {k: torch.from_numpy(v) for k, v in w.items()}
    np.testing.assert_array_equal(m(x, context=context, kv_lens=[12, 4], weights=tw),
                                  m(x, context=context, kv_lens=[12, 4]))


def test_kv_cache_of_tensors_is_written_in_place():
    layer = mhagen.mha(32, 2, kv_cache=8, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86", batch=1, seq_len=None, max_seq_len=4, weights=w)
    k = torch.zeros(1, 2, 8, 16)
    v = torch.zeros(1, 2, 8, 16)
    lens = torch.zeros(1, dtype=torch.int32)
    cache = mhagen.KVCache(k, v, lens)
    reference = mhagen.KVCache.empty(layer, 1, dtype=np.float64)
    x = np.random.default_rng(5).standard_normal((1, 4, 32)).astype(np.float32)
    for part in (x[:, :3], x[:, 3:]):
        y = m(torch.from_numpy(part), cache=cache)
        assert isinstance(y, torch.Tensor)
        assert_close(y.numpy(), layer.reference(part, w, cache=reference))
    assert lens.tolist() == [4]                       # advanced in the caller's tensor
    assert k[0, :, :4].abs().sum() > 0 and k[0, :, 4:].abs().sum() == 0
    np.testing.assert_allclose(k[0, :, :4].numpy(), reference.k[0, :, :4], atol=1e-5)


def test_saved_and_loaded_module_takes_tensors(plain, tmp_path):
    layer, w, m, x = plain
    loaded = mhagen.load(m.save(tmp_path / "m", c_api=False))
    y = loaded(torch.from_numpy(x))
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.numpy(), m(x))
    out = torch.empty(BATCH, SEQ, D)
    where = out.data_ptr()
    assert loaded(torch.from_numpy(x), out=out) is out and out.data_ptr() == where
    assert loaded.latency(torch.from_numpy(x), number=1, repeat=1, min_repeat_ms=0) > 0


def test_attention_maps_answer_a_tensor(plain):
    layer, w, m, x = plain
    p = m.attention_maps(torch.from_numpy(x))
    assert isinstance(p, torch.Tensor) and p.shape == (BATCH, 2, SEQ, SEQ)
    np.testing.assert_array_equal(p.numpy(), m.attention_maps(x))


@pytest.mark.parametrize("call", ["x", "out", "prepare", "context", "weights"])
def test_grad_requiring_tensors_are_refused_as_inference_only(plain, cross, call):
    layer, w, m, x = plain
    needs = torch.from_numpy(x).requires_grad_()
    message = "requires grad; mhagen is inference-only: pass .*detach"
    calls = {
        "x": lambda: m(needs),
        "out": lambda: m(x, out=torch.zeros(BATCH, SEQ, D, requires_grad=True)),
        "prepare": lambda: m.prepare(needs),
        "context": lambda: cross[2](x, context=torch.zeros(BATCH, 12, 48, requires_grad=True),
                                    kv_lens=[12, 12]),
        "weights": lambda: m(x, weights=dict(w, w_q=torch.from_numpy(w["w_q"])
                                             .requires_grad_())),
    }
    with pytest.raises(InputError, match=message):
        calls[call]()
    with torch.no_grad():          # taken under no_grad (and inference_mode)
        calls["x"]()
    with torch.inference_mode():
        assert isinstance(m(torch.from_numpy(x)), torch.Tensor)


class DLPackOnly:
    """A foreign array type that exports its memory through __dlpack__ only (as TVM, JAX
    or CuPy arrays do): here a numpy array's."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_capsules_and_objects_are_read_in_place(plain):
    layer, w, m, x = plain
    aligned = mhagen.aligned_empty(x.shape)
    aligned[...] = x
    expected = m(x)
    foreign = DLPackOnly(aligned)
    assert np.shares_memory(m._check_x(foreign)[0], aligned)
    y = m(foreign)
    assert isinstance(y, np.ndarray)            # not torch: numpy, itself a DLPack array
    np.testing.assert_array_equal(y, expected)
    t = torch.from_numpy(x).clone()        # torch's allocator: 64-byte aligned
    capsule = torch.utils.dlpack.to_dlpack(t)
    assert m._check_x(torch.utils.dlpack.to_dlpack(t))[0].ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(m(capsule), expected)
    with pytest.raises(InputError, match="x is a DLPack capsule that was read already"):
        m(capsule)
    # out= a writable DLPack array: the kernels write its memory, and it is returned
    out = DLPackOnly(mhagen.arrays.aligned_zeros(x.shape))
    assert m(x, out=out) is out
    np.testing.assert_array_equal(out.a, expected)


def test_bfloat16_capsule_is_relabelled_not_copied():
    t = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
    a = mhagen.inputs.argument(torch.utils.dlpack.to_dlpack(t), "x", dtype=None)
    assert a.dtype == ml_dtypes.bfloat16 and a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a.astype(np.float32), np.arange(6))


def _on_device(array, device_type):
    """A capsule of `array`'s memory that says it lies on another device (DLPack's
    kDLCUDA = 2): what a GPU tensor's export looks like to a CPU consumer."""
    capsule = array.__dlpack__()
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    ctypes.c_int32.from_address(get(capsule, b"dltensor") + 8).value = device_type
    return capsule


def test_dlpack_refusals_say_what_was_passed(plain):
    layer, w, m, x = plain
    with pytest.raises(InputError, match="x is a DLPack tensor on cuda:0; mhagen's CPU "
                                         "modules read host memory"):
        m(_on_device(x, 2))
    with pytest.raises(InputError, match="no DLPack tensor"):
        m(_other_capsule())
    with pytest.raises(InputError, match="x is complex .complex64."):
        m(DLPackOnly(np.zeros(x.shape, np.complex64)))


def _other_capsule():
    """A capsule that holds no DLPack tensor (another C extension's pointer)."""
    new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
    return new(ctypes.addressof(_OTHER), ctypes.addressof(_OTHER), None)


_OTHER = ctypes.create_string_buffer(b"other")   # the capsule's pointer and name: kept alive


def test_aligned_empty_like_torch():
    for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                          ("float16", torch.float16)):
        t = mhagen.aligned_empty((3, 5, 7), dtype, like="torch")
        assert isinstance(t, torch.Tensor) and t.dtype == tdtype and t.shape == (3, 5, 7)
        assert t.data_ptr() % 64 == 0 and t.is_contiguous()
    assert not mhagen.arrays.aligned_zeros((4,), like="torch").any()
    with pytest.raises(InputError, match="like= takes 'numpy' or 'torch', got 'jax'"):
        mhagen.aligned_empty((4,), like="jax")


def test_torch_is_imported_only_when_a_tensor_is_given():
    """numpy, DLPack objects and numpy masks run with torch unimportable."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import mhagen
        assert "torch" not in sys.modules, "import mhagen imported torch"
        sys.modules["torch"] = None            # import torch now fails
        layer = mhagen.mha(64, 2, key_padding=True)
        m = mhagen.build(layer, "x86", batch=2, seq_len=8, weights=layer.init_weights(0))
        x = mhagen.aligned_empty((2, 8, 64))
        x[...] = 1.0

        class DLPackOnly:
            def __init__(self, a):
                self.a = a
            def __dlpack__(self, **kwargs):
                return self.a.__dlpack__(**kwargs)

        lens = mhagen.kv_lens_from_mask(np.array([[False] * 8, [False] * 5 + [True] * 3]))
        y = m(DLPackOnly(x), kv_lens=lens)
        assert isinstance(y, np.ndarray) and lens.tolist() == [8, 5]
        np.testing.assert_array_equal(y, m(x, kv_lens=[8, 5]))
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
