"""`mhagen run` and the command-line path from an ONNX model to a run artifact:
import-onnx --out -> build --graph --weights --out -> run, each a subprocess in which the
tuning packages (xgboost, scipy, tornado) cannot be imported (they are the `tune` extra:
nothing but tuning may need them)."""
import subprocess
import sys
from inspect import signature

import numpy as np
import pytest

import mhagen
from mhagen.cli import main
from mhagen.module import Module
from mhagen.tolerances import assert_close

# a CLI process without the `tune` extra's packages (an import of them fails)
WITHOUT_TUNING = ("import sys\n"
                  "for name in ('xgboost', 'scipy', 'tornado'):\n"
                  "    sys.modules[name] = None\n"
                  "from mhagen.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")
LAYER = dict(d_model=64, num_heads=2, causal=True)
SEQ, SEED = 8, 3
# run needs no C API: left out (a faster save) where this mhagen's Module.save can
NO_C_API = ["--no-c-api"] if "c_api" in signature(Module.save).parameters else []


def cli(*args):
    r = subprocess.run([sys.executable, "-c", WITHOUT_TUNING, *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """(artifact dir, imported graph JSON, imported weights .npz) of a causal layer whose
    weights (seed 3) went through ONNX and back."""
    d = tmp_path_factory.mktemp("cli_run")
    layer = mhagen.mha(**LAYER)
    mhagen.export_onnx(layer, d / "m.onnx", layer.init_weights(SEED), seq_len=SEQ)
    cli("import-onnx", d / "m.onnx", "--seq-len", SEQ, "--out", d / "imported")
    (graph_json,) = (d / "imported").glob("*.json")
    weights = graph_json.with_suffix(".npz")
    r = cli("build", "--graph", graph_json, "--weights", weights, "--seq-len", SEQ,
            "--repeat", 1, "--out", d / "art", *NO_C_API)
    assert f"weights: from {weights}" in r.stdout and ") ok" in r.stdout
    return d / "art", graph_json, weights


def test_onnx_weights_build_into_an_artifact_that_runs_on_a_file(artifact, tmp_path):
    """The weights import-onnx wrote are the ones build --weights compiled in (not random
    ones): run's output on x.npy is the float64 reference of the imported graph with them,
    and they are the exported layer's seed-3 weights."""
    art, graph_json, weights_file = artifact
    graph = mhagen.Graph.from_json(graph_json.read_text())
    with np.load(weights_file) as f:
        weights = {k: f[k] for k in f.files}
    exported = mhagen.mha(**LAYER).init_weights(SEED)
    assert weights.keys() == exported.keys()
    for name, w in exported.items():
        np.testing.assert_array_equal(weights[name], w)
    x = np.random.default_rng(1).standard_normal((1, SEQ, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = cli("run", art, "--inputs", tmp_path / "x.npy", "--outputs", tmp_path / "y.npz",
            "--repeat", 2)
    assert f"y {(1, SEQ, 64)} float32" in r.stdout
    latency = [line for line in r.stdout.splitlines() if line.startswith("median latency:")]
    assert len(latency) == 1 and float(latency[0].split()[2]) > 0, r.stdout
    with np.load(tmp_path / "y.npz") as f:
        assert f.files == ["y"]
        assert_close(f["y"], graph.reference(x, weights))


@pytest.mark.parametrize("make,args,fragment", [
    (None, [], "give the input: --inputs x.npy"),
    (lambda d: d / "none.npy", [], "none.npy: no such file"),
    (lambda d: (d / "t.npy").write_text("text") and d / "t.npy", [],
     "is not a .npy or .npz file numpy can read"),
    (lambda d: _npz(d, x=np.zeros((1, SEQ, 64), np.float32),
                    context=np.zeros((1, 4, 64), np.float32)), [],
     "holds arrays this module takes none of: context (it is not a cross-attention layer)"),
    (lambda d: _npz(d, k_cache=np.zeros(1, np.float32)), [], "it takes x"),
    (lambda d: _npz(d, y=np.zeros(1, np.float32)), [], "takes none of: y; it takes x"),
    (lambda d: _npz(d), [], "lacks x: this module takes a .npy of x, or a .npz with an array x"),
    (lambda d: _npy(d, np.zeros((1, SEQ, 32), np.float32)), [], "x has shape"),
    (lambda d: _npy(d, np.zeros((1, SEQ, 64), np.float32)), ["--outputs", "y.npy"],
     "give a file path ending in .npz"),
    (lambda d: _npy(d, np.zeros((1, SEQ, 64), np.float32)), ["--repeat", "0"],
     "--repeat must be >= 1"),
], ids=["no-inputs", "missing-file", "not-numpy", "context-for-self-attention",
        "cache-for-a-plain-layer", "unknown-name", "no-x", "wrong-width", "outputs-not-npz",
        "repeat"])
def test_run_refuses_bad_inputs_in_one_line(artifact, tmp_path, capsys, make, args,
                                            fragment):
    art = artifact[0]
    inputs = ["--inputs", str(make(tmp_path))] if make else []
    assert main(["run", str(art), *inputs, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhagen run: error: ") and fragment in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "y.npy").exists()


def test_run_of_a_directory_that_is_no_artifact_says_so(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((1, SEQ, 64), np.float32))
    assert main(["run", str(tmp_path), "--inputs", str(tmp_path / "x.npy")]) == 2
    assert "is not a saved mhagen module: manifest.json is missing" in capsys.readouterr().err


def _npy(d, x):
    np.save(d / "x.npy", x)
    return d / "x.npy"


def _npz(d, **arrays):
    np.savez(d / "in.npz", **arrays)
    return d / "in.npz"


@pytest.fixture
def loaded(monkeypatch):
    """main(['run', ...]) on a module built here (a saved one loads into the same Module)."""
    def use(module):
        monkeypatch.setattr(mhagen, "load", lambda path: module)
    return use


def test_run_feeds_a_cross_attention_layer_its_context(loaded, tmp_path, capsys):
    layer = mhagen.mha(64, 2, cross=True, kv_dim=40)
    w = layer.init_weights(0)
    loaded(mhagen.build(layer, batch=1, seq_len=SEQ, kv_seq_len=5, weights=w))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, SEQ, 64)).astype(np.float32)
    context = rng.standard_normal((1, 5, 40)).astype(np.float32)
    assert main(["run", "art", "--inputs", str(_npy(tmp_path, x))]) == 2
    assert "lacks context: this module takes a .npz with arrays x, context" in \
        capsys.readouterr().err
    assert main(["run", "art", "--inputs", str(_npz(tmp_path, x=x, context=context)),
                 "--outputs", str(tmp_path / "y.npz"), "--repeat", "1"]) == 0
    with np.load(tmp_path / "y.npz") as f:
        assert_close(f["y"], layer.reference(x, w, context=context))


def test_run_steps_a_decoding_layer_on_the_cache_it_is_given(loaded, tmp_path, capsys):
    """A decoding layer takes its cache as k_cache, v_cache, cache_lens (all or none: an
    empty cache); --outputs holds the cache after the step, ready for the next run."""
    layer = mhagen.mha(64, 2, kv_heads=1, causal=True, kv_cache=16)
    w = layer.init_weights(0)
    module = mhagen.build(layer, batch=1, seq_len=2, weights=w)
    loaded(module)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 64)).astype(np.float32)
    cache = module.new_cache()
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    cache.lens[...] = 5
    expected_cache = cache.copy()
    expected = layer.reference(x, w, cache=expected_cache)
    inputs = _npz(tmp_path, x=x, k_cache=cache.k, v_cache=cache.v, cache_lens=cache.lens)
    assert main(["run", "art", "--inputs", str(inputs), "--outputs", str(tmp_path / "y.npz"),
                 "--repeat", "1"]) == 0
    assert "cache now holds [7] tokens per row" in capsys.readouterr().out
    with np.load(tmp_path / "y.npz") as f:
        assert_close(f["y"], expected)
        assert f["cache_lens"].tolist() == [7]
        assert_close(f["k_cache"][:, :, :7], expected_cache.k[:, :, :7])
        np.testing.assert_array_equal(f["v_cache"][:, :, :5], cache.v[:, :, :5])

    assert main(["run", "art", "--inputs", str(_npy(tmp_path, x)), "--repeat", "1"]) == 0
    assert "cache now holds [2] tokens per row" in capsys.readouterr().out   # an empty cache
    assert main(["run", "art", "--inputs", str(_npz(tmp_path, x=x, k_cache=cache.k))]) == 2
    assert "holds k_cache but not v_cache, cache_lens" in capsys.readouterr().err
    assert main(["run", "art", "--inputs", str(_npz(
        tmp_path, x=x, k_cache=cache.k.astype(np.float64), v_cache=cache.v,
        cache_lens=cache.lens))]) == 2
    assert "k_cache is float64; this module's cache holds float32" in capsys.readouterr().err
    full = np.full(1, 15, np.int32)
    assert main(["run", "art", "--inputs", str(_npz(tmp_path, x=x, k_cache=cache.k,
                                                    v_cache=cache.v, cache_lens=full))]) == 2
    assert "2 new ones need lens <= 14" in capsys.readouterr().err


class CallOnly:
    """A module as a CUDA artifact loads: called with x (and kv_lens), no kernel timer."""

    def __init__(self, graph):
        self.graph, self.batch = graph, 1

    def __call__(self, x, *, kv_lens=None):
        return np.ones_like(x)

    def __repr__(self):
        return "<call-only module>"


def test_run_of_a_module_that_takes_fewer_arguments_or_has_no_timer(loaded, tmp_path,
                                                                     capsys):
    x = np.zeros((1, SEQ, 64), np.float32)
    loaded(CallOnly(mhagen.mha(64, 2, cross=True)))
    assert main(["run", "art", "--inputs", str(_npz(tmp_path, x=x, context=x))]) == 2
    assert "art takes no context from Python: run it through its C API" in \
        capsys.readouterr().err
    loaded(CallOnly(mhagen.mha(64, 2)))
    assert main(["run", "art", "--inputs", str(_npy(tmp_path, x)), "--outputs",
                 str(tmp_path / "y.npz")]) == 0
    assert "latency: not measured (this module has no kernel timer)" in capsys.readouterr().out
    with np.load(tmp_path / "y.npz") as f:
        np.testing.assert_array_equal(f["y"], np.ones_like(x))
