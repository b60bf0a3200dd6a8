"""Compiled x86 modules against the float64 reference; save/load; bad input to modules."""
import json

import numpy as np
import pytest

import mhagen
from mhagen.artifact.manifest import content_hash
from mhagen.tolerances import assert_close
from tests.conftest import random_input

CASES = {
    # id: (mha kwargs, batch, seq_len)
    "tiny": (dict(d_model=64, num_heads=4), 2, 7),
    "causal": (dict(d_model=64, num_heads=4, causal=True), 1, 33),
    "gqa-2of8-hd40-seq97-b3": (dict(d_model=320, num_heads=8, head_dim=40, kv_heads=2), 3, 97),
    "causal-gqa-hd40-seq97": (dict(d_model=320, num_heads=8, head_dim=40, kv_heads=2,
                                   causal=True), 1, 97),
    "mqa-nobias": (dict(d_model=96, num_heads=6, kv_heads=1, bias=False), 2, 20),
    "sliding-window": (dict(d_model=64, num_heads=2, mask=mhagen.sliding_window(5)), 1, 40),
}
SLOW_CASES = {
    "default-512x8-seq128": (dict(d_model=512, num_heads=8), 1, 128),
    "causal-512x8-b3-seq97": (dict(d_model=512, num_heads=8, causal=True), 3, 97),
}


def _check(kwargs, batch, seq_len, fuse=True):
    layer = mhagen.mha(**kwargs)
    w = layer.init_weights(seed=1)
    x = random_input(layer, batch, seq_len)
    module = mhagen.build(layer, "x86", batch=batch, seq_len=seq_len, weights=w, fuse=fuse)
    assert module.program.fusion.startswith("fused" if fuse else "not fused")
    assert_close(module(x), layer.reference(x, w))
    return module, layer, w, x


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_compiled_matches_reference(case, fuse):
    _check(*CASES[case], fuse=fuse)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=list(SLOW_CASES))
def test_compiled_matches_reference_large(case):
    _check(*SLOW_CASES[case])


@pytest.fixture(scope="module")
def small():
    layer = mhagen.mha(64, 4, causal=True)
    w = layer.init_weights(seed=2)
    x = random_input(layer, 2, 9)
    return layer, w, x, mhagen.build(layer, batch=2, seq_len=9, weights=w)


def test_fully_masked_rows_give_zeros_not_nan():
    # Queries 0..3 see no key at all: their attention output is 0, so y = bias path only.
    layer = mhagen.mha(32, 2, mask=(mhagen.q_idx >= 4) & (mhagen.kv_idx <= mhagen.q_idx))
    w = layer.init_weights()
    x = random_input(layer, 1, 12)
    y = mhagen.build(layer, batch=1, seq_len=12, weights=w)(x)
    assert np.all(np.isfinite(y))
    assert_close(y, layer.reference(x, w))
    # with zero attention, each head outputs 0 and y[:, :4] is exactly the output bias
    np.testing.assert_allclose(y[0, :4], np.broadcast_to(w["b_o"], (4, 32)), atol=1e-6)


def test_weights_at_call_time(small):
    layer, w, x, module = small
    w2 = layer.init_weights(seed=7)
    assert_close(module(x, weights=w2), layer.reference(x, w2))
    unbound = mhagen.build(layer, batch=2, seq_len=9)
    with pytest.raises(mhagen.InputError, match="no weights"):
        unbound(x)
    assert_close(unbound(x, weights=w), layer.reference(x, w))


def test_save_load_round_trip(small, tmp_path):
    layer, w, x, module = small
    module.save(tmp_path / "m")
    loaded = mhagen.load(tmp_path / "m")
    np.testing.assert_array_equal(loaded(x), module(x))
    assert loaded.graph == layer
    assert "scores" in loaded.inspect("graph")
    assert "T.prim_func" in loaded.inspect("tir")
    assert "vfmadd" in loaded.inspect("source")  # AVX-512/AVX2 fused multiply-add
    assert json.loads(loaded.inspect("manifest"))["shapes"]["input"] == [2, 9, 64]


