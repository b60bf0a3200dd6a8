"""benchmarks/bench_mha.py: the weight conversions of every peer (against the float64
reference, causal included), the row oracle of the long case, and a --quick run end to end."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.tolerances import assert_close
from tests.conftest import random_input

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_mha.py"
PEERS = ("numpy", "torch_mha", "torch_sdpa", "ort_mha", "ort_attention")


def load_script(name):
    """A module of benchmarks/ (name.py) loaded from its file; benchmarks/ goes on sys.path
    for the scripts that import their neighbours (class_ratios and bench_decode import
    bench_mha)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_mha")


def _needs(bench, name):
    for mod in bench.REQUIRES[name]:
        pytest.importorskip(mod)


def _case(causal, batch=2, seq=7, d_model=32, heads=4, seed=3):
    layer = mhagen.mha(d_model, heads, causal=causal)
    w = layer.init_weights(seed)
    x = random_input(layer, batch, seq, seed=seed)
    return layer, w, x


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("peer", PEERS)
def test_peer_matches_reference(bench, peer, causal):
    _needs(bench, peer)
    layer, w, x = _case(causal)
    impl = bench.make_impl(peer, layer, w, 2, 7, causal, threads=1)
    y = impl(x)
    assert y.dtype == np.float32
    assert_close(y, layer.reference(x, w))


@pytest.mark.parametrize("peer", PEERS)
def test_peer_causal_is_not_the_unmasked_layer(bench, peer):
    # the causal check above must be able to fail: a peer built without the mask is caught
    _needs(bench, peer)
    layer, w, x = _case(True)
    impl = bench.make_impl(peer, layer, w, 2, 7, False, threads=1)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(impl(x), layer.reference(x, w))


@pytest.mark.parametrize("peer", ("numpy", "ort_mha", "ort_attention"))
def test_wrong_head_layout_is_caught(bench, peer, monkeypatch):
    # the classic slip: [H, D, d] -> [D, H*d] by reshape instead of transpose-then-reshape
    _needs(bench, peer)
    layer, w, x = _case(False)
    monkeypatch.setattr(bench, "_heads_to_columns",
                        lambda a: np.ascontiguousarray(a.reshape(a.shape[1], -1)))
    impl = bench.make_impl(peer, layer, w, 2, 7, False, threads=1)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(impl(x), layer.reference(x, w))


@pytest.mark.parametrize("peer", ("torch_mha", "torch_sdpa"))
def test_untransposed_out_proj_is_caught(bench, peer, monkeypatch):
    # w_o is [H*d, D] and out_proj.weight is [D, H*d]: square here, so only numbers tell
    _needs(bench, peer)
    layer, w, x = _case(False)
    monkeypatch.setattr(bench, "torch_out_proj",
                        lambda w: (np.ascontiguousarray(w["w_o"]), w["b_o"]))
    impl = bench.make_impl(peer, layer, w, 2, 7, False, threads=1)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(impl(x), layer.reference(x, w))


def test_torch_conversion_round_trips_through_mhagen(bench):
    pytest.importorskip("torch")
    layer, w, x = _case(False, d_model=48, heads=6)
    impl = bench.make_impl("torch_mha", layer, w, 2, 7, False, threads=1)
    back = mhagen.weights_from_torch(impl.module)
    assert sorted(back) == sorted(w)
    for name in w:
        np.testing.assert_array_equal(back[name], w[name], err_msg=name)


