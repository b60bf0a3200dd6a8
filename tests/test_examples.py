"""The examples run, check themselves, and show what they claim to show."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mhagen


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(name, *args):
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def printed_error(stdout):
    m = re.search(r"max error:?\s+([0-9.eE+-]+)", stdout)
    assert m, f"no max error printed:\n{stdout}"
    return float(m.group(1))


# -- heads_specialise ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads():
    return load_example("heads_specialise")


@pytest.fixture(scope="module")
def heads_run(heads, tmp_path_factory):
    return heads.run(tmp_path_factory.mktemp("png"))


def test_heads_compiled_matches_reference(heads_run):
    assert heads_run["error"] < 1e-4


def test_head_b_attends_to_first_token(heads_run):
    p = heads_run["map_b"]
    assert p.shape == (6, 6)
    assert np.all(p[:, 0] > 0.9), p


def test_head_a_attends_to_previous_tokens(heads_run):
    p = heads_run["map_a"]
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-6)   # float32, compiled
    for i in range(2, 6):
        assert p[i, i - 1] + p[i, i - 2] > 0.9, (i, p[i])
        assert p[i, i - 1] > 0.45 and p[i, i - 2] > 0.45, (i, p[i])
    assert p[1, 0] > 0.9                     # only one previous token
    assert p[0, 0] > 0.9                     # none: rests on itself


def test_heads_disagree(heads_run):
    # The two heads look at different places for every query from position 2 on.
    a, b = heads_run["map_a"], heads_run["map_b"]
    assert np.all(np.abs(a - b)[2:].sum(axis=1) > 0.9)   # L1 distance of the rows


def test_concat_wo_merges_both_views(heads, heads_run):
    sent = heads.SENTENCE
    for i, (prev, first) in enumerate(heads_run["decoded"]):
        assert first == "the"
        want = {sent[i]} if i == 0 else set(sent[max(0, i - 2):i])
        assert set(prev) == want, (i, prev)


def test_views_follow_the_tokens_not_the_positions(heads):
    # Another sentence: the decoded views change with it (nothing is hard-wired to the text).
    layer = heads.make_layer()
    tokens = "mat on the cat sat the".split()
    x = heads.embed(tokens)
    decoded = heads.decode(layer.reference(x, heads.make_weights(layer)))
    assert [first for _, first in decoded] == ["mat"] * 6
    assert set(decoded[3][0]) == {"on", "the"}
    assert set(decoded[5][0]) == {"cat", "sat"}


def test_heads_png(heads_run):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert heads_run["png"] is None
    else:
        assert heads_run["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heads_fails_on_large_error(heads, monkeypatch):
    bad = dict(error=1.0, map_a=None, map_b=None, y=None, decoded=[], png=None)
    monkeypatch.setattr(heads, "run", lambda out_dir=None: bad)
    assert heads.main([]) == 1


def test_heads_script(tmp_path):
    r = run_script("heads_specialise", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert printed_error(r.stdout) < 1e-4
    assert "pos 3 'on'  : prev -> {cat, sat}  first -> the" in r.stdout
    assert "head A: previous tokens" in r.stdout and "head B: first token" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("4:the"))
    assert [float(v) for v in row.split()[1:]] == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]


# -- textbook_512x8 ------------------------------------------------------------------------
def test_textbook_run_causal():
    tb = load_example("textbook_512x8")
    r = tb.run(batch=2, seq_len=16, causal=True)
    assert r["error"] < 1e-4
    assert r["layer"].options["causal"] is True
    b, s, d, h, hd = 2, 16, 512, 8, 64
    assert r["flops"] == 4 * 2 * b * s * d * d + 2 * 2 * b * h * s * s * hd
    assert r["latency"] > 0 and r["gflops"] > 0


def test_textbook_script():
    r = run_script("textbook_512x8", "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert "num_heads=8, head_dim=64" in r.stdout
    assert printed_error(r.stdout) < 1e-4
    assert float(re.search(r"latency:\s+([0-9.]+) ms", r.stdout).group(1)) > 0
    assert float(re.search(r"throughput:\s+([0-9.]+) GFLOP/s", r.stdout).group(1)) > 0


# -- cpu_classes ---------------------------------------------------------------------------
def test_cpu_classes_example_checks_every_class_or_says_why_not():
    proc = run_script("cpu_classes")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for preset, cls in (("x86-avx2", "x86_64-v256-r16"), ("x86-avx512", "x86_64-v512-r32")):
        block = out.split(f"{preset}: class ")[1].split("\nx86")[0]
        assert block.startswith(cls)
        assert re.search(r"max error [0-9.e+-]+ \(tolerance [0-9.e+-]+\) ok", block) or \
            "not run here: cannot call this module: this code" in block, block
    assert "tile_rows': 6, 'tile_cols': 16" in out.split("x86-avx2: class ")[1]


# -- decode ----------------------------------------------------------------------------------
def test_decode_script_matches_the_whole_sequence():
    r = run_script("decode", "--prompt", "13", "--steps", "16", "--max-len", "64")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "lens [29]" in r.stdout
    assert printed_error(r.stdout) < 1e-4


def test_decode_example_fails_loudly_on_a_mismatch(monkeypatch, capsys):
    """The example's check can fail: break the cache between steps (the prepared runs)
    and it returns 1."""
    dec = load_example("decode")
    from mhagen.decode_call import PreparedDecode
    from mhagen.module import Call
    real_run, real_packed_run = Call.__call__, PreparedDecode.__call__

    def corrupt(self):
        self.cache.k[:, :, 3] += 1.0
        return real_run(self)

    def corrupt_packed(self):      # a seq_len=None module's prepared call
        self.args.cache.k[:, :, 3] += 1.0
        return real_packed_run(self)
    monkeypatch.setattr(Call, "__call__", corrupt)
    monkeypatch.setattr(PreparedDecode, "__call__", corrupt_packed)
    assert dec.main(["--prompt", "13", "--steps", "4", "--max-len", "32"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


# -- half_precision --------------------------------------------------------------------------
def test_half_precision_example_checks_every_dtype():
    r = run_script("half_precision")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for name in ("float32", "float16", "bfloat16"):
        (line,) = [ln for ln in lines if ln.strip().startswith(f"{name}: weights")]
        assert f"output {name}" in line and "MISMATCH" not in line
    assert r.stdout.count("half-precision reference bound") == 2
    assert "converted to float32 on load" in r.stdout


# -- hf_generate -----------------------------------------------------------------------------
HF_SMALL = ["--d-model", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab",
            "128", "--prompt", "12", "--new-tokens", "6", "--batch", "2", "--repeat", "1"]


def test_hf_generate_example_matches_sdpa_and_fails_loudly(monkeypatch, capsys):
    """examples/hf_generate.py on a tiny model: the optimized model generates HF sdpa's
    tokens (left-padded batch of 2) and prints both tokens/s; with the fused attention's
    answer disturbed, it says MISMATCH and returns 1."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    example = load_example("hf_generate")
    args = example.parse(HF_SMALL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # a tiny model: torch's second thread only waits
    try:
        models = example.make_models(args)
        assert example.compare(*models, args) == 0
        out = capsys.readouterr().out
        assert "same tokens as HF's sdpa: yes" in out
        assert re.search(r"HF sdpa: +[0-9.]+ tokens/s", out)
        assert re.search(r"mhagen.hf.optimize: +[0-9.]+ tokens/s", out)
        assert "2 attention modules replaced (1 configurations" in out

        from mhagen.hf.fused import FusedAttention
        real_attend = FusedAttention.attend
        monkeypatch.setattr(FusedAttention, "attend",
                            lambda self, hidden: real_attend(self, hidden) * 1.5)
        assert example.compare(*models, args) == 1
        assert "MISMATCH" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)