@pytest.mark.parametrize("x_shape,dtype,match", [
    ((2, 9, 63), np.float32, r"takes \[batch, seq, 64\]"),
    ((2, 10, 64), np.float32, "rebuild with"),
    ((2, 9, 64), np.bool_, "x is a bool array"),
    ((2, 9, 64), np.complex64, "x is complex"),
], ids=["d_model", "seq_len", "bool", "complex"])
def test_bad_input_to_module(small, x_shape, dtype, match):
    module = small[3]
    with pytest.raises(mhagen.InputError, match=match):
        module(np.zeros(x_shape, dtype))


def test_bad_weights_to_module(small):
    layer, w, x, module = small
    bad = dict(w, w_q=w["w_q"][:, :, :8])
    with pytest.raises(mhagen.InputError, match="expected"):
        module(x, weights=bad)
    with pytest.raises(mhagen.InputError, match="missing"):
        module(x, weights={k: v for k, v in w.items() if k != "b_o"})


def test_unknown_target_and_bad_shapes():
    layer = mhagen.mha(64, 4)
    with pytest.raises(mhagen.TargetError, match="choose one of"):
        mhagen.build(layer, "arm9")
    with pytest.raises(mhagen.GraphError, match="seq_len"):
        mhagen.build(layer, seq_len=0)


def _saved(small, tmp_path):
    path = small[3].save(tmp_path / "m")
    return path, json.loads((path / "manifest.json").read_text())


def test_load_rejects_corrupt_files(small, tmp_path):
    path, _ = _saved(small, tmp_path)
    data = bytearray((path / "weights.safetensors").read_bytes())
    data[200] ^= 0xFF
    (path / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(mhagen.ArtifactError, match="weights.safetensors is corrupted"):
        mhagen.load(path)
    (path / "weights.safetensors").write_bytes(bytes(data[:100]))
    with pytest.raises(mhagen.ArtifactError, match="weights.safetensors"):
        mhagen.load(path)
    (path / "kernel.so").unlink()
    with pytest.raises(mhagen.ArtifactError, match="kernel.so is missing"):
        mhagen.load(path)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(version=99), "format version 99"),
    (lambda m: m["target"].update(arch="aarch64", name="arm-neon"), "aarch64 code"),
    (lambda m: m["target"].update(features=["avx512f", "made-up-feature"]), "lacks"),
    (lambda m: m.pop("graph"), "lacks"),
    (lambda m: m["program"]["buffers"][0]["shape"].__setitem__(0, 2.5), "malformed.*2.5"),
    (lambda m: m["program"]["buffers"][0].update(dtype="float64"), "malformed.*float64"),
    (lambda m: m["program"]["kernels"][0]["args"].__setitem__(0, "nowhere"),
     "malformed.*among the buffers"),
    (lambda m: m["program"]["kernels"][0].update(name="not_in_kernel_so"),
     "malformed.*not_in_kernel_so"),
    (lambda m: m["target"].update(features=[1]), "malformed.*TypeError"),
    (lambda m: m["weights"][0].update(shape=[3]), "cannot be unpacked|give weight .* back"),
    (lambda m: m["params"][0].update(nbytes=None), "does not hold param"),
    (lambda m: next(n for n in m["graph"]["nodes"] if n["kind"] == "head_projection")[
        "attrs"].update(head=-1), "invalid graph.*head must be an int >= 0"),
    # found by editing manifests at random: the weight table and the graph disagreeing
    # came out as bind()'s InputError, which asks the caller for other weights
    (lambda m: m["weights"][0].update(name="w_zz"), "give weight 'w_zz' back"),
    # and the program's buffers not holding the manifest's shapes, or a symbolic axis of
    # no known kind, which the first call met as numpy's ValueError or a KeyError
    (lambda m: m["program"]["buffers"][0]["shape"].__setitem__(-1, 3),
     "input and output buffers do not hold the manifest's shapes"),
    (lambda m: m["program"]["buffers"][0].update(symbolic={"0": -1}), "malformed.*symbolic"),
    (lambda m: m["shapes"].update(seq_len=m["shapes"]["seq_len"] + 1),
     "input and output buffers do not hold the manifest's shapes"),
], ids=["newer-format", "other-arch", "missing-cpu-feature", "no-graph", "shape-not-int",
        "buffer-dtype", "kernel-arg-unknown", "kernel-not-in-library", "feature-not-a-name",
        "weight-shape", "param-size", "graph-invalid", "weight-table-vs-graph",
        "x-buffer-size", "symbolic-axis", "seq-len-vs-input"])
