"""mhagen.save_weights / load_weights: safetensors files (mhagen/tensor_file.py) that the
`safetensors` package reads and writes too, and .npz; refusals write nothing."""
import json
import struct

import numpy as np
import pytest

import mhagen
from mhagen.dtypes import numpy_dtype
from mhagen.tensor_file import read_header, read_safetensors

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _tensors():
    rng = np.random.default_rng(0)
    return {"w32": rng.standard_normal((3, 5)).astype(np.float32),
            "w16": rng.standard_normal((4,)).astype(np.float16),
            "wbf": rng.standard_normal((2, 3, 2)).astype(numpy_dtype("bfloat16")),
            "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
            "scalar": np.float32(2.5).reshape(())}


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_keeps_every_dtype_bit_for_bit(tmp_path):
    t = _tensors()
    path = mhagen.save_weights(tmp_path / "w.safetensors", t, {"source": "test"})
    back = mhagen.load_weights(path)
    assert sorted(back) == sorted(t)
    for name in t:
        assert _same(back[name], np.asarray(t[name])), name
    _, metadata = read_safetensors(path)
    assert metadata == {"source": "test"}
    header, start = read_header(path)
    assert start % 64 == 0                 # data 64-byte aligned, header padded with spaces


def test_the_safetensors_package_reads_what_mhagen_writes(tmp_path):
    t = {k: v for k, v in _tensors().items() if k != "wbf"}   # (its numpy API lacks bfloat16)
    path = mhagen.save_weights(tmp_path / "w.safetensors", t)
    theirs = safetensors_numpy.load_file(str(path))
    assert sorted(theirs) == sorted(t)
    for name in t:
        assert _same(theirs[name], np.asarray(t[name])), name


def test_bfloat16_reads_back_in_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    w = _tensors()["wbf"]
    path = mhagen.save_weights(tmp_path / "w.safetensors", {"wbf": w})
    got = load_file(str(path))["wbf"]
    assert got.dtype == torch.bfloat16
    assert np.array_equal(got.float().numpy(), w.astype(np.float32))


def test_load_weights_reads_what_the_safetensors_package_writes(tmp_path):
    layer = mhagen.mha(32, 2)
    w = layer.init_weights(0)
    safetensors_numpy.save_file(w, str(tmp_path / "theirs.safetensors"))
    back = mhagen.load_weights(tmp_path / "theirs.safetensors", graph=layer)
    assert all(_same(back[k], w[k]) for k in w)
    x = np.random.default_rng(1).standard_normal((1, 8, 32)).astype(np.float32)
    assert np.array_equal(layer.reference(x, back), layer.reference(x, w))


def test_npz_round_trip(tmp_path):
    t = {k: v for k, v in _tensors().items() if k != "wbf"}
    back = mhagen.load_weights(mhagen.save_weights(tmp_path / "w.npz", t))
    assert all(_same(back[k], np.asarray(t[k])) for k in t)


def _write_raw(path, header: dict, data: bytes):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "shorter than the 8-byte header length"),
    (lambda b: b[:40], "header of .* bytes, and the file has"),
    (lambda b: b[:-4], "data offsets .* do not hold it"),
])
def test_a_damaged_file_is_refused_with_its_name(tmp_path, damage, message):
    path = mhagen.save_weights(tmp_path / "w.safetensors", {"w": np.ones((4, 4), np.float32)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(mhagen.InputError, match=message):
        mhagen.load_weights(path)


def test_offsets_beyond_the_file_are_refused(tmp_path):
    path = _write_raw(tmp_path / "w.safetensors",
                      {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(mhagen.InputError, match="'w'.*data offsets \\[0, 16\\]"):
        mhagen.load_weights(path)
    path = _write_raw(tmp_path / "x.safetensors",
                      {"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(mhagen.InputError, match="'w' has a header entry mhagen cannot read"):
        mhagen.load_weights(path)


def test_paths_that_are_not_files_are_refused(tmp_path):
    with pytest.raises(mhagen.InputError, match="a directory"):
        mhagen.load_weights(tmp_path)
    with pytest.raises(mhagen.InputError, match="no weights file"):
        mhagen.load_weights(tmp_path / "missing.safetensors")
    with pytest.raises(mhagen.InputError, match="is a directory"):
        mhagen.save_weights(tmp_path, {"w": np.ones(2, np.float32)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("weights, metadata, message", [
    ({"w": np.ones(2, np.complex64)}, None, "complex64"),
    ({1: np.ones(2, np.float32)}, None, "dict of name -> array"),
    ({"w": np.ones(2, np.float32)}, {"k": 1}, "strings to strings"),
])
def test_refused_weights_write_nothing(tmp_path, weights, metadata, message):
    with pytest.raises(mhagen.InputError, match=message):
        mhagen.save_weights(tmp_path / "w.safetensors", weights, metadata)
    assert list(tmp_path.iterdir()) == []


def test_weights_are_checked_against_a_graph(tmp_path):
    layer = mhagen.mha(32, 2)
    w = layer.init_weights(0)
    w["w_zz"] = w.pop("w_q")
    path = mhagen.save_weights(tmp_path / "w.safetensors", w)
    with pytest.raises(mhagen.InputError, match="w_q|w_zz"):
        mhagen.load_weights(path, graph=layer)
    w = layer.init_weights(0)
    w["w_o"] = w["w_o"][:-1]
    path = mhagen.save_weights(tmp_path / "short.safetensors", w)
    with pytest.raises(mhagen.InputError, match="w_o"):
        mhagen.load_weights(path, graph=layer)