def test_packed_qkv_is_the_concatenated_heads(bench):
    layer, w, x = _case(False)
    W, b = bench.packed_qkv(w)
    x2 = x.reshape(-1, 32).astype(np.float64)
    got = x2 @ W + b
    heads = w["w_q"].shape[0]
    for i, role in enumerate("qkv"):
        for h in range(heads):
            want = x2 @ w[f"w_{role}"][h] + w[f"b_{role}"][h]
            cols = slice(i * 32 + h * 8, i * 32 + (h + 1) * 8)
            np.testing.assert_allclose(got[:, cols], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_reference_rows_matches_layer_reference(bench, causal):
    layer, w, x = _case(causal, batch=2, seq=19)
    rows = np.array([0, 3, 11, 18])
    got = bench.reference_rows(w, x, rows, causal=causal)
    np.testing.assert_allclose(got, layer.reference(x, w)[:, rows], rtol=1e-12, atol=1e-12)


def test_parse_shape(bench):
    assert bench.parse_shape("1x128x512x8") == (1, 128, 512, 8)
    for bad in ("1x128x512", "1x128x510x8", "0x1x8x8", "axbxcxd"):
        with pytest.raises(Exception):
            bench.parse_shape(bad)


def test_contended_turns_count_against_the_runs_best_probe(bench, monkeypatch):
    """A turn is contended when its probe is under CONTENDED x the best probe of the run,
    the attempt's own probes included; a calibrated probe is a positive GFLOP/s."""
    monkeypatch.setattr(bench, "PROBE_REF", 100.0)
    assert bench.contended_turns({"a": [100.0, 79.0], "b": [81.0, 40.0]}) == 2
    assert bench.contended_turns({"a": [150.0, 100.0]}) == 1   # 100 < 0.8 x 150
    assert bench.PROBE_REF == 150.0
    assert bench.core_probe(calls=2) > 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread pinning here")
def test_probe_at_more_threads_takes_the_slowest_cpu(bench, monkeypatch):
    """At 1 thread the probe runs where the calling thread is; at more it visits every usable
    CPU, the thread pinned there meanwhile and its CPU set restored, and returns the slowest
    (a turn at n threads waits for its slowest core)."""
    before = os.sched_getaffinity(0)
    seen = []
    got = bench._probe_on(min(before), lambda: seen.append(os.sched_getaffinity(0)), 1e9, 2)
    assert got > 0 and seen and all(s == {min(before)} for s in seen)
    assert os.sched_getaffinity(0) == before

    speed = {cpu: 100.0 + cpu for cpu in before}
    speed[max(before)] = 50.0
    visits = []
    monkeypatch.setattr(bench, "_probe_on",
                        lambda cpu, *a: visits.append(cpu) or speed.get(cpu, 70.0))
    monkeypatch.setattr(bench.mhagen.runtime, "set_num_threads", lambda n: None)
    monkeypatch.setattr(bench.mhagen.runtime, "num_threads", lambda: 2)
    assert bench.core_probe() == 50.0 and visits == sorted(before)
    visits.clear()
    monkeypatch.setattr(bench.mhagen.runtime, "num_threads", lambda: 1)
    assert bench.core_probe() == 70.0 and visits == [None]


def test_quick_run_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-memory", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUMMARY threads=1" in proc.stdout
    md = (tmp_path / "results.md").read_text()
    for name in ("mhagen", "mhagen_any_len", "numpy", "torch_mha", "torch_sdpa", "ort_mha",
                 "ort_attention"):
        lines = [ln for ln in md.splitlines() if name in ln]
        assert lines, f"{name} not in results.md"
        listed = "\n".join(lines)
        assert ("missing" in listed) or ("checked" in listed), listed
    data = json.loads((tmp_path / "results.json").read_text())
    mh = [r for r in data["rows"] if r["impl"] == "mhagen"]
    assert mh and all(r["checked"] for r in mh)
    assert all(r.get("median_ms", 0) > 0 for r in mh)
    assert {r["mask"] for r in mh} == {"none", "causal"}
    assert data["sgemm_peak"]["1"]["gflops"] > 0
    # the core probe ran before every turn and its shares are of the run's best
    assert data["sgemm_peak"]["1"]["probe_gflops"] > 0
    assert data["sgemm_peak"]["1"]["probe_share"] > 0   # the probe around the peak
    for r in mh:
        assert len(r["probe_share"]) == len(r["samples_ms"])
        assert all(0 < v <= 1.0 for v in r["probe_share"])
        assert r["contended_rounds"] == sum(v < 0.8 for v in r["probe_share"])
    assert "Core probe" in md and data["meta"]["probe"] in md
    any_len = [r for r in data["rows"] if r["impl"] == "mhagen_any_len"]
    assert any_len and all(r["checked"] for r in any_len)
    assert "any-length module / exact build" in proc.stdout


def test_quick_run_of_the_avx2_class(tmp_path):
    """--target x86-avx2 measures the AVX2 code on any host, peers' BLAS held to AVX2 where
    the host is wider; the CPU class and the host's CPU are in the results. On a wider host
    the same run also times the host's own class (mhagen_host) and measures that class's
    sgemm peak in a child process without the AVX2 settings: both shares of issue 11's
    same-share criterion come from one run."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-memory", "--target", "x86-avx2",
         "--shapes", "1x512x64x2", "--impls", "mhagen", "mhagen_host", "numpy",
         "--wait-quiet", "0",     # (the run above waits; beside another test, 5 s a turn)
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["target"]["cpu_class"] == "x86_64-v256-r16"
    assert data["meta"]["host"]["llvm_cpu"]
    mh = [r for r in data["rows"] if r["impl"] == "mhagen"]
    assert mh and all(r["checked"] for r in mh)
    md = (tmp_path / "results.md").read_text()
    assert "mhagen target **x86-avx2** (class x86_64-v256-r16" in md
    host = [r for r in data["rows"] if r["impl"] == "mhagen_host"]
    peak = data["sgemm_peak"]["1"]
    if "avx512f" in data["meta"]["host"]["simd_features"]:
        assert data["meta"]["env"]["OPENBLAS_CORETYPE"] == "Haswell"
        assert host and all(r["checked"] for r in host)
        assert not any(r["fastest"] for r in host)      # a reference, not a contender
        assert peak["host_gflops"] > 0 and peak["host_numpy_gflops"] > 0
        assert "this host's own class" in md
        shares = data["summary"]["1"]["host_class_peak_share_seq512_nomask"]
        assert set(shares) == {"1x512x64x2"} and shares["1x512x64x2"] > 0
        assert "same run, this host's own class" in data["summary"]["1"]["line"]
    else:   # an AVX2 host: x86-avx2 is its own class, nothing to compare
        assert not host and "host_gflops" not in peak


def test_half_precision_benchmark_quick_run(tmp_path):
    """benchmarks/bench_half.py end to end on a small layer: every dtype checked, then timed."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_half.py"), "--shapes", "1x16x32x2",
         "--threads", "1", "--rounds", "1", "--target", "x86-avx2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"mhagen_float32", "mhagen_float16", "mhagen_bfloat16",
            "mhagen_f32io_float16", "mhagen_f32io_bfloat16"} <= impls
    f32io = [r for r in data["rows"] if r["impl"] == "mhagen_f32io_bfloat16"]
    assert f32io and f32io[0]["dtype"] == "bfloat16"
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in data["rows"])
    assert "converted to float32 on load" in data["meta"]["precision"]["bfloat16"]


