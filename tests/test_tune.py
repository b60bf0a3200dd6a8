"""Tuning: a small MetaSchedule run writes records; builds replay them in a fresh process;
corrupt or stale records fall back with a warning; distributed tuning over loopback RPC."""
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.tolerances import assert_close
from mhagen import tune
from mhagen.tuning import Database, Tuning, TuningWarning
from mhagen.tuning.search import _Remote, _wrong_result
from tests.conftest import random_cache, random_input

LAYER = dict(d_model=64, num_heads=4, causal=True)
BATCH, SEQ = 1, 32


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The run's folder and report; its progress (stderr, not a terminal) in report.progress."""
    d = tmp_path_factory.mktemp("tune")
    with contextlib.redirect_stderr(io.StringIO()) as progress:
        report = tune(mhagen.mha(**LAYER), shapes=[(BATCH, SEQ)], trials=3,
                      database=d / "x86.json", kernels=["qkv_projection", "attention"])
    report.progress = progress.getvalue()
    return d, report


def test_small_run_writes_sorted_readable_records(tuned):
    d, report = tuned
    data = json.loads((d / "x86.json").read_text())
    assert data["schema"] == 3
    records = data["records"]
    assert sorted(r["key"]["kernel"] for r in records) == ["attention", "qkv_projection"]
    for r in records:
        assert r["key"]["seq"] == SEQ and r["key"]["heads"] == 4 and r["key"]["mask"] == "causal"
        assert r["default_us"] > 0 and r["tvm"] and r["mhagen"]
        assert r["kind"] in ("trace", "config", "default")
        assert r["default_config"], "the default it was measured against"
        assert r["measured_on"]["cores"] >= 1
        # a kept trace carries what tells a damaged one (apply_trace checks it)
        assert ("schedule_hash" in r) == (r["kind"] == "trace")
        if r["kind"] == "trace":
            assert r == {**r, **_trace_fields(r["trace"])}
    for res in report.results:  # never keep a slower schedule
        assert res.kept == "default" or res.tuned_us < res.default_us
        # one number per kernel: its progress line gives the table's
        tuned_us = f"{res.tuned_us:.1f} us" if res.tuned_us else "-"
        assert (f"{res.kernel} {BATCH}x{SEQ}" in report.progress and
                f"default {res.default_us:.1f} us, tuned {tuned_us}: kept {res.kept}"
                in report.progress)
    assert "\r" not in report.progress
    assert "default us" in report.table() and not report.interrupted


def _best_trace(work_dir):
    import tvm.s_tir.meta_schedule as ms

    from mhagen.tuning.search import plain_json
    (kernel_dir,) = [p for p in Path(work_dir).iterdir() if p.name.endswith("qkv_projection")]
    db = ms.database.JSONDatabase(work_dir=str(kernel_dir))
    records = db.get_all_tuning_records()
    assert len(records) == 3, "MetaSchedule measured the trials into its database"
    best = db.get_top_k(records[0].workload, 1)[0]
    return plain_json(best.trace.as_json())


_FIELDS = {}


def _trace_fields(trace):
    """What mhagen tune writes beside a trace it keeps (replay.trace_fields: the trace's
    length, the scheduled kernel's structural hash), for `trace` replayed on the layer's
    qkv_projection."""
    import tvm
    from tvm.s_tir.schedule import Trace

    from mhagen.lower import lower
    from mhagen.target import resolve
    from mhagen.records.replay import trace_fields
    key = json.dumps(trace)
    if key not in _FIELDS:
        program = lower(mhagen.mha(**LAYER), BATCH, SEQ, resolve("x86"), tuning=Tuning.none())
        kernel = next(k for k in program.kernels if k.name == "qkv_projection")
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": kernel.prim_func}))
        Trace.apply_json_to_schedule(trace, sch)
        _FIELDS[key] = trace_fields(sch.mod["main"], trace)
    return _FIELDS[key]


