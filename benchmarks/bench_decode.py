#!/usr/bin/env python
"""Benchmark one KV-cache decode step of a whole layer against peers, in one process.

A decode step: one new token per sequence; its Q/K/V projections, its K/V appended to a cache
that already holds `cache - 1` tokens, attention over all `cache` tokens, the output
projection. Every implementation keeps its own cache with the same contents and the same
weights, and is checked against the float64 reference (mhagen's, with a float64 cache)
before timing:

  mhagen          mhagen.build(mhagen.mha(D, H, kv_cache=N, causal=True), seq_len=1):
                  QKV GEMM, cache append, split-KV attention, output GEMM
  torch_sdpa      Linear(QKV) -> cache[:, :, L] = k, v -> F.scaled_dot_product_attention over
                  cache[:, :, :L+1] -> Linear (the cache preallocated, as mhagen's)
  ort_attention   ONNX Runtime: MatMul(QKV) -> opset-23 Attention(q, k, v, past_key,
                  past_value) -> MatMul; ONNX's past/present form copies the cache into
                  present_key/present_value on every step (that is how the op is defined)

Timing interleaves the implementations in rounds (medians). "GB/s" is the bytes one step
must read at least (every weight once, the whole K/V cache once) over its time; "% read bw"
compares that with a plain read of a 512 MiB array by torch in the same run (the machine's
memory bandwidth at that thread count).

Run: python benchmarks/bench_decode.py [--target x86] [--threads 1,2] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402  (shared helpers: weights layouts, timing, threads)

import mhagen  # noqa: E402
from mhagen.tolerances import max_error, tolerance  # noqa: E402


def random_cache(cache, seed=1):
    """Fill a KVCache (any dtype) with the same random keys/values for every implementation."""
    rng = np.random.default_rng(seed)
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    return cache


class MhagenStep:
    def __init__(self, layer, w, batch, past, target):
        self.module = mhagen.build(layer, target, batch=batch, seq_len=1, weights=w)
        self.cache = random_cache(self.module.new_cache())
        self.past = past

    def __call__(self, x):
        self.cache.lens[...] = self.past          # every timed step appends at the same place
        return self.module(x, cache=self.cache)


class TorchStep:
    def __init__(self, layer, w, batch, past, target=None):
        import torch
        import torch.nn.functional as F
        self.torch, self.sdpa = torch, F.scaled_dot_product_attention
        self.heads, d_model, self.head_dim = w["w_q"].shape
        w_in, b_in = bm.torch_in_proj(w)
        w_out, b_out = bm.torch_out_proj(w)
        self.w_in, self.b_in = torch.from_numpy(w_in), torch.from_numpy(b_in)
        self.w_out, self.b_out = torch.from_numpy(w_out), torch.from_numpy(b_out)
        ref = random_cache(mhagen.KVCache.empty(layer, batch))
        self.k, self.v = torch.from_numpy(ref.k.copy()), torch.from_numpy(ref.v.copy())
        self.past = past

    def __call__(self, x):
        torch, L = self.torch, self.past
        with torch.inference_mode():
            t = torch.from_numpy(x)
            b = t.shape[0]
            qkv = torch.nn.functional.linear(t, self.w_in, self.b_in)
            q, k, v = qkv.view(b, 1, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            self.k[:, :, L] = k[:, :, 0]
            self.v[:, :, L] = v[:, :, 0]
            o = self.sdpa(q, self.k[:, :, :L + 1], self.v[:, :, :L + 1])
            y = torch.nn.functional.linear(o.transpose(1, 2).reshape(b, 1, -1), self.w_out,
                                           self.b_out)
            return y.numpy()


def ort_decode_model(w, batch, past):
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    heads, d_model, head_dim = w["w_q"].shape
    width = heads * head_dim
    w_qkv, b_qkv = bm.packed_qkv(w)
    inits = [numpy_helper.from_array(w_qkv, "w_qkv"), numpy_helper.from_array(b_qkv, "b_qkv"),
             numpy_helper.from_array(np.ascontiguousarray(w["w_o"], np.float32), "w_o"),
             numpy_helper.from_array(np.asarray(w["b_o"], np.float32), "b_o"),
             numpy_helper.from_array(np.array([width] * 3, np.int64), "split")]
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv"]),
             helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1),
             helper.make_node("Attention", ["q", "k", "v", "", "past_key", "past_value"],
                              ["attn", "present_key", "present_value"], q_num_heads=heads,
                              kv_num_heads=heads),
             helper.make_node("MatMul", ["attn", "w_o"], ["y0"]),
             helper.make_node("Add", ["y0", "b_o"], ["y"])]
    cache = [batch, heads, past, head_dim]
    graph = helper.make_graph(
        nodes, "mha_decode",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 1, d_model]),
         helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 1, d_model])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


class OrtStep:
    def __init__(self, layer, w, batch, past, target=None, threads=1):
        self.session = bm.ort_session(ort_decode_model(w, batch, past), threads)
        ref = random_cache(mhagen.KVCache.empty(layer, batch))
        self.feeds = {"past_key": np.ascontiguousarray(ref.k[:, :, :past]),
                      "past_value": np.ascontiguousarray(ref.v[:, :, :past])}

    def __call__(self, x):
        return self.session.run(["y"], dict(self.feeds, x=x))[0]


def read_bandwidth(threads):
    """GB/s of summing a 512 MiB float32 array with torch at `threads` threads (median of 5)."""
    import time

    import torch
    torch.set_num_threads(threads)
    a = torch.ones(128 * 1024 * 1024)
    a.sum()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        runs.append(time.perf_counter() - t0)
    return a.numel() * 4 / float(np.median(runs)) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="x86")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--cache", type=int, default=2048, help="tokens in the cache after the step")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--peers", default="torch_sdpa,ort_attention")
    p.add_argument("--gap-ms", type=float, default=bm.GAP_MS,
                   help="idle gap before each implementation's turn when threads > 1 (other "
                   "libraries' worker threads stop spinning), as bench_mha.py")
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    args = p.parse_args(argv)
    bm.runnable_target(p, args.target)
    bm.TARGET = args.target
    D, H, N, B = args.d_model, args.heads, args.cache, args.batch
    past = N - 1
    layer = mhagen.mha(D, H, kv_cache=N, causal=True)
    w = layer.init_weights(0)
    x = bm.make_input(B, 1, D, seed=3)

    ref_cache = random_cache(mhagen.KVCache.empty(layer, B, np.float64))
    ref_cache.lens[...] = past
    expected = layer.reference(x, w, cache=ref_cache)
    d = D // H
    bytes_read = 4 * (4 * D * H * d + 4 * D) + 4 * 2 * B * H * N * d
    peers = [s for s in args.peers.split(",") if s]
    rows, status = [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        bm.set_threads(threads)
        impls = {"mhagen": MhagenStep(layer, w, B, past, args.target)}
        for name in peers:
            try:
                impls[name] = (TorchStep(layer, w, B, past) if name == "torch_sdpa" else
                               OrtStep(layer, w, B, past, threads=threads))
            except Exception as err:           # a peer that cannot run is reported, not fatal
                status[name] = f"unavailable: {err}"
        checked = {}
        for name, f in impls.items():
            err, tol = max_error(f(x), expected), tolerance(expected)
            status.setdefault(name, f"max error {err:.3g} (tolerance {tol:.3g})")
            if err <= tol:
                checked[name] = f
            elif name == "mhagen":
                raise SystemExit(f"mhagen decode step is wrong: max error {err:.3g} > {tol:.3g}")
            else:
                status[name] = f"excluded: max error {err:.3g} > tolerance {tol:.3g}"
        est = {n: 1e-3 for n in checked}
        samples, _ = bm.time_interleaved(checked, x, est, args.rounds, 0.05,
                                         args.gap_ms / 1e3 if threads > 1 else 0.0)
        bw = read_bandwidth(threads)
        med = {n: float(np.median(s)) for n, s in samples.items()}
        fastest_peer = min((n for n in med if n != "mhagen"), key=med.get, default=None)
        for n, t in med.items():
            rows.append({"threads": threads, "impl": n, "ms": t * 1e3,
                         "gb_s": bytes_read / t / 1e9,
                         "read_bw_share": bytes_read / t / 1e9 / bw, "read_bw_gb_s": bw,
                         "vs_fastest_peer": (t / med[fastest_peer]) if fastest_peer else None})
    meta = {"shape": f"batch {B}, d_model {D}, {H} heads, cache {N} (one new token)",
            "target": args.target, "bytes_read": bytes_read, "status": status,
            "cpu": bm.cpu_summary(),
            "env": {k: os.environ[k] for k in ("MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE",
                                               "TVM_NUM_THREADS") if k in os.environ}}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        bm.save_results(args.out, {"meta": meta, "rows": rows}, text)
    return 0


def markdown(rows, meta):
    lines = [f"Decode step: {meta['shape']}; target {meta['target']}; "
             f"{meta['bytes_read'] / 1e6:.1f} MB read at least per step",
             "", "| threads | impl | ms | GB/s | % read bw | / fastest peer |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "—" if r["vs_fastest_peer"] is None or r["impl"] != "mhagen" else \
            f"{r['vs_fastest_peer']:.2f}"
        lines.append(f"| {r['threads']} | {r['impl']} | {r['ms']:.3f} | {r['gb_s']:.1f} | "
                     f"{100 * r['read_bw_share']:.0f}% | {ratio} |")
    lines.append("")
    lines += [f"- {n}: {s}" for n, s in meta["status"].items()]
    bws = sorted({(r['threads'], r['read_bw_gb_s']) for r in rows})
    lines.append(f"- CPU: {meta['cpu']}")
    if meta["env"]:
        lines.append(f"- environment: {meta['env']}")
    lines.append("- read bandwidth (torch sum of 512 MiB): " + ", ".join(
        f"{bw:.1f} GB/s at {t} thread{'s' * (t > 1)}" for t, bw in bws))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
