"""The command line: build, inspect, --help, and one-line errors with exit code 2."""
import subprocess
import sys

import pytest

from mhagen.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "mhagen", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args", [[], ["build"], ["run"], ["inspect"]],
                         ids=["top", "build", "run", "inspect"])
def test_help(args):
    r = run(*args, "--help")
    assert r.returncode == 0 and "usage: mhagen" in r.stdout


@pytest.mark.parametrize("args,fragment", [
    (["build", "--d-model", "500"], "not divisible by num_heads=8"),
    (["build", "--heads", "8", "--kv-heads", "3"], "kv_heads=3 does not divide"),
    (["build", "--target", "sparc"], "unknown target 'sparc'"),
    (["build", "--seq-len", "zero"], "invalid int value"),
    (["build", "--bogus"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
    (["inspect", "/nonexistent/dir"], "manifest.json is missing"),
    (["inspect", "--what", "everything"], "--what must be one of"),
    (["tune", "--shapes", "1x128x4"], "--shapes takes BATCHxSEQ like 1x128, not '1x128x4'"),
    (["tune", "--shapes", "0x128"], "batch and seq must be >= 1"),
    (["tune", "--trials", "0"], "--trials must be >= 1"),
    (["tune", "--rpc-tracker", "host:9190"], "--rpc-tracker and --device-key go together"),
    (["tune", "--rpc-tracker", "host", "--device-key", "k"], "takes HOST:PORT, not 'host'"),
], ids=["d_model", "kv_heads", "target", "int", "unknown-flag", "command", "no-module", "what",
        "tune-shape", "tune-shape-zero", "tune-trials", "tune-rpc-alone", "tune-rpc-port"])
def test_bad_options_one_line_exit_2(args, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        code = main(args)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1, err


def test_build_reports_and_saves_then_inspect(tmp_path):
    out = tmp_path / "mod"
    r = run("build", "--d-model", "64", "--heads", "4", "--causal", "--seq-len", "17",
            "--batch", "2", "--out", str(out), "--repeat", "2")
    assert r.returncode == 0, r.stderr
    assert "max error vs float64 reference" in r.stdout and " ok" in r.stdout
    assert "median latency" in r.stdout and (out / "manifest.json").is_file()
    r = run("inspect", str(out), "--what", "tir")
    assert r.returncode == 0 and "T.prim_func" in r.stdout
    r = run("inspect", "--d-model", "64", "--heads", "4", "--what", "graph")
    assert r.returncode == 0 and "output_projection" in r.stdout


def test_bench_prints_a_row_per_thread_count():
    r = run("bench", "--d-model", "64", "--heads", "4", "--seq-len", "16", "--threads", "1",
            "--repeat", "2")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("1 ")]
    assert len(rows) == 1 and float(rows[0][1]) > 0 and float(rows[0][2]) > 0
    assert "fused" in r.stdout and "max error" in r.stdout


def test_bench_rejects_too_many_threads(capsys):
    assert main(["bench", "--d-model", "32", "--heads", "2", "--seq-len", "8",
                 "--threads", "999"]) == 2
    assert "--threads [999] outside" in capsys.readouterr().err


def test_build_without_fusion(tmp_path):
    r = run("build", "--d-model", "32", "--heads", "2", "--seq-len", "9", "--no-fuse",
            "--repeat", "1")
    assert r.returncode == 0 and "not fused" in r.stdout and " ok" in r.stdout


def test_build_and_export_a_decoding_layer(tmp_path, capsys):
    """--kv-cache: build checks a step on a half-full random cache and times a full one;
    export-onnx --form fused --check runs the past/present model in onnxruntime."""
    assert main(["build", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--causal",
                 "--kv-cache", "48", "--seq-len", "1", "--repeat", "1",
                 "--out", str(tmp_path / "step")]) == 0
    out = capsys.readouterr().out
    assert "kv_cache=48" in out and " ok" in out and "on a full cache of 48" in out
    assert (tmp_path / "step" / "mha.h").read_text().count("#define MHA_KV_CACHE 48") == 1
    assert main(["export-onnx", "--d-model", "64", "--heads", "4", "--causal", "--kv-cache",
                 "48", "--seq-len", "2", "--form", "fused", "--out", str(tmp_path / "d.onnx"),
                 "--check"]) == 0
    assert "onnxruntime vs float64 reference" in capsys.readouterr().out
    assert main(["export-onnx", "--kv-cache", "48", "--out", str(tmp_path / "x.onnx")]) == 2
    assert "--form fused" in capsys.readouterr().err


def test_ctrl_c_gives_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C where a command does not handle it itself (tune keeps its records and says
    'interrupted' in its report): one line, exit status 130, no traceback."""
    import mhagen

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(mhagen, "tune", interrupted)
    monkeypatch.setattr(mhagen, "build", interrupted)
    assert main(["tune", "--d-model", "32", "--heads", "2"]) == 130
    assert main(["build", "--d-model", "32", "--heads", "2"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mhagen tune: interrupted", "mhagen build: interrupted"]


@pytest.mark.parametrize("extra,shapes", [([], [(1, 128)]), (["--kv-cache", "64"], [(1, 1)]),
                                          (["--kv-cache", "64", "--shapes", "2x1", "1x4"],
                                           [(2, 1), (1, 4)])])
def test_tune_tunes_decode_steps_of_a_decoding_layer_by_default(monkeypatch, extra, shapes):
    """mhagen tune of a --kv-cache layer tunes a step of one new token unless --shapes says."""
    import mhagen
    seen = {}

    def capture(layer, target, **kwargs):
        seen.update(kwargs, kv_cache=layer.options.get("kv_cache"))
        raise KeyboardInterrupt
    monkeypatch.setattr(mhagen, "tune", capture)
    assert main(["tune", "--d-model", "32", "--heads", "2", *extra]) == 130
    assert seen["shapes"] == shapes
    assert seen["kv_cache"] == (64 if extra else None)