def _forced_records(tuned):
    """The run's records, with the tuned schedules forced in (so the replay path is used):
    the qkv_projection record as mhagen tune writes a trace it keeps."""
    d, _ = tuned
    db = Database.load(d / "x86.json")
    out = []
    for r in db.records.values():
        r = dict(r)
        if r["key"]["kernel"] == "qkv_projection":
            trace = _best_trace(d / "x86-work")
            r.update(kind="trace", trace=trace, **_trace_fields(trace))
        else:
            r.update(kind="config", config={"q_tile": 32, "kv_block": 64, "tile_rows": 4,
                                            "tile_cols": 16, "out_rows": 4, "out_cols": 16})
        out.append(r)
    return out


def test_fresh_process_builds_with_tuned_records(tuned, tmp_path):
    Database(tmp_path / "db.json", _forced_records(tuned)).save()
    script = f"""
import mhagen, numpy as np
from mhagen.tolerances import assert_close
layer = mhagen.mha(**{LAYER!r})
w = layer.init_weights(0)
m = mhagen.build(layer, batch={BATCH}, seq_len={SEQ}, weights=w, tuning={str(tmp_path / 'db.json')!r})
x = np.random.default_rng(0).standard_normal(m.in_shape).astype(np.float32)
assert_close(m(x), layer.reference(x, w))
for d in m.decisions:
    print(d["kernel"], d["source"], d["config"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("qkv_projection tuned") for line in lines), out.stdout
    assert any(line.startswith("attention tuned") and "'tile_cols': 16" in line
               for line in lines)
    assert any(line.startswith("output_projection default") for line in lines)


def _build_with(records, tmp_path):
    Database(tmp_path / "db.json", records).save()
    layer = mhagen.mha(**LAYER)
    w = layer.init_weights(0)
    m = mhagen.build(layer, batch=BATCH, seq_len=SEQ, weights=w, tuning=tmp_path / "db.json")
    x = random_input(layer, BATCH, SEQ)
    assert_close(m(x), layer.reference(x, w))
    return {d["kernel"]: d["source"] for d in m.decisions}


def _first(trace, kind):
    """Index of the trace's first instruction of `kind`."""
    return next(i for i, inst in enumerate(trace[0]) if inst[0] == kind)


def _row_tile_split(trace):
    """Index of the Split into register tiles' rows (its factor the sampled row count):
    with its loops swapped the trace replays and computes something else. (Not any Split:
    on Zen 3 the first one split the weight panels, whose loops are fused whole into the
    parallel loop, so swapping them changed only the order of the tasks.)"""
    sampled = {inst[3][0] for inst in trace[0] if inst[0] == "SampleCategorical"}
    return next(i for i, inst in enumerate(trace[0])
                if inst[0] == "Split" and sampled & set(map(str, inst[1])))


def _sampled(trace):
    """The decision of the trace's first SampleCategorical."""
    at = _first(trace, "SampleCategorical")
    return next(d for d in trace[1] if d[0] == at)


def _written_before_the_damage_fields(record):
    """The record as mhagen tune wrote it before records carried trace_fields."""
    for field in ("trace_instructions", "schedule_hash"):
        del record[field]


def _cut_short(record):
    """The trace cut to its first two instructions, every decision kept (they name the
    first instruction, the template's sampled row count): it replays, to the unscheduled
    kernel, which computes the right output and is not the schedule that was measured."""
    insts, decisions = record["trace"]
    assert all(index < 2 for index, _ in decisions)
    record["trace"] = [insts[:2], decisions]


def _another_sampled_value(record):
    """Another row count for the template's sampled one: a sound schedule, computing the
    right output, not the one measured."""
    decision = _sampled(record["trace"])
    candidates = record["trace"][0][decision[0]][2][0]
    decision[1] = (decision[1] + 1) % len(candidates)