# -- serve (continuous batching on a paged cache) ---------------------------------------------
@pytest.fixture(scope="module")
def serve():
    return load_example("serve")


@pytest.fixture(scope="module")
def serve_modules(serve):
    """The --quick run's paged and one-sequence modules, built once (most of these tests'
    time)."""
    q = serve.QUICK
    return serve.build(serve.make_model(q), "x86", q["max_seqs"], q["token_budget"],
                       q["max_prompt"])


@pytest.fixture(scope="module")
def serve_main(serve, serve_modules):
    """main(["--quick"]) on the modules built once: (exit code, what it printed, run()'s
    result)."""
    import contextlib
    import io
    results = []

    def recorded_run(*args, **kwargs):
        results.append(real_run(*args, **kwargs))
        return results[-1]
    real_run, printed = serve.run, io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(serve, "build", lambda *args: serve_modules)
        mp.setattr(serve, "run", recorded_run)
        code = serve.main(["--quick"])
    return code, printed.getvalue(), results[0]


@pytest.fixture(scope="module")
def serve_run(serve_main):
    return serve_main[2]


def test_serve_outputs_equal_each_request_run_alone(serve_run):
    assert serve_run["mismatches"] == []
    assert serve_run["token_mismatches"] == 0 and serve_run["worst_ratio"] <= 1
    assert serve_run["ref_err"] <= serve_run["ref_tol"]
    reqs = serve_run["requests"]
    assert all(len(out) == r.max_new for r in reqs for out in r.outputs)
    # each sample drew its own tokens: two sequences after the fork, not one
    forked = [r for r in reqs if r.samples == 2]
    assert len(forked) == 2 and any(r.outputs[0] != r.outputs[1] for r in forked)


