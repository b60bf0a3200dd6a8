"""The command line's options (issue 60): --version, each command's help shows only its
options, the target presets listed, build --weights/--records/--out checked before building
and the save flags forwarded, inspect DIR refusing layer options, one-line errors for a
manifest of wrong JSON types, tune's seed and its dependencies (the `tune` extra);
--kv-block-size (a paged decoding build checked and timed on a shuffled pool, tuned with
--packed)."""
import json
import re
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

import mhagen
from mhagen.cli import _records, _save_options, main, parser
from mhagen.module import Module
from mhagen.targets import preset_names
from mhagen.extras import TuningDependencyError


def run(*args, code=""):
    """The CLI in a subprocess (`code`: Python run first, e.g. to hide a package)."""
    script = f"import sys\n{code}\nfrom mhagen.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def one_line_error(capsys, command, *args):
    """main([command, *args]) fails with status 2 and one line on stderr; that line."""
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main([command, *map(str, args)]))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith(f"mhagen {command}: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_version_names_mhagen_and_tvm():
    r = subprocess.run([sys.executable, "-m", "mhagen", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == (f"mhagen {mhagen.__version__} (TVM "
                                f"{metadata.version('apache-tvm')}, tvm-ffi "
                                f"{metadata.version('apache-tvm-ffi')})")


def help_options(capsys, command) -> set:
    """The options `mhagen COMMAND --help` lists."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    return set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", text, re.M))


LAYER = {"--graph", "--d-model", "--heads", "--head-dim", "--kv-heads", "--causal",
         "--no-bias", "--scale", "--dtype", "--kv-cache", "--cache-dtype", "--cross", "--kv-dim"}
SHAPE = {"--target", "--batch", "--seq-len", "--max-seq-len", "--kv-seq-len", "--no-fuse",
         "--kv-block-size"}
OWN_OPTIONS = {
    "build": LAYER | SHAPE | {"--help", "--seed", "--weights", "--records", "--out",
                              "--no-c-api", "--self-contained", "--repeat"},
    "run": {"--help", "--inputs", "--outputs", "--repeat"},
    "inspect": LAYER | SHAPE | {"--help", "--what"},
    "bench": LAYER | SHAPE | {"--help", "--seed", "--records", "--threads", "--repeat"},
    "tune": LAYER | {"--help", "--target", "--shapes", "--trials", "--time-budget", "--db",
                     "--work-dir", "--rpc-tracker", "--device-key", "--kernels", "--no-fuse",
                     "--seed", "--packed", "--kv-block-size"},
    "export-onnx": LAYER | {"--help", "--out", "--form", "--weights", "--seed", "--batch",
                            "--seq-len", "--dynamic-batch", "--kv-seq-len", "--dynamic-seq",
                            "--opset", "--masks", "--external-data", "--check"},
    "import-onnx": {"--help", "--seq-len", "--batch", "--sample-input", "--out", "--show"},
}


@pytest.mark.parametrize("command", sorted(OWN_OPTIONS))
def test_each_command_help_lists_its_own_options_only(command, capsys):
    """inspect builds nothing timed or saved (no --seed, --out, --repeat, --weights); run
    takes files, not layer options; every option says what it does."""
    assert help_options(capsys, command) == OWN_OPTIONS[command]
    sub = parser().commands[command]
    undocumented = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
    assert not undocumented


def test_help_lists_the_target_presets(capsys):
    assert set(parser().commands) == set(OWN_OPTIONS)
    for command in ("build", "inspect", "bench", "tune"):
        main_help = parser().commands[command].format_help()
        text = " ".join(main_help.split())
        assert all(name in text for name in preset_names()), (command, text)


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the command gets as far as compiling."""
    def refuse(*args, **kwargs):
        raise AssertionError("built before refusing")
    monkeypatch.setattr(mhagen, "build", refuse)


def _weights(d, name="w.npz", **change):
    w = mhagen.mha(64, 2).init_weights(0)
    w.update(change)
    return mhagen.save_weights(d / name, {k: v for k, v in w.items() if v is not None})


@pytest.mark.parametrize("args,fragment", [
    (lambda d: ["--out", (d / "f").write_text("x") and d / "f"], "is a file: give a directory"),
    (lambda d: ["--out", (d / "f").write_text("x") and d / "f" / "m"], "is under"),
    (lambda d: ["--records", d / "nope.json"],
     "no tuning database there; write one with mhagen tune --db"),
    (lambda d: ["--weights", d / "nope.npz"], "no weights file at"),
    (lambda d: ["--weights", _weights(d, w_q=None)], "missing ['w_q']"),
    (lambda d: ["--weights", _weights(d, "w.safetensors", b_k=None)], "missing ['b_k']"),
    (lambda d: ["--weights", _weights(d, extra=np.zeros(2))], "unexpected ['extra']"),
    (lambda d: ["--weights", _weights(d, w_o=np.zeros((64, 32)))],
     "weights['w_o'] has shape (64, 32), expected (64, 64)"),
    (lambda d: ["--no-c-api"], "--no-c-api says how to save the module: give --out DIR too"),
], ids=["out-file", "out-under-file", "records-missing", "weights-missing", "weights-lack",
        "safetensors-lack",
        "weights-extra", "weights-shape", "save-flag-without-out"])
def test_build_refuses_bad_files_before_building(args, fragment, tmp_path, capsys, no_build):
    err = one_line_error(capsys, "build", "--d-model", 64, "--heads", 2, *args(tmp_path))
    assert fragment in err
    assert not (tmp_path / "m").exists()


def test_build_forwards_the_database_and_the_save_flags(tmp_path, capsys, monkeypatch):
    """--records DB is the build's tuning database (an unreadable one: a one-line warning
    naming it, the defaults used); --no-c-api and --self-contained reach Module.save, and
    without them it gets no keywords (its defaults)."""
    built, saved = [], []
    real_build = mhagen.build

    def spy_build(*args, **kwargs):
        built.append(kwargs)
        return real_build(*args, **kwargs)

    def fake_save(self, path, *, c_api=True, self_contained=False, **unknown):
        saved.append(dict(c_api=c_api, self_contained=self_contained, **unknown))
        path.mkdir()
        return path
    monkeypatch.setattr(mhagen, "build", spy_build)
    monkeypatch.setattr(Module, "save", fake_save)
    db = tmp_path / "db.json"
    db.write_text("not json")
    assert main(["build", "--d-model", "64", "--heads", "2", "--seq-len", "8", "--repeat", "1",
                 "--records", str(db), "--out", str(tmp_path / "a"), "--no-c-api",
                 "--self-contained"]) == 0
    out, err = capsys.readouterr()
    assert built[0]["tuning"] == str(db) and f"(tuning database {db})" in out
    warning = err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(
        f"mhagen build: warning: tuning database {db} is unreadable"), err
    assert saved == [{"c_api": False, "self_contained": True}]
    plain = parser().parse_args(["build", "--out", str(tmp_path / "b")])
    assert _save_options(plain) == {} and _records(plain) == {}


def test_inspect_of_a_saved_module_refuses_layer_options(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mhagen, "load", lambda path: pytest.fail("loaded"))
    err = one_line_error(capsys, "inspect", tmp_path, "--d-model", 64, "--causal", "--what",
                         "tir")
    assert "--d-model --causal: inspect" in err and "drop DIR or the options" in err
    assert main(["inspect", "--d-model", "64", "--heads", "2", "--causal"]) == 0
    assert "causal=True" in capsys.readouterr().out


@pytest.mark.parametrize("field,value", [("target", 5), ("files", [1]), ("shapes", "x"),
                                         ("weights", [7]), ("c_api", {"files": 3})])
def test_a_manifest_of_wrong_json_types_is_one_line(field, value, tmp_path, capsys):
    man = {"format": "mhagen-module", "version": 1, "target": {"name": "x86"}, "files": {}}
    man[field] = value
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    err = one_line_error(capsys, "inspect", tmp_path, "--what", "manifest")
    assert f"{tmp_path / 'manifest.json'} is malformed: its fields are not of the types " \
           "mhagen writes" in err


def test_a_manifest_of_wrong_json_types_is_one_line_in_a_process(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"target": 5}))
    r = run("inspect", tmp_path, "--what", "manifest")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is malformed" in r.stderr
    assert "Traceback" not in r.stderr


def test_tune_passes_its_seed(monkeypatch):
    seen = {}

    def capture(layer, target, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(mhagen, "tune", capture)
    assert main(["tune", "--d-model", "32", "--heads", "2", "--seed", "7"]) == 130
    assert seen["seed"] == 7


def test_tuning_without_its_extra_says_how_to_install_it(monkeypatch):
    """xgboost (MetaSchedule's cost model) made unimportable, as on an install without
    mhagen[tune]: the CLI says so in one line, mhagen.tune raises before any work."""
    r = run("tune", "--d-model", 32, "--heads", 2, code="sys.modules['xgboost'] = None")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "tuning needs xgboost (MetaSchedule's cost model), not installed here; install " \
           "the tuning extra: pip install 'mhagen[tune]'" in r.stderr
    monkeypatch.setitem(sys.modules, "xgboost", None)
    with pytest.raises(TuningDependencyError, match=r"pip install 'mhagen\[tune\]'"):
        mhagen.tune(mhagen.mha(32, 2), shapes=[(1, 8)])


PAGED = ["--d-model", "64", "--heads", "4", "--kv-heads", "2", "--causal", "--kv-cache", "64",
         "--batch", "2", "--seq-len", "1", "--kv-block-size", "16", "--repeat", "1"]


@pytest.fixture(scope="module")
def paged_module():
    """The module `mhagen build PAGED` builds (built once for the tests below)."""
    return []


def _reuse_paged_build(monkeypatch, paged_module, built):
    """mhagen.build made once for PAGED's options (and seed 0's weights), reused after."""
    real_build = mhagen.build

    def build(layer, target, **kwargs):
        built.append(kwargs)
        options = {k: v for k, v in kwargs.items() if k != "weights"}
        assert options == dict(batch=2, seq_len=1, kv_block_size=16, fuse=True)
        if not paged_module:
            paged_module.append(real_build(layer, target, **kwargs))
        return paged_module[0]
    monkeypatch.setattr(mhagen, "build", build)


def test_build_and_bench_check_and_time_a_paged_build_on_a_shuffled_pool(
        capsys, monkeypatch, paged_module):
    """--kv-block-size B builds the paged decoding module, checks it against the float64
    reference on a pool whose blocks are handed out shuffled (each sequence's blocks
    scattered) and times it on such a pool, full; bench does the same."""
    from mhagen import PagedKVCache
    built, called, timed = [], [], []
    _reuse_paged_build(monkeypatch, paged_module, built)
    real_call, real_latency = Module.__call__, Module.latency

    def spy_call(self, x, **kwargs):
        called.append(kwargs)
        return real_call(self, x, **kwargs)

    def spy_latency(self, x=None, **kwargs):
        timed.append(kwargs)
        return real_latency(self, x, **kwargs)
    monkeypatch.setattr(Module, "__call__", spy_call)
    monkeypatch.setattr(Module, "latency", spy_latency)
    assert main(["build", *PAGED]) == 0
    out = capsys.readouterr().out
    assert re.search(r"max error vs float64 reference: \S+ \(tolerance \S+\) ok", out), out
    assert "a paged cache of blocks of 16, shuffled" in out
    (call,) = called
    pool, seqs = call["cache"], call["seqs"]
    assert isinstance(pool, PagedKVCache) and pool.block_size == 16 and len(seqs) == 2
    tables = [pool.blocks(s) for s in seqs]
    assert all(len(t) == 2 for t in tables)      # 31 tokens held, then the new one
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), tables   # scattered
    (latency,) = timed
    assert isinstance(latency["cache"], PagedKVCache) and \
        [latency["cache"].lens(s) for s in latency["seqs"]] == [63, 63]    # full
    assert main(["bench", *PAGED, "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +1 +[0-9.]+ +[0-9.]+$", out, re.M), out
    assert len(called) == 2 and isinstance(called[1]["cache"], PagedKVCache)
    assert isinstance(timed[1]["cache"], PagedKVCache)


def test_a_paged_build_whose_answer_is_not_the_pools_fails_its_check(
        capsys, monkeypatch, paged_module):
    """The check compares each row with the reference of its own sequence's blocks: with
    the reference given the rows' sequences swapped, build reports the error and exits 1."""
    from mhagen import PagedKVCache
    _reuse_paged_build(monkeypatch, paged_module, [])
    real = PagedKVCache.to_contiguous
    monkeypatch.setattr(PagedKVCache, "to_contiguous",
                        lambda self, seqs, dtype=None: real(self, seqs[::-1], dtype))
    assert main(["build", *PAGED]) == 1
    out, err = capsys.readouterr()
    assert "FAILED" in out and "outside the tolerance" in err


@pytest.mark.parametrize("args,fragment", [
    (["--kv-block-size", "16"], "--kv-block-size 16 reads a decoding layer's paged K/V cache: "
                                "give --kv-cache N too"),
    (["--kv-cache", "64", "--seq-len", "1", "--kv-block-size", "24"],
     "kv_block_size must be a multiple of 16"),
], ids=["no-cache", "not-16"])
def test_a_paged_build_is_refused_in_one_line(args, fragment, capsys, monkeypatch):
    from mhagen.lower import fused
    monkeypatch.setattr(fused, "lower_fused", lambda *a, **k: pytest.fail("lowered"))
    for command in ("build", "bench"):
        err = one_line_error(capsys, command, "--d-model", 64, "--heads", 2, *args)
        assert fragment in err


def test_tune_passes_the_build_form_and_refuses_it_without_a_cache(monkeypatch, capsys):
    seen = {}

    def capture(layer, target, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(mhagen, "tune", capture)
    assert main(["tune", "--d-model", "32", "--heads", "2", "--kv-cache", "64", "--packed",
                 "--kv-block-size", "32", "--shapes", "4x8"]) == 130
    assert (seen["packed"], seen["kv_block_size"], seen["shapes"]) == (True, 32, [(4, 8)])
    seen.clear()
    assert main(["tune", "--d-model", "32", "--heads", "2", "--kv-cache", "64"]) == 130
    assert "packed" not in seen and "kv_block_size" not in seen
    capsys.readouterr()
    for flags in (["--packed"], ["--kv-block-size", "16"]):
        err = one_line_error(capsys, "tune", "--d-model", 32, "--heads", 2, *flags)
        assert "give --kv-cache N too" in err