# decision-index, decision-value, attributes: each crashed the process in TVM's replay
@pytest.mark.parametrize("damage,match", [
    (lambda r: r.update(trace=[["NoSuchInstruction", [], [], []]]), "damaged: not"),
    # (TVM refuses it: in a record without the damage fields, which would tell it first)
    (lambda r: _written_before_the_damage_fields(r) or
     r["trace"][0].append(["NoSuchInstruction", [], [], []]), "does not apply"),
    (lambda r: r["trace"][0].append(["NoSuchInstruction", [], [], []]),
     r"damaged: it has \d+ instructions, \d+ were measured"),
    (lambda r: r.update(kernel_hash="0" * 16), "kernel changed"),
    (lambda r: r.update(tvm="0.1.0"), "made with TVM 0.1.0"),
    (lambda r: _sampled(r["trace"]).__setitem__(0, -1), "names no instruction"),
    (lambda r: _sampled(r["trace"]).__setitem__(1, 99), "no such candidate"),
    (lambda r: r["trace"][0][_first(r["trace"], "GetSBlock")].__setitem__(2, []),
     r"\(GetSBlock\) has 0 attributes, not 2"),
    # a sound trace that computes something else: its row split's loops swapped (in a
    # record without the damage fields, which would tell it first)
    (lambda r: _written_before_the_damage_fields(r) or
     r["trace"][0][_row_tile_split(r["trace"])][3].reverse(),
     "its trace replays, but its output differs from the default schedule's"),
    # damaged traces that still replay and compute the right output (issue 60)
    (_cut_short, r"its trace is damaged: it has 2 instructions, \d+ were measured"),
    (lambda r: _written_before_the_damage_fields(r) or _cut_short(r),
     "its trace is damaged: it has no EnterPostproc instruction"),
    (lambda r: _cut_short(r) or r.update(trace_instructions=2),
     "its trace is damaged: it has no EnterPostproc instruction"),
    (_another_sampled_value,
     "its trace is damaged: it replays to another schedule than the one measured"),
], ids=["garbage-trace", "unknown-instruction", "instruction-added", "stale-hash", "other-tvm",
        "decision-index", "decision-value", "attributes", "swapped-loops", "cut-short",
        "cut-short-old-record", "cut-short-length-edited", "another-sampled-value"])
def test_bad_trace_records_fall_back_with_a_warning(tuned, tmp_path, damage, match):
    records = _forced_records(tuned)
    damage(next(r for r in records if r["key"]["kernel"] == "qkv_projection"))
    with pytest.warns(TuningWarning, match=match):
        sources = _build_with(records, tmp_path)
    assert sources["qkv_projection"] == "stale"


def test_a_replay_check_that_passed_is_not_repeated(tuned, tmp_path, monkeypatch):
    """The replay check compiles the default kernel beside the replayed one (twice the build
    time of the default layer with two trace records); once it passed for the same pair
    of kernels, target and versions, later builds skip it. A failed check is never kept."""
    import mhagen.records.replay as replay
    monkeypatch.setenv("MHAGEN_TUNING_DIR", str(tmp_path / "dir"))
    runs, local = [], replay.local_outputs
    monkeypatch.setattr(replay, "local_outputs", lambda *a, **k: runs.append(1) or local(*a, **k))
    records = _forced_records(tuned)
    for expected_runs in (1, 1):
        assert _build_with(records, tmp_path)["qkv_projection"] == "tuned"
        assert len(runs) == expected_runs
    assert len(replay._passed_checks()) == 1
    swapped = next(r for r in records if r["key"]["kernel"] == "qkv_projection")
    _written_before_the_damage_fields(swapped)   # (those would tell the swap first)
    swapped["trace"][0][_row_tile_split(swapped["trace"])][3].reverse()
    for expected_runs in (2, 3):
        with pytest.warns(TuningWarning, match="output differs"):
            assert _build_with(records, tmp_path)["qkv_projection"] == "stale"
        assert len(runs) == expected_runs


