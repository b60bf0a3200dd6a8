"""Kernels on several threads. `make test` gives each xdist worker one TVM thread on a
2-core machine (tests/conftest.py), so the parallel loops' split across threads is checked
here: a subprocess with a pool of at least 2 threads (even on one core) runs each layout
on 1 and on every thread, both against the reference."""
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import mhagen
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from tests.conftest import x86_targets

TARGETS = x86_targets()

SCRIPT = r"""
import sys
import numpy as np
import mhagen
from mhagen.runtime import num_threads, set_num_threads
from mhagen.tolerances import assert_close

target, threads = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
cases = [   # (layer options, build options, calls: (batch, seq, key lengths or None))
    (dict(d_model=160, num_heads=4, kv_heads=2, causal=True),
     dict(batch=3, seq_len=97), [(3, 97, None)]),
    (dict(d_model=160, num_heads=4, bias=True), dict(batch=2, seq_len=45, fuse=False),
     [(2, 45, None)]),
    (dict(d_model=1024, num_heads=8),          # depth 1024: A copied into row-tile panels
     dict(batch=1, seq_len=24), [(1, 24, None)]),
    (dict(d_model=96, num_heads=3, key_padding=True, score_mod=mhagen.alibi(3)),
     dict(batch=None, max_batch=2, seq_len=None, max_seq_len=300),
     [(2, 300, [300, 17]), (1, 130, [130]), (2, 5, [0, 5])]),
    (dict(d_model=128, num_heads=4, dtype="bfloat16"), dict(batch=2, seq_len=64),
     [(2, 64, None)]),
]
for options, build, calls in cases:
    layer = mhagen.mha(**options)
    w = layer.init_weights(1)
    kernel = mhagen.build(layer, target, weights=w, **build)
    for batch, seq, lens in calls:
        x = rng.standard_normal((batch, seq, options["d_model"])).astype(np.float32)
        lens = None if lens is None else np.array(lens)
        expected = layer.reference(x, w, kv_lens=lens)
        for n in (1, threads):
            set_num_threads(n)
            assert num_threads() == n
            assert_close(kernel(x, kv_lens=lens), expected, options.get("dtype", "float32"))
    print("ok", options, build)
"""


@pytest.mark.parametrize("target", TARGETS)
def test_kernels_on_every_thread_match_the_reference(target, tmp_path):
    threads = max(2, len(os.sched_getaffinity(0)))
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, str(script), target, str(threads)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 5, r.stdout


@pytest.mark.parametrize("target", TARGETS)
def test_schedules_for_other_core_counts_match_the_reference(target):
    """The rules partition work by the target's cores (GEMM panel groups and row blocks,
    attention query tiles; decoding's shares: tests/test_decode.py); users have 3, 16 or 64
    cores where CI has 2. Each build runs on this machine's threads, and a schedule for any
    core count must stay correct."""
    rng = np.random.default_rng(0)
    cases = [(dict(d_model=512, num_heads=8), dict(batch=1, seq_len=512), [(1, 512)]),
             (dict(d_model=160, num_heads=4, kv_heads=2, causal=True), dict(batch=3, seq_len=97),
              [(3, 97)]),
             (dict(d_model=256, num_heads=4), dict(batch=None, max_batch=2, seq_len=None,
                                                   max_seq_len=600), [(2, 600), (1, 7)])]
    for cores in (3, 16, 64):
        t = dataclasses.replace(resolve(target), cores=cores)
        for options, build, calls in cases:
            layer = mhagen.mha(**options)
            w = layer.init_weights(1)
            m = mhagen.build(layer, t, weights=w, tuning=None, **build)
            for batch, seq in calls:
                x = rng.standard_normal((batch, seq, options["d_model"])).astype(np.float32)
                assert_close(m(x), layer.reference(x, w))
