#!/usr/bin/env python
"""Benchmark half-precision layers (float16, bfloat16 storage) against mhagen's float32 and
PyTorch in the same dtype, in one process, interleaved.

  mhagen_<dtype>      mhagen.build(mhagen.mha(D, H, dtype=<dtype>)): float32 compute, half
                      storage (mhagen/dtypes.py; the build's `precision` line says the path)
  mhagen_f32io_<dtype>  the same module called with float32 x, answering float32: the
                      library converts on the way in and out (schedules/casts.py)
  torch_sdpa_<dtype>  Linear(QKV) -> F.scaled_dot_product_attention -> Linear, every tensor
                      in <dtype> (torch's CPU kernels for that dtype)

Every implementation is checked first against the float64 reference of the same rounded input
and weights: mhagen within the tolerance table's row of its dtype, torch within
FlashAttention's criterion (2x the error of a half-precision reference,
mhagen.tolerances.within_half_reference). GFLOP/s counts 2 per multiply-add of every matmul.

Run: python benchmarks/bench_half.py [--shapes 1x512x512x8 1x2048x1024x16] [--threads 1 2]
         [--target x86] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402  (shared helpers: weights layouts, timing, threads)

import mhagen  # noqa: E402
from mhagen.dtypes import numpy_dtype  # noqa: E402
from mhagen.tolerances import max_error, tolerance, within_half_reference  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


class TorchLayer:
    """The layer in torch, every tensor in one dtype."""

    def __init__(self, w, dtype):
        import torch
        import torch.nn.functional as F
        self.torch, self.F = torch, F
        self.dt = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}[dtype]
        self.heads, _, self.head_dim = w["w_q"].shape
        w_in, b_in = bm.torch_in_proj(w)
        w_out, b_out = bm.torch_out_proj(w)
        self.w_in, self.b_in, self.w_out, self.b_out = (
            torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.dt)
            for a in (w_in, b_in, w_out, b_out))

    def tensor(self, x):
        return self.torch.from_numpy(np.asarray(x, np.float32)).to(self.dt)

    def __call__(self, t):
        torch, F = self.torch, self.F
        with torch.inference_mode():
            b, s, _ = t.shape
            qkv = F.linear(t, self.w_in, self.b_in)
            q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v)
            return F.linear(o.transpose(1, 2).reshape(b, s, -1), self.w_out, self.b_out)


def run_shape(shape, args, rows, status):
    b, s, d, h = shape
    layers = {dt: mhagen.mha(d, h, dtype=dt) for dt in DTYPES}
    w32 = layers["float32"].init_weights(0)
    x32 = bm.make_input(b, s, d, seed=3)
    flops = bm.layer_flops(layers["float32"], b, s)
    for threads in args.threads:
        bm.set_threads(threads)
        funcs, precision = {}, {}
        for dt in DTYPES:
            layer = layers[dt]
            w = {k: v.astype(numpy_dtype(dt)) for k, v in w32.items()}
            x = mhagen.aligned_empty(x32.shape, dt)     # read in place, as make_input's
            x[...] = x32.astype(numpy_dtype(dt))
            expected = layer.reference(x, w)
            m = mhagen.build(layer, args.target, batch=b, seq_len=s, weights=w)
            precision[dt] = m.precision or "float32"
            err, tol = max_error(m(x), expected), tolerance(expected, dt)
            if err > tol:
                raise SystemExit(f"mhagen {dt} is wrong at {bm.shape_name(shape)}: {err:.3g}")
            status[f"mhagen_{dt}"] = f"max error {err:.3g} (tolerance {tol:.3g})"
            funcs[f"mhagen_{dt}"] = (lambda m, x: lambda _: m(x))(m, x)
            if dt != "float32":
                # a float32 caller: x converted to the storage dtype and the answer back to
                # float32 by the library (schedules/casts.py), the same rounding as x above
                err = max_error(m(x32), expected)
                if err > tol:
                    raise SystemExit(f"mhagen {dt} from float32 is wrong at "
                                     f"{bm.shape_name(shape)}: {err:.3g}")
                status[f"mhagen_f32io_{dt}"] = f"max error {err:.3g} (tolerance {tol:.3g})"
                funcs[f"mhagen_f32io_{dt}"] = (lambda m: lambda _: m(x32))(m)
            if "torch" in args.peers:
                try:
                    t = TorchLayer(w, dt)
                    tx = t.tensor(x.astype(np.float32))
                    got = t(tx).float().numpy()
                except Exception as e:       # a peer that cannot run is reported, not fatal
                    status[f"torch_sdpa_{dt}"] = f"unavailable: {e}"
                    continue
                rounded = expected if dt == "float32" else layer.reference(x, w, rounded_to=dt)
                err, bound = within_half_reference(got, expected, rounded)
                bound = max(bound, tolerance(expected, dt))
                ok = err <= bound
                status[f"torch_sdpa_{dt}"] = (f"max error {err:.3g} (bound {bound:.3g})"
                                              + ("" if ok else ": excluded"))
                if ok:
                    funcs[f"torch_sdpa_{dt}"] = (lambda t, tx: lambda _: t(tx))(t, tx)
        est = {}
        for n, f in funcs.items():    # one timed call sets how many calls a round makes
            t0 = time.perf_counter()
            f(None)
            est[n] = time.perf_counter() - t0
        samples, _ = bm.time_interleaved(funcs, None, est, args.rounds, 0.2,
                                         args.gap_ms / 1e3 if threads > 1 else 0.0)
        med = {n: float(np.median(v)) for n, v in samples.items()}
        for n, t in med.items():
            dt = n.rsplit("_", 1)[1]
            peer = med.get(f"torch_sdpa_{dt}") if n.startswith("mhagen") else None
            rows.append({"shape": bm.shape_name(shape), "threads": threads, "impl": n,
                         "dtype": dt, "ms": t * 1e3, "gflops": flops / t / 1e9,
                         "vs_mhagen_float32": t / med["mhagen_float32"],
                         "vs_torch_same_dtype": t / peer if peer else None})
    return precision


def markdown(rows, meta):
    lines = [f"Half-precision layers; target {meta['target']}; medians of {meta['rounds']} "
             "interleaved rounds", "",
             "| shape | threads | impl | ms | GFLOP/s | / mhagen float32 | / torch same dtype |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        vs = "—" if r["vs_torch_same_dtype"] is None else f"{r['vs_torch_same_dtype']:.2f}"
        lines.append(f"| {r['shape']} | {r['threads']} | {r['impl']} | {r['ms']:.2f} | "
                     f"{r['gflops']:.1f} | {r['vs_mhagen_float32']:.2f} | {vs} |")
    lines.append("")
    lines += [f"- {n}: {s}" for n, s in meta["status"].items()]
    lines += [f"- mhagen {dt}: {p}" for dt, p in meta["precision"].items()]
    lines.append(f"- CPU: {meta['cpu']}")
    if meta["env"]:
        lines.append(f"- environment: {meta['env']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x512x512x8", "1x2048x1024x16"],
                   metavar="BxSxDxH")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--target", default="x86")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--peers", default="torch", help="torch, or '' for mhagen only")
    p.add_argument("--gap-ms", type=float, default=bm.GAP_MS,
                   help="idle gap before each turn when threads > 1 (as bench_mha.py)")
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    args = p.parse_args(argv)
    bm.runnable_target(p, args.target)
    bm.TARGET = args.target
    rows, status, precision = [], {}, {}
    for text in args.shapes:
        precision = run_shape(bm.parse_shape(text), args, rows, status)
    meta = {"target": args.target, "rounds": args.rounds, "status": status,
            "precision": precision, "cpu": bm.cpu_summary(),
            "env": {k: os.environ[k] for k in ("MKL_ENABLE_INSTRUCTIONS", "TVM_NUM_THREADS")
                    if k in os.environ}}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        bm.save_results(args.out, {"meta": meta, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