def test_records_measured_against_another_default_are_stale(tuned, tmp_path):
    """A record beat the default of its day (default_config): against today's default it
    applies, against another one it is stale, warned of, and the default is used."""
    measured = {r["key"]["kernel"]: r["default_config"]
                for r in Database.load(tuned[0] / "x86.json").records.values()}
    records = _forced_records(tuned)
    for r in records:
        r["default_config"] = measured[r["key"]["kernel"]]
    assert _build_with(records, tmp_path) == {"qkv_projection": "tuned", "attention": "tuned",
                                              "output_projection": "default"}
    for r in records:
        if r["key"]["kernel"] == "attention":
            r["default_config"] = {**r["default_config"], "q_tile": 999}
        else:
            r["default_config"][0]["config"]["row_block"] += 1
    with pytest.warns(TuningWarning, match="measured against the default") as caught:
        sources = _build_with(records, tmp_path)
    assert sources == {"qkv_projection": "stale", "attention": "default",
                       "output_projection": "default"}
    assert {m for w in caught for m in ("'qkv_projection'", "attention")
            if m in str(w.message)} == {"'qkv_projection'", "attention"}


@pytest.mark.parametrize("edit", [
    {"q_tile": 12},
    # found by editing records at random: a P V vector wider than a head's columns met an
    # assertion in the template, tiles of 2^31 rows a TVM InternalError
    {"out_cols": 64},
    {"out_rows": 2 ** 31, "q_tile": 65536, "tile_cols": 65536},
    {"tile_rows": 160, "kv_block": 160}], ids=["q_tile", "out_cols", "huge", "tile_rows"])
def test_invalid_attention_config_falls_back(tuned, tmp_path, edit):
    records = _forced_records(tuned)
    next(r for r in records if r["key"]["kernel"] == "attention")["config"].update(edit)
    with pytest.warns(TuningWarning, match="invalid"):
        sources = _build_with(records, tmp_path)
    assert sources["attention"] == "default"


DECODE_LAYER = dict(d_model=64, num_heads=8, kv_heads=2, kv_cache=97)


def _decode_sources(layer, db, tmp_path):
    """Build the decode step with the records `db`; check 3 steps of a ragged batch against
    the reference; the attention decision."""
    Database(tmp_path / "db.json", db).save()
    w = layer.init_weights(0)
    m = mhagen.build(layer, batch=2, seq_len=1, weights=w, tuning=tmp_path / "db.json")
    rng = np.random.default_rng(1)
    cache = m.new_cache()
    random_cache(cache, rng)
    cache.lens[...] = [90, 7]
    ref = cache.copy()
    for _ in range(3):
        x = rng.standard_normal((2, 1, 64)).astype(np.float32)
        assert_close(m(x, cache=cache), layer.reference(x, w, cache=ref))
    return next(d for d in m.decisions if d["kernel"] == "attention")


