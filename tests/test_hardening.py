"""Bad input and concurrency (issue 16, first part): a clear error, never a traceback, a crash
or a silently wrong answer."""
import json
import threading

import numpy as np
import pytest
from conftest import random_input

import mhagen
from mhagen.cli import main
from mhagen.tolerances import assert_close


def test_a_module_shared_by_threads_gives_right_answers():
    layer = mhagen.mha(64, 4, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86-avx2" if not mhagen.target.resolve("x86").runs_here()
                     else "x86", batch=2, seq_len=33, weights=w)
    inputs = [random_input(layer, 2, 33, seed=s) for s in range(8)]
    expected = [m(x) for x in inputs]
    wrong = []

    def worker(i):
        for _ in range(40):
            if not np.array_equal(m(inputs[i]), expected[i]):
                wrong.append(i)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} wrong results from a shared module"
    assert_close(expected[0], layer.reference(inputs[0], w))


def test_one_module_per_thread_from_8_threads():
    """Eight modules of one layer (built in turn), each called from its own thread at once:
    every result right (the modules share kernels' code, never buffers)."""
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True)
    w = layer.init_weights(0)
    target = "x86-avx2" if not mhagen.target.resolve("x86").runs_here() else "x86"
    modules = [mhagen.build(layer, target, batch=1, seq_len=21, weights=w) for _ in range(8)]
    inputs = [random_input(layer, 1, 21, seed=s) for s in range(8)]
    expected = [layer.reference(x, w) for x in inputs]
    errors = {}

    def worker(i):
        for _ in range(30):
            y = modules[i](inputs[i])
            err = mhagen.max_error(y, expected[i])
            errors[i] = max(errors.get(i, 0.0), err)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8 and max(errors.values()) < 1e-4, errors


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"),
                    reason="reads the resident set size from Linux's /proc")
def test_ten_thousand_calls_do_not_grow_memory():
    layer = mhagen.mha(32, 2, causal=True)
    m = mhagen.build(layer, "x86-avx2" if not mhagen.target.resolve("x86").runs_here()
                     else "x86", batch=1, seq_len=8, weights=layer.init_weights(0))
    x, out = random_input(layer, 1, 8), np.empty((1, 8, 32), np.float32)
    for _ in range(1000):                 # warm up: allocator pools, TVM's workspace
        m(x)
        m(x, out=out)
    before = _rss_bytes()
    for _ in range(5000):
        m(x)
        m(x, out=out)
    grown = _rss_bytes() - before
    assert grown < 4 * 2 ** 20, f"RSS grew by {grown / 2 ** 20:.1f} MiB over 10,000 calls"


def test_irregular_kv_sharing_compiles_unfused_and_says_why():
    g = mhagen.Graph("interleaved")
    x = g.input("x", 32)
    ks = [g.head_projection(x, "w_k", i, 8) for i in range(2)]
    vs = [g.head_projection(x, "w_v", i, 8) for i in range(2)]
    outs = []
    for h in range(4):     # heads read K/V heads 0, 1, 0, 1: not the grouped 0, 0, 1, 1
        q = g.head_projection(x, "w_q", h, 8)
        p = g.softmax(g.scale(g.scores(q, ks[h % 2]), 0.25))
        outs.append(g.weighted_sum(p, vs[h % 2]))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 32))
    w = g.init_weights(0)
    m = mhagen.build(g, "x86-avx2" if not mhagen.target.resolve("x86").runs_here() else "x86",
                     batch=1, seq_len=9, weights=w)
    assert m.program.fusion.startswith("not fused") and "grouped order" in m.program.fusion
    xs = random_input(g, 1, 9)
    assert_close(m(xs), g.reference(xs, w))


@pytest.mark.parametrize("make", [lambda: mhagen.mha(2 ** 40, 8),
                                  lambda: mhagen.mha(2 ** 20, 8),
                                  lambda: mhagen.mha(64, 4).shapes(batch=2 ** 40, seq=8)],
                         ids=["d_model-2^40", "d_model-2^20", "batch-2^40"])
def test_sizes_beyond_32_bit_indices_are_refused(make):
    with pytest.raises(mhagen.GraphError, match="more than 2\\^31 - 1 elements"):
        make()


def _cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    binary = tmp_path / "graph.bin"
    binary.write_bytes(bytes(range(256)))
    rc, _, err = _cli(capsys, "build", "--graph", str(binary))
    assert rc == 2 and err.count("\n") == 1 and "not a graph JSON file" in err
    rc, _, err = _cli(capsys, "build", "--d-model", "32", "--heads", "2", "--seq-len", "8",
                      "--repeat", "0")
    assert rc == 2 and "--repeat must be >= 1" in err
    wrong = tmp_path / "m"
    wrong.mkdir()
    (wrong / "manifest.json").write_text(json.dumps([1, 2, 3]))
    rc, _, err = _cli(capsys, "inspect", str(wrong), "--what", "manifest")
    assert rc == 2 and err.count("\n") == 1 and "a JSON object is expected" in err
    with pytest.raises(SystemExit) as exit_:
        main(["build", "--no-such-flag"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("mhagen build: error: unrecognized")


def test_cli_out_that_cannot_be_written_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc, _, err = _cli(capsys, "build", "--d-model", "32", "--heads", "2", "--seq-len", "8",
                      "--target", "x86-avx2", "--out", str(blocker / "m"))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("mhagen build: error:")


def test_a_tuned_schedule_that_computes_something_else_is_not_kept():
    """tune() keeps a faster schedule only when its output matches the default schedule's on
    the same inputs (here: a candidate that drops the bias)."""
    from tvm import te

    from mhagen.target import resolve
    from mhagen.tuning.search import _wrong_result
    t = resolve("x86-avx2")
    if not t.runs_here():
        pytest.skip(f"x86-avx2 code cannot run here: {t.cannot_run()}")

    def gemm(with_bias):
        a, w, b = (te.placeholder(s, "float32", name=n)
                   for s, n in (((16, 8), "a"), ((8, 4), "w"), ((4,), "b")))
        k = te.reduce_axis((0, 8), name="k")
        mm = te.compute((16, 4), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="mm")
        out = te.compute((16, 4), lambda i, j: mm[i, j] + (b[j] if with_bias else 0.0),
                         name="out")
        return te.create_prim_func([a, w, b, out])
    assert _wrong_result([gemm(True), gemm(True)], t) is None
    assert "differs from the default schedule" in _wrong_result([gemm(True), gemm(False)], t)


@pytest.mark.parametrize("content, warning", [
    ({"schema": 3, "records": "x"}, "is a str, not a list"),
    ({"schema": 3, "records": [{"key": {}, "kind": "trace"}, {"kind": "nonsense"}]},
     "1 malformed record"),
], ids=["records-not-a-list", "malformed-record"])
def test_corrupt_tuning_records_warn_and_fall_back(tmp_path, content, warning):
    from mhagen.records.database import Database, TuningWarning
    path = tmp_path / "db.json"
    path.write_text(json.dumps(content))
    with pytest.warns(TuningWarning, match=warning):
        db = Database.load(path)
    assert all(isinstance(r, dict) for r in db.records.values())
