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
    assert man["version"] == MODULE_VERSION == 2
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


def test_format_1_cannot_rebind_weights_and_says_why():
    m = mhagen.load(DATA / "artifact-v1")
    with pytest.raises(mhagen.ArtifactError, match="format 1.*rebuild"):
        m(np.zeros(m.in_shape, np.float32), weights=m.graph.init_weights(3))


def test_an_unknown_format_version_is_refused(saved, tmp_path):
    _, _, _, path = saved
    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    man = json.loads((copy / "manifest.json").read_text())
    man["version"] = 99
    man["content_hash"] = content_hash(man)
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(mhagen.ArtifactError, match="format version 99.*reads versions 1, 2"):
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
    the old layer's kernels, silently (max error 3.56). Each load gets the kernels on disk;
    the modules loaded earlier keep theirs. (No C API: saves 8 s a save.)"""
    from mhagen.artifact.toolchain import Toolchain
    monkeypatch.setattr(Toolchain, "host", staticmethod(lambda cxx=None: "not in this test"))
    x = random_input(mhagen.mha(32, 4), 1, 9)
    layers = [mhagen.mha(32, 4, causal=True), mhagen.mha(32, 4), mhagen.mha(32, 4, kv_heads=1)]
    loaded = []
    for i, layer in enumerate(layers):
        w = layer.init_weights(i)
        mhagen.build(layer, batch=1, seq_len=9, weights=w).save(tmp_path / "m")
        loaded.append((layer, w, mhagen.load(tmp_path / "m"), mhagen.load(tmp_path / "m")))
    for layer, w, first, again in loaded:
        assert_close(first(x), layer.reference(x, w))
        assert_close(again(x), layer.reference(x, w))