def test_load_rejects_bad_manifest(small, tmp_path, edit, match):
    """Manifests that are consistent (content hash recomputed) but describe what this mhagen
    or this machine cannot run, or what no build writes: an ArtifactError, never another
    exception."""
    path, manifest = _saved(small, tmp_path)
    edit(manifest)
    manifest["content_hash"] = content_hash(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(mhagen.ArtifactError, match=match):
        mhagen.load(path)


@pytest.mark.parametrize("edit", ["temp-shape", "one-argument-less"])
def test_a_program_that_does_not_match_its_kernels_fails_its_first_call_clearly(small,
                                                                                tmp_path,
                                                                                edit):
    """TVM's kernels check every argument: a manifest describing a temp buffer of another
    (valid) shape, or a kernel call with an argument less (found by editing manifests at
    random: TVM's TypeError came through), loads, and its first call says what does not
    match."""
    path, manifest = _saved(small, tmp_path)
    temp = next(b for b in manifest["program"]["buffers"] if b["role"] == "temp")
    if edit == "temp-shape":
        temp["shape"] = temp["shape"][:-1]
        match = f"refused its arguments.*{temp['name']}"
    else:
        kernel = manifest["program"]["kernels"][0]
        kernel["args"] = kernel["args"][:-1]
        match = f"kernel {kernel['name']} refused its arguments.*Expected"
    manifest["content_hash"] = content_hash(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    module = mhagen.load(path)
    with pytest.raises(mhagen.ArtifactError,
                       match=f"{match}.*does not match its compiled kernels"):
        module(small[2])


def test_load_missing_and_garbage(tmp_path):
    with pytest.raises(mhagen.ArtifactError, match="manifest.json is missing"):
        mhagen.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(mhagen.ArtifactError, match="corrupt"):
        mhagen.load(tmp_path)


def test_target_preset_uses_host_avx512():
    from mhagen.target import resolve
    t = resolve("x86")
    assert t.tvm_target_dict()["mcpu"] not in ("generic", "host")
    assert t.cores >= 1 and t.tvm_target_dict()["num-cores"] == t.cores
    expected_bits = 512 if "avx512f" in t.features else 256
    assert t.vector_bits == expected_bits


def test_loaded_module_saves_again(small, tmp_path):
    layer, w, x, module = small
    loaded = mhagen.load(module.save(tmp_path / "a"))
    again = mhagen.load(loaded.save(tmp_path / "b"))
    np.testing.assert_array_equal(again(x), module(x))


def test_aligned_input_is_read_in_place_and_outputs_never_alias(small):
    layer, w, x, module = small
    xa = mhagen.aligned_empty(x.shape)
    xa[...] = x
    assert xa.ctypes.data % 64 == 0
    misaligned = np.empty(x.size + 1, np.float32)[1:].reshape(x.shape)   # 4 bytes off
    misaligned[...] = x
    readonly = x.copy()
    readonly.flags.writeable = False
    want = layer.reference(x, w)
    y1 = module(xa)           # zero-copy input
    y2 = module(misaligned)   # copied input
    y3 = module(readonly)
    assert_close(y1, want)
    assert_close(y2, want)
    assert_close(y3, want)
    # every result the caller holds is its own memory ...
    assert not np.shares_memory(y1, y2) and not np.shares_memory(y2, y3)
    np.testing.assert_array_equal(y1, y2)
    # ... and memory is reused only when the caller says so (out=), with the right answer
    addr = y3.ctypes.data
    y4 = module(-xa, out=y3)
    assert y4 is y3 and y4.ctypes.data == addr
    assert_close(y4, layer.reference(-x, w))
    np.testing.assert_array_equal(y1, module(x))


def test_smt_siblings_count_as_one_core(tmp_path, monkeypatch):
    """One TVM thread per physical core: CPUs whose thread_siblings_list is the same are one
    core; an affinity mask of one sibling per core keeps every core; without sysfs
    topology every usable CPU counts."""
    from mhagen import host
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4-5", 5: "4-5"}.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(siblings + "\n")
    cases = {(0, 1, 2, 3, 4, 5): 3, (0, 1): 2, (0, 2): 1, (1, 3, 5): 2, (6, 7): 2}
    for cpus, cores in cases.items():     # cpu6/7: no topology files
        monkeypatch.setattr(host, "usable_cpus", lambda cpus=cpus: list(cpus))
        assert host.host_cores(str(tmp_path)) == cores, cpus
