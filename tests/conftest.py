import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

# `make test` runs two xdist workers: each gets its share of the cores as TVM threads (one
# each on a 2-core machine). Two threads per worker there spin-wait for a core the other
# worker holds: module calls got 5x slower. Set before mhagen starts TVM's thread pool;
# subprocesses inherit it. tests/test_threads.py runs kernels on several threads.
if os.environ.get("PYTEST_XDIST_WORKER") and "TVM_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    from mhagen.host import host_cores      # (standard library and numpy only, no TVM)
    os.environ["TVM_NUM_THREADS"] = str(max(1, host_cores() // _workers))

# Tests never read or write the user's tuning records and replay checks
# (~/.cache/mhagen/tuning): a developer's own tuning would change what they build.
# Subprocesses inherit it.
if "MHAGEN_TUNING_DIR" not in os.environ:
    os.environ["MHAGEN_TUNING_DIR"] = tempfile.mkdtemp(prefix="mhagen-test-tuning-")


CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def unavailable(reason):
    """A missing tool: a failure in CI (which installs it), else a skip saying what to do."""
    if CI:
        pytest.fail(f"CI is set but {reason}", pytrace=False)
    pytest.skip(reason)


C_APP = Path(__file__).resolve().parents[1] / "examples" / "c_app" / "mha_app.c"


def build_c_app(cc, artifact, exe, source=C_APP, std="c11", extra=()):
    """A program against `artifact`'s C API, by default the C example app, built with
    examples/c_app/README.md's command (warnings are errors) and `extra` flags; returns exe."""
    r = subprocess.run([cc, "-O2", f"-std={std}", "-Wall", "-Werror", str(source),
                        f"-I{artifact}", f"-L{artifact}", "-lmha", f"-Wl,-rpath,{artifact}",
                        "-o", str(exe), *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def x86_targets() -> list:
    """The x86 presets worth running here: x86-avx2 everywhere, and this host's own class
    ("x86") when it runs here and differs (an AVX-512 host)."""
    from mhagen.target import resolve
    host = resolve("x86")
    return ["x86-avx2"] + (["x86"] if host.runs_here() and host.cpu != resolve("x86-avx2").cpu
                           else [])


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def random_cache(cache, rng):
    """Fill a KVCache's k, then v, with standard normal values from rng; return it."""
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    return cache


def in_chunks(layer, module_or_none, w, x, chunks, cache):
    """Feed x [B, S, D] to a decoding module (None: the layer's reference) in chunks of new
    tokens; the outputs side by side."""
    outs, t = [], 0
    for n in chunks:
        part = x[:, t:t + n]
        outs.append(layer.reference(part, w, cache=cache) if module_or_none is None
                     else module_or_none(part, cache=cache))
        t += n
    return np.concatenate(outs, axis=1)


def decoding_reference(layer, plain, w, x, chunks):
    """(expected, tolerance row) of a decoding layer fed x [B, S, D] in chunks of new tokens:
    a float32 cache gives the whole sequence through `plain` (the layer without its cache);
    a half-precision one the layer's reference fed the same calls, its cache rows rounded as
    the layer says (judged by the cache dtype's row)."""
    import mhagen
    from mhagen.kvcache import cache_shape
    from mhagen.tolerances import judged_as
    if cache_shape(layer)["dtype"] == "float32":
        return plain.reference(x, w), layer.dtype
    cache = mhagen.KVCache.empty(layer, x.shape[0], np.float64)
    return in_chunks(layer, None, w, x, chunks, cache), judged_as(layer)


def random_input(layer, batch, seq_len, seed=0):
    d_model = layer.inputs[0].attrs["shape"][2]
    return np.random.default_rng(seed).standard_normal((batch, seq_len, d_model)).astype(
        np.float32)


def mha_by_hand(w, x, heads, *, causal=False, modify=None, keep=None, rotate=None):
    """The standard layer written out in float64 numpy, independent of mhagen's reference.
    modify(s, h, i, j): the scaled scores of head h -> modified scores; keep: a boolean grid
    broadcastable to [batch, S, S] of the keys each query sees (with causal by &);
    rotate(t): applied to every query and key head (RoPE)."""
    from mhagen.reference import softmax_rows
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    x = np.asarray(x, np.float64)
    d, seq = w["w_q"].shape[2], x.shape[1]
    group = heads // w["w_k"].shape[0]
    rotate = rotate or (lambda t: t)
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    visible = np.ones((1, seq, seq), bool) if keep is None else keep
    if causal:
        visible = visible & (j <= i)[None]
    outs = []
    for h in range(heads):
        g = h // group
        q = rotate(x @ w["w_q"][h] + w["b_q"][h])
        k = rotate(x @ w["w_k"][g] + w["b_k"][g])
        s = q @ np.swapaxes(k, 1, 2) / np.sqrt(d)
        if modify is not None:
            s = modify(s, h, i, j)
        outs.append(softmax_rows(np.where(visible, s, -np.inf)) @ (x @ w["w_v"][g] + w["b_v"][g]))
    return np.concatenate(outs, -1) @ w["w_o"] + w["b_o"]


# The slowest files first: `make test` runs the files on two xdist workers (--dist loadfile
# --no-loadscope-reorder: xdist would otherwise order them by their number of tests), each
# taking the next file when it runs out; longest first keeps both busy to the end. Order of
# their CI times on Zen 4 (2026-12-06: test_tune ~6 minutes, test_emulated_x86_cpus ~5).
SLOW_FILES_FIRST = ("test_tune.py", "test_emulated_x86_cpus.py", "test_attention_tiles.py",
                    "test_gemm_tiles.py", "test_bench.py", "test_arm.py", "test_fuzz.py",
                    "test_half.py", "test_cuda.py", "test_build.py", "test_decode.py",
                    "test_examples.py", "test_threads.py", "test_c_api.py", "test_symbolic.py",
                    "test_score_mods.py", "test_gpu_check.py", "test_key_padding.py",
                    "test_cli.py", "test_rotary.py", "test_cross.py",
                    "test_target_resolution.py", "test_x86_codegen.py", "test_hf_optimize.py",
                    "test_varlen.py", "test_hf_seq2seq.py", "test_from_torch.py",
                    "test_paged.py", "test_attention_core.py", "test_decode_varlen.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