def test_decode_steps_sweep_their_template_on_a_full_cache(tmp_path, monkeypatch):
    """A decoding layer's decode template is tuned as the attention template is (a config
    sweep, timed on a cache full up to the step); a build uses its record, and refuses a
    stale or invalid one with a warning."""
    import mhagen.tuning.search as search
    layer = mhagen.mha(**DECODE_LAYER)
    seen, measure = [], search._measure

    def spy(funcs, target, remote, fixed=None, errors=None):
        seen.append(fixed)
        return measure(funcs, target, remote, fixed=fixed, errors=errors)
    monkeypatch.setattr(search, "_measure", spy)
    report = tune(layer, shapes=[(2, 1)], trials=3, kernels=["attention"],
                  database=tmp_path / "tuned.json", progress=False)
    ((res,), (record,)) = report.results, Database.load(tmp_path / "tuned.json").records.values()
    assert res.method == "config sweep" and res.trials == 3 and res.default_us > 0
    # the cache_lens argument of every candidate: full up to the new token
    assert [[a.tolist() for a in f.values()] for f in seen[0]] == [[[96, 96]]] * 3
    default = record["default_config"]
    assert default["row_tile"] == 4 and record["key"]["kernel"] == "attention"
    assert _decode_sources(layer, [], tmp_path) == {
        "kernel": "attention", "stage": "attention", "rule": "decode_attention",
        "config": default, "source": "default"}

    other = {**default, "workers": 3, "kv_block": 2 * default["lanes"], "row_tile": 3}
    record.update(kind="config", config=other)
    decision = _decode_sources(layer, [record], tmp_path)
    assert (decision["source"], decision["config"]) == ("tuned", other)
    with pytest.warns(TuningWarning, match="measured against the default"):
        stale = _decode_sources(layer, [{**record, "default_config": {**default,
                                                                      "workers": 99}}],
                                tmp_path)
    # the wrong lanes; edited at random: a row tile of 10^6 rows (its build hung), 2^31
    # workers (int32 overflow in TVM)
    for edit in ({"lanes": 4}, {"row_tile": 10 ** 6}, {"workers": 2 ** 31}):
        with pytest.warns(TuningWarning, match="invalid"):
            invalid = _decode_sources(layer, [{**record, "config": {**other, **edit}}],
                                      tmp_path)
        assert invalid["source"] == "default", edit
    assert stale["source"] == "default"


def test_corrupt_database_file_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "db.json").write_text('{"schema": 2, "records": [tru')
    with pytest.warns(TuningWarning, match="unreadable"):
        tuning = Tuning([Database.load(tmp_path / "db.json")])
    assert tuning.lookup({"kernel": "attention"}) is None


def test_unknown_kernel_name_is_an_error(tmp_path):
    with pytest.raises(mhagen.MhagenError, match="no tunable kernel"):
        tune(mhagen.mha(32, 2), shapes=[(1, 8)], kernels=["gemm"], database=tmp_path / "d.json")


def _tune_command(work):
    return [sys.executable, "-m", "mhagen", "tune", "--d-model", "64", "--heads", "2",
            "--shapes", "1x16", "--trials", "4", "--db", str(work / "db.json"),
            "--work-dir", str(work / "ms")]