def test_score_mods_benchmark_quick_run(tmp_path):
    """benchmarks/bench_score_mods.py on a small causal layer: every modifier (T5's relative
    bias included) checked against the reference for mhagen and the torch peers, then timed."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_score_mods.py"), "--shape",
         "1x40x32x4", "--threads", "1", "--rounds", "1", "--causal", "--peers",
         "torch_sdpa,torch_eager", "--target", "x86-avx2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    timed = {(r["mod"], r["impl"]) for r in data["rows"]}
    for mod in ("alibi", "softcap", "relative_bias"):
        assert {(mod, "mhagen"), (mod, "mhagen_plain"), (mod, "torch_eager")} <= timed
    assert ("relative_bias", "torch_sdpa") in timed     # a float bias mask carries it
    assert not [k for k, v in data["status"].items() if "excluded" in v], data["status"]


def test_class_ratio_scan_quick_run():
    """benchmarks/class_ratios.py on two layers: every kernel of both classes' builds,
    checked against the reference, then a ratio per kernel; on an AVX2-only host (both
    targets the same class) a usage error says so."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "class_ratios.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    if mhagen.target.resolve("x86").cpu_class == mhagen.target.resolve("x86-avx2").cpu_class:
        assert proc.returncode == 2 and "compare two classes it runs" in proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("largest x86-avx2 / x86 (median [quartiles]):")[1].strip()
    table = table.splitlines()
    lines = [line for line in table if line.strip()]
    kernels = {line.split()[-5] for line in lines}
    assert {"qkv_projection", "attention", "output_projection", "cache_append"} <= kernels
    assert all(float(line.split()[0]) > 0 for line in lines)


def test_class_ratios_pair_the_turns(monkeypatch):
    """paired_ratios alternates the two calls, flips the order every round and takes each
    turn's best batch: on a clock that a's calls advance by 2 and b's by 1, except for one
    slowed batch per turn, every ratio is exactly 2."""
    cr = load_script("class_ratios")
    clock, order = [0.0], []

    def call(name, cost):
        def run():
            order.append(name)
            clock[0] += cost * (5 if len(order) % 7 == 0 else 1)   # now and then slowed
        return run
    monkeypatch.setattr(cr, "clock", lambda: clock[0])
    ratios, (a, b) = cr.paired_ratios(call("a", 2e-3), call("b", 1e-3), rounds=6)
    assert len(ratios) == 6 and np.allclose(ratios, 2.0) and np.allclose((a, b), (2e-3, 1e-3))
    # after 2 warm-up calls and 1 timed, turns of 3 batches of 2 calls (~4 ms of a's 2 ms)
    turns = [order[i:i + 6] for i in range(3, len(order), 6)]
    assert all(len(set(t)) == 1 for t in turns) and len(turns) == 12
    assert [t[0] for t in turns] == ["a", "b", "b", "a"] * 3


