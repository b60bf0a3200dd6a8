#!/usr/bin/env python
"""Per-kernel time of many layer shapes built for two x86 classes on this host, their ratio,
largest first: a scan for performance cliffs of one class (a kernel far slower than the
other class's on the same layer) beyond the benchmark shapes.

On an AVX-512 host the AVX2 code (`x86-avx2`) and the AVX-512 code run on the same cores (on a
Zen 4, the same 256-bit pipes), so most kernels come out at 1.0-1.1x; a ratio far above
that is a schedule to read (on December 5 this scan found GEMMs of 15-112 rows at half speed
on AVX2, RoPE 6x slower on AVX-512 at seq 256, decode steps' GEMMs and 12-row decode tiles
on AVX2, sliding windows in too-wide tiles; docs/cpus-and-tuning.md). Every module is
checked against the float64 reference first. Then each kernel of the two builds runs in
paired turns (paired_ratios): the two alternate, each turn the best of 3 batches of ~4 ms,
and the ratio is the median of --rounds per-turn ratios, with its quartiles. At 1 thread the
process is pinned to one CPU (--cpu): on a VM whose cores another tenant slows apart, that
gave quartiles ~3% apart where medians of longer unpinned turns had moved 10% between runs
(Zen 4, December 6). Rerun what stands out.

Run: python benchmarks/class_ratios.py [--classes x86-avx2 x86] [--threads 1] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402  (shared helpers: targets that run here, threads)

import mhagen  # noqa: E402

clock = time.perf_counter   # (a test replaces it)


def layers(quick=False):
    """(name, mha options, batch, seq) of the scan."""
    out = [(f"hd{hd} 8h s256 {m}", dict(d_model=8 * hd, num_heads=8, head_dim=hd,
                                         causal=m == "causal"), 1, 256)
           for hd in (32, 40, 64, 80, 96, 128) for m in ("none", "causal")]
    out += [(f"16h/{g}kv s256 causal", dict(d_model=1024, num_heads=16, kv_heads=g,
                                            causal=True), 1, 256) for g in (8, 2, 1)]
    out += [(f"512x8 s{s}", dict(d_model=512, num_heads=8), 1, s) for s in (17, 64, 97, 513)]
    out += [("512x8 s256 rotary", dict(d_model=512, num_heads=8, causal=True, rotary=True),
             1, 256),
            ("512x8 s256 alibi+softcap", dict(d_model=512, num_heads=8, causal=True,
                                              score_mod=[mhagen.alibi(8),
                                                         mhagen.softcap(30.0)]), 1, 256),
            ("512x8 s256 window64", dict(d_model=512, num_heads=8,
                                         mask=mhagen.sliding_window(64)), 1, 256),
            ("512x8 b4 s97 padding", dict(d_model=512, num_heads=8, key_padding=True), 4, 97),
            ("512x8 s256 bfloat16", dict(d_model=512, num_heads=8, dtype="bfloat16"), 1, 256)]
    out += [(f"decode {h}h/{g}kv hd{hd} b2", dict(d_model=h * hd, num_heads=h, kv_heads=g,
                                                  head_dim=hd, causal=True, kv_cache=1024),
             2, 1)
            for h, g, hd in ((16, 16, 64), (16, 4, 64), (16, 1, 64), (12, 1, 64), (6, 1, 64),
                             (20, 2, 64), (8, 8, 40), (8, 1, 80), (32, 8, 128))]
    out += [("decode 8h/2kv prompt 64", dict(d_model=512, num_heads=8, kv_heads=2, causal=True,
                                              kv_cache=1024), 1, 64)]
    if quick:
        return [out[0], out[-1]]
    return out


def kernel_calls(module):
    """kernel name -> a call of that kernel alone, on the arrays of one prepared call
    (Module.prepare) run once: a decoding layer's kernels then append at the same place of
    a cache full up to its last seq_len rows every time (the staged cache lengths stay)."""
    x = mhagen.aligned_empty(module.in_shape, module.dtype)
    x[...] = np.random.default_rng(0).standard_normal(module.in_shape).astype(module.dtype)
    cache = kv_lens = None
    if module.graph.cache_lens_input is not None:
        cache = module.new_cache()
        cache.lens[...] = cache.max_len - module.seq_len
    if module.graph.lengths_input is not None:
        kv_lens = np.full(module.batch, module.seq_len, np.int32)
    call = module.prepare(x, kv_lens=kv_lens, cache=cache)
    call()
    return {k.name: (lambda f=func, a=args: f(*a))
            for k, (func, args) in zip(module.program.kernels, call.kernels)}


def paired_ratios(call_a, call_b, rounds, batch_s=0.004):
    """(a / b per round, (median seconds of a, of b)): a and b alternate, the order flipped
    every round; each turn is the best of 3 batches of calls (as many as take ~batch_s), so
    a turn that the host slowed counts once, against its neighbour, not in a long median."""
    for call in (call_a, call_b):   # warm: caches, TVM's pool
        call()
    start = clock()
    call_a()
    reps = max(1, int(batch_s / max(clock() - start, 1e-7)))

    def turn(call):
        best = float("inf")
        for _ in range(3):
            start = clock()
            for _ in range(reps):
                call()
            best = min(best, (clock() - start) / reps)
        return best
    times = []
    for r in range(rounds):
        if r % 2:
            b = turn(call_b)
            times.append((turn(call_a), b))
        else:
            times.append((turn(call_a), turn(call_b)))
    t = np.array(times)
    return t[:, 0] / t[:, 1], (float(np.median(t[:, 0])), float(np.median(t[:, 1])))


def pin_to_cpu(cpu):
    """Pin this process's calling thread to `cpu` (None: the first it may use); returns the
    CPU, or None where Python cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0)) if cpu is None else cpu
    os.sched_setaffinity(0, {cpu})
    return cpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", nargs=2, default=["x86-avx2", "x86"], metavar=("A", "B"),
                   help="targets to compare: the ratio is A's time over B's")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=40, help="paired turns per kernel")
    p.add_argument("--cpu", type=int, default=None,
                   help="the CPU a 1-thread scan is pinned to (default: the first usable)")
    p.add_argument("--quick", action="store_true", help="two layers, 5 rounds (a smoke test)")
    p.add_argument("--top", type=int, default=25, help="rows of the sorted table")
    args = p.parse_args(argv)
    targets = [bm.runnable_target(p, name) for name in args.classes]
    if targets[0].cpu_class == targets[1].cpu_class:
        p.error(f"--classes {args.classes[0]} {args.classes[1]}: both are "
                f"{targets[0].cpu_class} on this host; compare two classes it runs")
    rounds = 5 if args.quick else args.rounds
    bm.set_threads(args.threads)
    pinned = pin_to_cpu(args.cpu) if args.threads == 1 else None
    a_name, b_name = args.classes
    print(f"{a_name} / {b_name} per kernel, {args.threads} thread(s), {rounds} paired "
          f"rounds{'' if pinned is None else f', pinned to CPU {pinned}'}; "
          f"host {mhagen.target.host_cpu_name('x86_64')}")
    rows = []
    for name, options, batch, seq in layers(args.quick):
        layer = mhagen.mha(**options)
        w = layer.init_weights(0)
        built = []
        for t in targets:
            m = mhagen.build(layer, t.name, batch=batch, seq_len=seq, weights=w, tuning=None)
            x = np.random.default_rng(1).standard_normal(m.in_shape).astype(np.float32)
            kw = {}
            if m.graph.cache_lens_input is not None:
                kw["cache"] = m.new_cache()
                ref = layer.reference(x, w, cache=m.new_cache())
            elif m.graph.lengths_input is not None:
                kw["kv_lens"] = np.full(batch, seq, np.int32)
                ref = layer.reference(x, w, kv_lens=kw["kv_lens"])
            else:
                ref = layer.reference(x, w)
            mhagen.tolerances.assert_close(m(x, **kw), ref, mhagen.tolerances.judged_as(layer))
            built.append(kernel_calls(m))
        for k in built[0]:
            r, (a, b) = paired_ratios(built[0][k], built[1][k], rounds)
            spread = f"[{np.percentile(r, 25):.2f}-{np.percentile(r, 75):.2f}]"
            rows.append((float(np.median(r)), spread, name, k, a, b))
            print(f"{np.median(r):5.2f} {spread}  {name:28s} {k:18s} {a_name} {a * 1e6:9.1f} "
                  f"us  {b_name} {b * 1e6:9.1f} us", flush=True)
    print(f"\nlargest {a_name} / {b_name} (median [quartiles]):")
    for r, spread, name, k, a, b in sorted(rows, reverse=True)[:args.top]:
        print(f"{r:5.2f} {spread}  {name:28s} {k:18s} {a * 1e6:9.1f} us  {b * 1e6:9.1f} us")
    return rows


if __name__ == "__main__":
    main()