def test_serve_quick_run_takes_every_path_of_the_scheduler(serve, serve_run):
    q, log, reqs = serve.QUICK, serve_run["log"], serve_run["requests"]
    assert any(r.chunked for r in reqs)                        # chunked prefill
    assert any(s["decodes"] and s["prefills"] for s in log)    # decodes beside a prompt
    assert any(s["blocked"] for s in log)                      # a request waited for blocks
    assert sum(r.preempted for r in reqs) >= 1                 # and one was recomputed
    assert max(s["used"] for s in log) == q["blocks"]          # the pool filled up
    assert all(s["tokens"] <= q["token_budget"] for s in log)
    assert all(s["decodes"] + s["prefills"] <= q["max_seqs"] for s in log)
    assert all(r.arrival <= r.admitted <= r.finished for r in reqs)


def test_serve_script_reports_and_exits_0(serve_main):
    code, out, _ = serve_main
    assert code == 0 and "MISMATCH" not in out
    assert "outputs equal to their request run alone: 12 of 12 (every token)" in out
    assert re.search(r"pool occupancy: peak 10 of 10 blocks \(100%\)", out)
    assert float(re.search(r"ratio: ([0-9.]+)x", out).group(1)) > 0


def test_serve_script_exits_1_on_a_mismatch(serve, serve_modules, monkeypatch, capsys):
    """The check can fail: every call's reserve disturbs a cached key of its first
    sequence (a block read wrongly) and the script returns 1."""
    monkeypatch.setattr(serve, "build", lambda *args: serve_modules)
    real_reserve = mhagen.PagedKVCache.reserve

    def disturbed(self, seqs, counts):
        real_reserve(self, seqs, counts)
        table = self.blocks(seqs[0])
        if table:
            self.k[table[0], :, 0] += 1.0
    monkeypatch.setattr(mhagen.PagedKVCache, "reserve", disturbed)
    assert serve.main(["--quick"]) == 1
    assert "MISMATCH: request" in capsys.readouterr().out


def test_serve_refuses_a_pool_too_small_for_a_request(serve, serve_modules):
    with pytest.raises(mhagen.InputError, match="give more blocks"):
        serve.run(dict(serve.QUICK, blocks=3), modules=serve_modules)
    with pytest.raises(mhagen.InputError, match="--min-new 30 is more than --max-new 24"):
        serve.run(dict(serve.QUICK, min_new=30), modules=serve_modules)
