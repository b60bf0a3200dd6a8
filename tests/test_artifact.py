"""Saved artifacts: self-describing (load needs manifest, kernel.so and params only), format
versions, output buffers given by the caller (out=)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_input

import mhagen
from mhagen.artifact.manifest import MODULE_VERSION, READABLE_VERSIONS, content_hash
from mhagen.tolerances import assert_close

DATA = Path(__file__).parent / "data"
COMPILER = ("tvm", "mhagen.lower", "mhagen.schedules", "mhagen.tuning", "mhagen.compile")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A causal grouped-K/V layer at awkward sizes (seq 19, head_dim 12), saved."""
    layer = mhagen.mha(48, 4, kv_heads=2, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86-avx2", batch=2, seq_len=19, weights=w)
    path = m.save(tmp_path_factory.mktemp("artifact") / "m")
    return layer, w, m, path


def test_load_runs_with_the_compiler_unimportable(saved):
    """In a fresh process where TVM's Python package and mhagen's lowering, schedules,
    passes and tuning cannot be imported, load and run an artifact (also with other
    weights, repacked by the manifest's recipes) and save it again."""
    layer, w, m, path = saved
    x = random_input(layer, 2, 19)
    other = layer.init_weights(5)
    np.savez(path.parent / "io.npz", x=x, y=layer.reference(x, w),
             y_other=layer.reference(x, other), **{f"w_{k}": v for k, v in other.items()})
    script = f"""
import sys
for name in {COMPILER!r}:
    sys.modules[name] = None          # import raises ImportError
import numpy as np
import mhagen
from mhagen.tolerances import assert_close
io = np.load({str(path.parent / 'io.npz')!r})
m = mhagen.load({str(path)!r})
assert_close(m(io["x"]), io["y"])
other = {{k[2:]: io[k] for k in io.files if k.startswith("w_")}}
assert_close(m(io["x"], weights=other), io["y_other"])
m.save({str(path.parent / 'resaved')!r})
assert_close(mhagen.load({str(path.parent / 'resaved')!r})(io["x"]), io["y"])
loaded = sorted(n for n, mod in sys.modules.items() if mod is not None
                and any(n == c or n.startswith(c + ".") for c in {COMPILER!r}))
print("compiler modules imported:", loaded)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiler modules imported: []" in r.stdout


def test_the_manifest_describes_kernels_and_param_recipes(saved):
    _, _, m, path = saved
    man = json.loads((path / "manifest.json").read_text())
    assert man["version"] == MODULE_VERSION == 3
    prog = man["program"]
    assert [k["name"] for k in prog["kernels"]] == ["qkv_projection", "attention",
                                                     "output_projection"]
    params = {b["name"]: b for b in prog["buffers"] if b["role"] == "param"}
    assert params["w_qkv"]["pack"]["kind"] == "panels"
    assert params["blocks"]["pack"] == {"kind": "constant"}
    assert man["target"]["family"] == "cpu-x86" and man["target"]["device"] == "cpu"


def test_recipes_repack_exactly_what_the_build_packed(saved):
    layer, w, m, path = saved
    loaded = mhagen.load(path)
    other = layer.init_weights(7)
    built = mhagen.build(layer, "x86-avx2", batch=2, seq_len=19, weights=other)
    loaded.bind(other)
    for name, arr in built.bound_params.items():
        assert np.array_equal(loaded.bound_params[name], arr), name


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_artifacts_of_every_format_version_load(version):
    """tests/data keeps one small artifact per format version (d_model 32, 2 heads, seq 8,
    x86-avx2, made by the mhagen of that version) with an input and its output then."""
    path = DATA / f"artifact-v{version}"
    io = np.load(DATA / f"artifact-v{version}-io.npz")
    m = mhagen.load(path)
    assert json.loads((path / "manifest.json").read_text())["version"] == version
    y = m(io["x"])
    assert np.array_equal(y, io["y"]), "the same kernels give the same bits"
    assert_close(y, m.graph.reference(io["x"], m.weights))


def test_a_format_1_artifact_is_refused_and_says_to_save_it_again():
    """Format 1 (program buffers without param recipes) is no longer read."""
    with pytest.raises(mhagen.ArtifactError, match="format version 1 .*save it again"):
        mhagen.load(DATA / "artifact-v1")


def test_an_unknown_format_version_is_refused(saved, tmp_path):
    _, _, _, path = saved
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    man = json.loads((copy / "manifest.json").read_text())
    man["version"] = 99
    man["content_hash"] = content_hash(man)
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(mhagen.ArtifactError, match="format version 99.*reads versions 2, 3"):
        mhagen.load(copy)


def test_out_argument_receives_the_result(saved):
    layer, w, m, _ = saved
    x = random_input(layer, 2, 19, seed=3)
    expected = m(x)
    out = mhagen.aligned_empty(m.out_shape)
    assert m(x, out=out) is out
    assert np.array_equal(out, expected)
    unaligned = np.empty(np.prod(m.out_shape) + 1, np.float32)[1:].reshape(m.out_shape)
    assert m(x, out=unaligned) is unaligned and np.array_equal(unaligned, expected)
    with pytest.raises(mhagen.InputError, match="out= must be a float32 numpy array"):
        m(x, out=np.empty(m.out_shape, np.float64))


def test_each_call_returns_its_own_array(saved):
    """No buffer reuse behind the caller's back: results of earlier calls stay intact."""
    layer, _, m, _ = saved
    x1, x2 = random_input(layer, 2, 19, seed=1), random_input(layer, 2, 19, seed=2)
    y1 = m(x1)
    kept = y1.copy()
    y2 = m(x2)
    assert np.array_equal(y1, kept) and not np.shares_memory(y1, y2)


def test_a_module_saved_again_to_its_directory_loads_its_new_kernels(tmp_path, monkeypatch):
    """dlopen returns the library already loaded under a name: a module saved again to the
    same directory and loaded again in the same process (a notebook rebuilding a layer) ran
    the modules loaded earlier keep theirs. (No C API: not what this test is about.)"""
    x = random_input(mhagen.mha(32, 4), 1, 9)
    layers = [mhagen.mha(32, 4, causal=True), mhagen.mha(32, 4), mhagen.mha(32, 4, kv_heads=1)]
    loaded = []
    for i, layer in enumerate(layers):
        w = layer.init_weights(i)
        mhagen.build(layer, batch=1, seq_len=9, weights=w).save(tmp_path / "m", c_api=False)
        loaded.append((layer, w, mhagen.load(tmp_path / "m"), mhagen.load(tmp_path / "m")))
    for layer, w, first, again in loaded:
        assert_close(first(x), layer.reference(x, w))
        assert_close(again(x), layer.reference(x, w))


# -- lean, fast saves ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    layer = mhagen.mha(64, 2)
    w = layer.init_weights(0)
    return layer, w, mhagen.build(layer, "x86", batch=1, seq_len=8, weights=w)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_second_save_takes_the_c_api_from_the_cache(tiny, tmp_path, monkeypatch):
    """The C API is compiled once per (sources, compiler, flags, TVM runtime): a second save
    of the module copies libmha.so and lib/libmha_impl.so from mhagen's cache, the compiler
    not run (a wrapper logs its calls), in well under the seconds a compile takes."""
    import time
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MHAGEN_CACHE", str(tmp_path / "cache"))
    _, _, m = tiny
    first = m.save(tmp_path / "a")
    def runtime_compiles():   # (TVM links kernel.so with $CXX too)
        return [line for line in log.read_text().splitlines() if "mha_runtime.cc" in line]
    compiles = runtime_compiles()
    assert len(compiles) == 2
    start = time.perf_counter()
    second = m.save(tmp_path / "b")
    seconds = time.perf_counter() - start
    assert runtime_compiles() == compiles, "the second save compiled the C API"
    manifests = [json.loads((d / "manifest.json").read_text())["c_api"] for d in (first, second)]
    assert [c["cached"] for c in manifests] == [False, True]
    assert manifests[0]["cache_key"] == manifests[1]["cache_key"]
    assert (tmp_path / "cache" / "capi" / manifests[0]["cache_key"] / "libmha.so").is_file()
    for name in ("libmha.so", "lib/libmha_impl.so", "mha_libraries.h"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert seconds < 5, f"a cached save took {seconds:.1f} s"
    # TVM's runtime: one shared copy in the cache that both artifacts link to
    for name in ("libtvm_ffi.so", "libtvm_runtime.so"):
        links = {(d / "lib" / name).resolve() for d in (first, second)}
        assert len(links) == 1 and (tmp_path / "cache").resolve() in next(iter(links)).parents


def test_save_without_c_api_writes_none_of_it(tiny, tmp_path):
    layer, w, m = tiny
    d = m.save(tmp_path / "m", c_api=False)
    names = {p.name for p in d.iterdir()}
    assert not names & {"mha.h", "libmha.so", "mha_config.h", "mha_runtime.cc", "lib"}
    assert "c_api=False" in json.loads((d / "manifest.json").read_text())["c_api"]["skipped"]
    x = random_input(layer, 1, 8)
    assert np.array_equal(mhagen.load(d)(x), m(x))


def test_a_save_onto_a_file_is_refused_before_anything_is_written(tiny, tmp_path):
    _, _, m = tiny
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    with pytest.raises(mhagen.ArtifactError, match="is a file, not a directory"):
        m.save(target)
    with pytest.raises(mhagen.ArtifactError, match="a part of that path is a file"):
        m.save(target / "m")
    assert target.read_bytes() == b"keep me" and sorted(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weights_file_is_safetensors_and_holds_the_weights_once(tmp_path, dtype):
    """weights.safetensors holds the kernels' params (what both loaders run), read back by the
    safetensors package; the weights in the layer's layout are unpacked from them bit for bit,
    not stored a second time."""
    from safetensors.numpy import load_file
    layer = mhagen.mha(32, 2, kv_heads=1, dtype=dtype)
    w = layer.init_weights(1)
    m = mhagen.build(layer, "x86", batch=1, seq_len=8, weights=w)
    d = m.save(tmp_path / "m", c_api=False)
    assert not (d / "weights.bin").exists() and not (d / "params.bin").exists()
    theirs = load_file(str(d / "weights.safetensors"))
    assert sorted(theirs) == sorted(m.bound_params)
    for name, p in m.bound_params.items():
        assert np.array_equal(theirs[name], p), name
    man = json.loads((d / "manifest.json").read_text())
    assert {e["from"] for e in man["weights"]} == {"params"}
    loaded = mhagen.load(d)
    for name, arr in m.weights.items():
        got = loaded.weights[name]
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes(), name
    x = random_input(layer, 1, 8)
    assert np.array_equal(loaded(x), m(x))


def test_a_weight_the_params_cannot_give_back_is_stored(tmp_path):
    from mhagen.artifact.files import read_params_file, write_params_file
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(3)
    buffers = [{"name": "p", "role": "param", "pack": {"kind": "panels", "depth": 4,
                "width": 8, "panel": 4, "columns": [{"weight": "a", "at": 1}]}}]
    from mhagen.params import pack_param
    params = {"p": pack_param(buffers[0]["pack"], {"a": a})}
    ptable, wtable = write_params_file(tmp_path / "w.safetensors", buffers, params,
                                       {"a": a, "b": b})
    assert [e["from"] for e in wtable] == ["params", "weight:b"]
    weights, back = read_params_file(tmp_path / "w.safetensors", buffers, ptable, wtable)
    assert np.array_equal(back["p"], params["p"]) and np.array_equal(weights["a"], a)
    assert weights["b"].dtype == np.float64 and np.array_equal(weights["b"], b)