def _read_until(stream, marker, seconds):
    """Bytes of `stream` up to and including the first `marker` (the progress line uses
    carriage returns, so lines never end)."""
    seen, end = b"", time.time() + seconds
    while marker not in seen:
        assert time.time() < end, f"no {marker!r} in {seconds} s: {seen[-2000:]!r}"
        chunk = os.read(stream.fileno(), 4096)
        assert chunk, f"the run ended before {marker!r}: {seen[-2000:]!r}"
        seen += chunk
    return seen


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_tuning_cleanly_and_a_rerun_resumes(tmp_path, presses):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group: mhagen and TVM's
    builder/runner workers) once the second GEMM's search runs: exit 130 after one line, no
    traceback from any process, the first kernels' records valid, no worker left; a second
    Ctrl-C stops at once, just as cleanly. A re-run resumes the MetaSchedule databases
    (checked after one press: the records kept are the same after two)."""
    p = subprocess.Popen(_tune_command(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        err = _read_until(p.stderr, b"[3/3] output_projection", 240)
        for i in range(presses):
            time.sleep(1)
            os.killpg(p.pid, signal.SIGINT)
        out, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = (err + rest).decode()
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.rstrip().endswith("mhagen tune: interrupted"), err
    assert "stopped by Ctrl-C: kept what was measured" in out.decode()
    time.sleep(0.5)
    assert not _group_members(p.pid), "tuning workers left running"
    records = json.loads((tmp_path / "db.json").read_text())["records"]
    assert {r["key"]["kernel"] for r in records} == {"qkv_projection", "attention"}

    def measured(kernel):   # MetaSchedule's database of the kernel: one line a trial
        (path,) = (tmp_path / "ms").glob(f"*-{kernel}/database_tuning_record.json")
        return len(path.read_text().splitlines())

    assert measured("qkv_projection") == 4
    if presses == 2:
        return
    again = subprocess.run(_tune_command(tmp_path), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "done in" in again.stdout
    assert measured("qkv_projection") == 4   # resumed: its 4 trials were not run again
    assert measured("output_projection") == 4
    records = json.loads((tmp_path / "db.json").read_text())["records"]
    assert len(records) == 3


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_rpc(key):
    """A TVM RPC tracker and one server (this machine's CPU) on 127.0.0.1; yields the
    tracker's port. Afterwards no process of theirs is left."""
    port, server_port = _free_port(), _free_port()
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                                "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    server = None
    try:
        time.sleep(2)
        server = subprocess.Popen(
            [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
             "--key", key, "--host", "127.0.0.1", "--port", str(server_port),
             "--port-end", str(server_port + 1)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(3)
        yield port
    finally:
        # tracker and server each run their loop in a TVM popen_worker child: signal the
        # whole process group (each was started in its own session), or the children
        # outlive the test, reparented to init
        for p in (server, tracker):
            if p is not None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
    time.sleep(0.5)
    left = [pid for p in (server, tracker) if p is not None for pid in _group_members(p.pid)]
    assert not left, f"RPC processes left running: {left}"


@pytest.mark.slow
def test_distributed_tuning_over_loopback_rpc(tmp_path):
    with loopback_rpc("mhagen-test") as port:
        report = tune(mhagen.mha(32, 2), shapes=[(1, 16)], trials=2,
                      database=tmp_path / "x86.json", kernels=["output_projection"],
                      rpc=("127.0.0.1", port, "mhagen-test"), progress=False)
        # a schedule is kept only if the device computes what the default computes there
        remote = _Remote(("127.0.0.1", port, "mhagen-test"))
        try:
            default, zeros = _output_projection_and_a_wrong_one()
            t = mhagen.target.resolve("x86")
            assert _wrong_result([default, default], t, remote=remote) is None
            assert "differs from the default" in _wrong_result([default, zeros], t,
                                                               remote=remote)
        finally:
            remote.close()
    (result,) = report.results
    assert result.kernel == "output_projection" and result.default_us > 0
    assert result.trials == 2 and not result.note
    assert Database.load(tmp_path / "x86.json").records


def _output_projection_and_a_wrong_one():
    """The default schedule of a small output projection, and a function of the same
    arguments that writes zeros."""
    from tvm import te, tirx
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from mhagen.lower import lower
    from mhagen.schedules import schedule_kernel
    t = mhagen.target.resolve("x86")
    kernel = next(k for k in lower(mhagen.mha(32, 2), 1, 16, t).kernels
                  if k.name == "output_projection")
    default, _ = schedule_kernel(kernel, t)
    shapes = [([int(d) for d in a.shape], str(a.dtype))
              for a in ArgInfo.from_prim_func(default)]
    inputs = [te.placeholder(s, d) for s, d in shapes[:-1]]
    out = te.compute(shapes[-1][0], lambda *i: tirx.const(0.0, "float32"))
    return default, te.create_prim_func(inputs + [out])


@pytest.mark.slow
def test_cuda_tuning_reaches_the_remote_runner(tmp_path):
    """CUDA tuning builds its candidates here (MetaSchedule's GPU space for a GEMM, the
    attention template's configs) and runs them on the RPC device. The loopback server has
    no GPU: each kernel then reports the device's own error, and no record is written (a
    GPU box runs `python -m tvm.exec.rpc_server` with a CUDA-enabled TVM instead)."""
    with loopback_rpc("gpu") as port:
        report = tune(mhagen.mha(64, 2), "cuda-sm90", shapes=[(1, 64)], trials=2,
                      database=tmp_path / "cuda.json",
                      kernels=["output_projection", "attention"],
                      rpc=("127.0.0.1", port, "gpu"), progress=False)
    assert [r.kernel for r in report.results] == ["attention", "output_projection"]
    for r in report.results:
        assert r.default_us is None and r.kept == "default"
        assert "at run on the device" in r.note and "cuda" in r.note, r.note
    assert "not measured" in report.table()
    assert not Database.load(tmp_path / "cuda.json").records


def test_a_remote_kernel_that_does_not_build_is_not_measured(monkeypatch):
    """Our measurements on a remote device build their kernels here: one that does not
    build reaches no device (none is connected here) and the note says where it failed."""
    from mhagen.tuning import search

    def fails(mod, target, params):
        raise RuntimeError("LLVM ERROR: Cannot select: intrinsic %llvm.x86.tdpbf16ps")

    monkeypatch.setattr(search, "fast_build", fails)
    default, _ = _output_projection_and_a_wrong_one()
    errors = []
    assert search._measure([default], mhagen.target.resolve("x86").tvm, remote=object(),
                           errors=errors) == [None]
    assert errors == ["build: LLVM ERROR: Cannot select: intrinsic %llvm.x86.tdpbf16ps"]
    assert search._failure_note(errors) == (
        "not measured (1 failure(s)); first, at build: LLVM ERROR: Cannot select: "
        "intrinsic %llvm.x86.tdpbf16ps")
    assert search._failure_note(["build: "]).endswith("first, at build: no message")
    outs, error = search._Remote(("127.0.0.1", 1, "none")).outputs(
        [default], mhagen.target.resolve("x86").tvm)
    assert outs is None and error.endswith("Cannot select: intrinsic %llvm.x86.tdpbf16ps")


def _group_members(pgid):
    """Live processes of process group pgid (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.mark.parametrize("preset", ["x86", "x86-avx2"])
def test_default_layer_uses_the_shipped_records_of_its_class(preset, tmp_path, monkeypatch):
    """Records ship for both x86 classes; a build uses those of its own class only."""
    from mhagen.target import resolve
    from mhagen.records.database import shipped_records_path, workload_key
    monkeypatch.setenv("MHAGEN_TUNING_DIR", str(tmp_path))  # no user records
    t = resolve(preset)
    path = shipped_records_path(t)
    assert path.is_file(), f"no shipped records for {t.cpu_class}"
    shipped = Database.load(path)
    assert all(r["key"]["cpu_class"] == t.cpu_class for r in shipped.records.values())
    assert all(r["measured_on"]["cpu"] and r["measured_on"]["cores"] >= 1
               for r in shipped.records.values())
    layer = mhagen.mha(512, 8)
    m = mhagen.build(layer, preset, batch=1, seq_len=128, weights=layer.init_weights(0))
    sources = {d["kernel"]: d["source"] for d in m.decisions}
    # what the lookup picks for this host's caches (records of several machines may ship
    # for one kernel: the closest caches win, so the answer depends on the host)
    # (a "default" record: tuning measured and kept the template default, e.g. every kernel
    # of the AVX2 class on a Zen 4 since the GEMM tasks run whole row blocks)
    picked = {k: shipped.lookup(workload_key(layer, t, 1, 128, k)) for k in sources}
    assert all(picked.values()), f"the shipped {t.cpu_class} records cover the default layer"
    tuned = {k for k, r in picked.items() if r["kind"] != "default"}
    assert {k for k, s in sources.items() if s == "tuned"} == tuned
    assert len(m.tuning_records) == len(tuned)
    assert all(r["kind"] != "default" for r in m.tuning_records)
    assert all(r["key"]["cpu_class"] == t.cpu_class for r in m.tuning_records)


@pytest.mark.parametrize("preset", ["x86", "x86-avx2"])
def test_shipped_records_were_measured_against_todays_defaults(preset):
    """Every shipped record that replaces a default (a config or a trace) holds the default
    it beat, and that is today's default on the machine it was measured on (its caches and
    cores; the records of before December 4, all from 2-core VMs, got cores 2): a change of a
    template's default makes the records measured against the old one stale (re-measure
    them, or drop those of machines not at hand)."""
    import dataclasses
    import warnings

    from mhagen.lower import lower
    from mhagen.schedules import default_configs, schedule_kernel
    from mhagen.target import resolve
    from mhagen.records.database import shipped_records_path, workload_key
    t = resolve(preset)
    replacing = [r for r in Database.load(shipped_records_path(t)).records.values()
                 if r["kind"] != "default"]
    assert replacing, "some shipped records replace a default"
    for r in replacing:
        k = r["key"]
        machine = dataclasses.replace(t, l2_kib=k["l2_kib"], l1d_kib=k["l1d_kib"],
                                      cores=r["measured_on"]["cores"])
        layer = mhagen.mha(k["d_model"], k["heads"], kv_heads=k["kv_heads"],
                           causal=k["mask"] == "causal", kv_cache=k.get("kv_cache"))
        assert workload_key(layer, machine, k["batch"], k["seq"], k["kernel"])["graph"] == \
            k["graph"], k
        with warnings.catch_warnings():
            warnings.simplefilter("error", TuningWarning)
            program = lower(layer, k["batch"], k["seq"], machine, tuning=None)
        kernel = next(x for x in program.kernels if x.name == k["kernel"])
        today = (dataclasses.asdict(kernel.config) if kernel.template
                 else default_configs(schedule_kernel(kernel, machine)[1]))
        assert r["default_config"] == today, (k, r["default_config"], today)


@pytest.mark.parametrize("confirmed", [False, True])
def test_a_config_sweep_keeps_its_fastest_only_if_a_second_measurement_confirms(
        confirmed, tmp_path, monkeypatch):
    """The fastest of many noisy medians is biased low: the sweep's winner is measured again,
    alone against the default, and kept only if that fresh measurement beats the margin."""
    import mhagen.tuning.search as search
    calls = []

    def fake_measure(funcs, target, remote, fixed=None, errors=None):
        calls.append(len(funcs))
        if len(calls) == 1:          # the sweep: candidate 1 looks 20% faster
            return [1e-3, 0.8e-3] + [2e-3] * (len(funcs) - 2)
        return [1e-3, 0.9e-3 if confirmed else 1.01e-3]   # the second look
    monkeypatch.setattr(search, "_measure", fake_measure)
    report = tune(mhagen.mha(**LAYER), shapes=[(BATCH, SEQ)], trials=4, kernels=["attention"],
                  database=tmp_path / "db.json", progress=False)
    assert calls[0] >= 2 and calls[1:] == [2]
    (record,) = json.loads((tmp_path / "db.json").read_text())["records"]
    assert record["kind"] == ("config" if confirmed else "default")
    assert record["tuned_us"] == (900.0 if confirmed else 1010.0)
    assert report.results[0].kept == ("tuned" if confirmed else "default")


def test_tuning_code_this_cpu_cannot_run_is_refused_before_measuring(tmp_path, monkeypatch):
    """Measuring x86-avx512 candidates on an AVX2-only CPU died of SIGILL (qemu's Zen 1,
    tests/test_emulated_x86_cpus.py); it is refused first, naming what is missing."""
    from mhagen.errors import TargetError
    from mhagen.host import runtime_features
    avx2_only = tuple(f for f in runtime_features() if not f.startswith("avx512"))
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: avx2_only)
    db = tmp_path / "db.json"
    with pytest.raises(TargetError, match=r"cannot tune x86-avx512 here: .*needs CPU features "
                                          r"avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        tune(mhagen.mha(64, 4), "x86-avx512", shapes=[(1, 16)], trials=1, database=db,
             progress=False)
    assert not db.exists()