def test_register_tiles_benchmark_builds_and_reports_each_tile(tmp_path):
    """benchmarks/register_tiles.c compiles warning-free and prints, for each tile this host
    runs, best >= median >= the speed 9 rounds in 10 reach >= worst (GFLOP/s, no timing
    asserted); a bad round count is refused."""
    import re
    import shutil

    from mhagen.host import host_arch, runtime_features
    if host_arch() != "x86_64" or not {"avx2", "fma"} <= set(runtime_features()):
        pytest.skip("register_tiles.c is x86-64 code for AVX2 + FMA hosts")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc on the PATH")
    exe = tmp_path / "register_tiles"
    build = subprocess.run(["gcc", "-O3", "-Wall", "-Wextra", "-Werror", "-mavx2", "-mfma",
                            "-o", str(exe), str(ROOT / "benchmarks" / "register_tiles.c")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), "3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    number = r"\s+([\d.]+)"
    rows = re.findall(r"^(.+?)\s+best" + number + r"\s+median" + number + r"\s+9 in 10 >="
                      + number + r"\s+worst" + number + " GFLOP/s$", run.stdout, re.M)
    have = set(runtime_features())
    expect = (["6 x 16 AVX2", "4 x 24 AVX2"]
              + (["8 x 32 AVX-512", "12 x 32 AVX-512"] if "avx512f" in have else [])
              + (["8 x 32 BF16"] if {"avx512f", "avx512bf16"} <= have else []))
    assert [r[0] for r in rows] == expect, run.stdout
    for name, *rates in rows:
        best, median, ninth, worst = map(float, rates)
        assert best >= median >= ninth >= worst > 0, (name, rates)
    refused = subprocess.run([str(exe), "401"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "usage" in refused.stderr


@pytest.fixture(scope="module")
def runs_table():
    return load_script("runs_table")


def test_performance_runs_table_is_the_one_the_results_give(runs_table):
    """benchmarks/PERFORMANCE.md's table of every committed x86 run is benchmarks/runs_table.py's output from
    the results folders, line for line (rerun the script after committing a run)."""
    table = runs_table.table()
    assert len(table.splitlines()) == 2 + len(list(runs_table.RESULTS.glob("x86_64-*")))
    assert table in (ROOT / "benchmarks" / "PERFORMANCE.md").read_text(), \
        "rerun benchmarks/runs_table.py"


def test_runs_plot_draws_the_newest_run_of_each_class_on_each_cpu(runs_table, tmp_path):
    """PERFORMANCE.md's figure: one series per (class, host CPU), its newest results folder,
    with the ratios of the table's computation; the committed PNG names the folders it drew
    in its text, today's newest ones, and PERFORMANCE.md shows it."""
    every = [runs_table.run_ratios(f) for f in runs_table.RESULTS.glob("x86_64-*")]
    runs = runs_table.latest_runs()
    assert sorted((r["cls"], r["cpu"]) for r in runs) == sorted({(r["cls"], r["cpu"])
                                                                 for r in every})
    for run in runs:
        same = [r["date"] for r in every if (r["cls"], r["cpu"]) == (run["cls"], run["cpu"])]
        assert run["date"] == max(same)
        assert len(run["ratios"]) == 16 and all(0.2 < v < 3 for v in run["ratios"].values())
    from PIL import Image    # (matplotlib's own dependency)
    png = runs_table.plot(tmp_path / "runs.png")
    assert Image.open(png).text["Description"] == runs_table.plotted(runs)
    # the committed figure draws today's folders (rerun runs_table.py --plot after a run)
    committed = Image.open(runs_table.RESULTS / "runs.png")
    assert committed.text.get("Description") == runs_table.plotted(runs), \
        "rerun python benchmarks/runs_table.py --plot"
    assert "](results/runs.png)" in (ROOT / "benchmarks" / "PERFORMANCE.md").read_text()


@pytest.mark.parametrize("script", ["bench_mha.py", "bench_decode.py", "bench_half.py",
                                    "bench_score_mods.py"])
def test_a_benchmark_of_code_this_machine_cannot_run_is_a_usage_error(script):
    """Every benchmark runs its code here: a target that cannot run here (another arch; on
    an AVX2-only CPU, x86-avx512) is refused at the command line, not by a traceback from
    the first call."""
    other = "arm-neon" if mhagen.target.host_arch() == "x86_64" else "x86-avx2"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--target", other],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--target {other}: the benchmark runs the code here, but" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def bench_decode():
    return load_script("bench_decode")


@pytest.mark.parametrize("kv_heads,past", [(4, [20, 20]), (2, [30, 0, 7]), (1, [38, 5])],
                         ids=["full", "gqa-ragged", "mqa-ragged"])
@pytest.mark.parametrize("peer", ["torch_sdpa", "ort_attention", "ort_gqa"])
def test_decode_peer_matches_reference(bench_decode, peer, kv_heads, past):
    """Each decode peer of bench_decode.py against the float64 reference: K/V heads fewer
    than query heads, and rows with their own cached tokens (0 included); a second step
    appends at the same place and answers the same."""
    pytest.importorskip("torch" if peer == "torch_sdpa" else "onnxruntime")
    layer = mhagen.mha(32, 4, kv_heads=kv_heads, kv_cache=40, causal=True)
    w = layer.init_weights(5)
    past = np.array(past, np.int32)
    x = random_input(layer, len(past), 1, seed=6)
    ref = bench_decode.random_cache(mhagen.KVCache.empty(layer, len(past), np.float64))
    ref.lens[...] = past
    expected = layer.reference(x, w, cache=ref)
    step = bench_decode.PEERS[peer](layer, w, len(past), past, threads=1)
    assert_close(step(x), expected)
    assert_close(step(x), expected)
    if len(set(past.tolist())) > 1:     # the rows' lengths change the answer
        ref_long = bench_decode.random_cache(mhagen.KVCache.empty(layer, len(past), np.float64))
        ref_long.lens[...] = past.max()
        assert np.abs(layer.reference(x, w, cache=ref_long) - expected).max() > 1e-3


def test_decode_benchmark_quick_run_of_a_ragged_batch(tmp_path):
    """benchmarks/bench_decode.py end to end: rows of 30, 0 and 7 cached tokens, 2 K/V heads,
    mhagen also with bfloat16 weights and with a bfloat16 cache (--half), reading a paged
    cache (--paged 16, a shuffled pool) and in the packed form (--varlen); every
    implementation checked against its reference
    (none excluded), then timed; a row longer than the cache is a usage error."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    script = str(ROOT / "benchmarks" / "bench_decode.py")
    proc = subprocess.run(
        [sys.executable, script, "--d-model", "32", "--heads", "4", "--kv-heads", "2",
         "--cache", "40", "--lens", "30,0,7", "--threads", "1", "--rounds", "1",
         "--half", "bfloat16,float32:bfloat16", "--paged", "16", "--varlen",
         "--out", str(tmp_path)], cwd=ROOT,
        capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["impl"] for r in data["rows"]} == {
        "mhagen", "mhagen_call", "mhagen_bfloat16", "mhagen_float32_cache_bfloat16",
        "mhagen_paged16", "mhagen_varlen", "torch_sdpa", "ort_attention", "ort_gqa"}, \
        data["meta"]
    assert "tolerance 0.0" in data["meta"]["status"]["mhagen_bfloat16 decode step"]
    assert all(r["ms"] > 0 for r in data["rows"])
    assert "rows cache 31, 1, 8 of 40 tokens" in data["meta"]["shape"]
    refused = subprocess.run([sys.executable, script, "--cache", "40", "--lens", "40"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "at most --cache - 1 = 39" in refused.stderr


@pytest.mark.parametrize("causal", [False, True], ids=["padding", "padding-causal"])
def test_padding_benchmark_quick_run(tmp_path, causal):
    """benchmarks/bench_padding.py end to end: rows of 64, 40, 9 and 1 tokens padded to 64;
    mhagen and every peer (torch SDPA's and ORT's key masks) checked against the reference,
    none excluded, then timed; lengths that do not fit the shape are a usage error."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    script = str(ROOT / "benchmarks" / "bench_padding.py")
    proc = subprocess.run(
        [sys.executable, script, "--shape", "4x64x64x4", "--lens", "64,40,9,1", "--threads",
         "1", "--rounds", "1", "--out", str(tmp_path)] + ["--causal"] * causal,
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["impl"] for r in data["rows"]} == {"mhagen", "mhagen_dense", "torch_sdpa",
                                                 "ort_mha", "ort_attention"}, data["meta"]
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in data["rows"])
    bp = load_script("bench_padding")
    seen = bp.seen_keys([64, 40, 9, 1], 64, causal)
    assert seen.sum() == (64 * 65 // 2 + 40 * 41 // 2 + 40 * 24 + 9 * 10 // 2 + 9 * 55 + 64
                          if causal else 64 * (64 + 40 + 9 + 1))
    assert data["meta"]["useful_flops"] == bp.useful_flops(4, 64, 64, 4, [64, 40, 9, 1], causal)
    refused = subprocess.run([sys.executable, script, "--shape", "2x64x64x4", "--lens", "64"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "give 2 lengths" in refused.stderr, refused.stderr
