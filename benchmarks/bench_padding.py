#!/usr/bin/env python
"""Benchmark a batch of sequences of different lengths (key padding) against peers, in one
process.

A prefill batch padded to its longest row: x [B, S, D] with each row's real length given at
call time; a row's keys past its length are padding and are not attended to (its queries
there are computed, as every peer computes them). Every implementation computes the whole
layer in float32 with the same weights and is checked against the float64 reference before
timing:

  mhagen          mhagen.build(mhagen.mha(D, H, key_padding=True[, causal]), ...) called as
                  module(x, kv_lens=lens): key blocks past a row's length are skipped
  mhagen_dense    the same layer without key padding on the same x: what the padded batch
                  costs when every key is attended to (not a contender: its answer differs,
                  it is checked against its own reference)
  torch_sdpa      Linear(QKV) -> F.scaled_dot_product_attention(attn_mask = the rows' key
                  masks [B, 1, 1, S], & the causal triangle) -> Linear
  ort_mha         ONNX Runtime com.microsoft.MultiHeadAttention with key_padding_mask
                  int32 [B, S] (unidirectional when causal)
  ort_attention   ONNX Runtime opset-23 Attention with attn_mask bool [B, 1, S, S] (the
                  rows' key masks spelt out over the queries; is_causal when causal)

Timing interleaves the implementations in rounds (medians), as benchmarks/bench_mha.py.
GFLOP/s counts the work the rows' lengths leave (projections of every row, attention over
the seen keys only), the same count for every implementation.

Run: python benchmarks/bench_padding.py [--shape 4x512x768x12] [--lens 512,400,200,100]
                                        [--causal] [--threads 1,2] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402

import mhagen  # noqa: E402


def seen_keys(lens, seq, causal):
    """[B, S, S] bool: query i of row b sees key j."""
    i = np.arange(seq)
    seen = i[None, None, :] < np.asarray(lens)[:, None, None]
    return seen & (i[None, :, None] >= i[None, None, :]) if causal else \
        np.broadcast_to(seen, (len(lens), seq, seq))


def useful_flops(batch, seq, d_model, heads, lens, causal):
    """Projections of every row (4 GEMMs of D x D) and attention over the seen keys only."""
    head_dim = d_model // heads
    pairs = int(seen_keys(lens, seq, causal).sum())
    return 2 * 4 * batch * seq * d_model * heads * head_dim + 4 * heads * head_dim * pairs


class MhagenPadded:
    def __init__(self, layer, w, batch, seq, lens, target):
        self.module = mhagen.build(layer, target, batch=batch, seq_len=seq, weights=w)
        self.lens = np.asarray(lens, np.int32)

    def __call__(self, x):
        return self.module(x, kv_lens=self.lens)


class TorchPadded(bm.TorchSDPA):
    """bench_mha's torch_sdpa with the rows' key masks [B, 1, 1, S] (& the causal
    triangle) as SDPA's attn_mask."""

    def __init__(self, layer, w, batch, seq, lens, causal):
        super().__init__(layer, w, batch, seq, causal)
        torch = self.torch
        mask = torch.from_numpy(np.ascontiguousarray(seen_keys(lens, seq, False)[:, None, :1]))
        i = torch.arange(seq)
        self.mask = mask & (i[:, None] >= i[None, :]) if causal else mask


class OrtPadded:
    def __init__(self, w, batch, seq, lens, causal, op, threads):
        self.session = bm.ort_session(bm.onnx_model(w, batch, seq, causal, op, key_mask=True),
                                      threads)
        seen = seen_keys(lens, seq, False)      # every query row alike
        # Attention's mask must spell out the query axis (ORT 1.32 broadcasts heads only)
        self.mask = seen[:, 0].astype(np.int32) if op == "ort_mha" else \
            np.ascontiguousarray(seen[:, None])

    def __call__(self, x):
        return self.session.run(None, {"x": x, "key_mask": self.mask})[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="x86")
    p.add_argument("--shape", type=bm.parse_shape, default=bm.parse_shape("4x512x768x12"),
                   help="batch x seq x d_model x heads; seq is the padded length")
    p.add_argument("--lens", type=bm.lengths_arg(1, "512,400,200,100"),
                   default=[512, 400, 200, 100],
                   help="each row's length (one per batch row, each <= seq)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gap-ms", type=float, default=bm.GAP_MS)
    p.add_argument("--peers", default="torch_sdpa,ort_mha,ort_attention")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    bm.runnable_target(p, args.target)
    B, S, D, H = args.shape
    if len(args.lens) != B or max(args.lens) > S:
        p.error(f"--lens {','.join(map(str, args.lens))}: give {B} lengths (one per batch "
                f"row of --shape), each at most seq {S}")
    lens = args.lens
    layer = mhagen.mha(D, H, causal=args.causal, key_padding=True)
    dense = mhagen.mha(D, H, causal=args.causal)
    w = layer.init_weights(0)
    x = bm.make_input(B, S, D)
    expected = layer.reference(x, w, kv_lens=np.array(lens))
    dense_ref = dense.reference(x, w)
    flops = useful_flops(B, S, D, H, lens, args.causal)
    rows, status = [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        bm.set_threads(threads)
        impls = {"mhagen": MhagenPadded(layer, w, B, S, lens, args.target),
                 "mhagen_dense": mhagen.build(dense, args.target, batch=B, seq_len=S,
                                              weights=w)}
        for name in [n for n in args.peers.split(",") if n]:
            try:
                impls[name] = (TorchPadded(layer, w, B, S, lens, args.causal)
                               if name == "torch_sdpa"
                               else OrtPadded(w, B, S, lens, args.causal, name, threads))
            except Exception as err:     # a peer that cannot run is reported, not fatal
                status[name] = f"unavailable: {type(err).__name__}: {str(err)[:120]}"
        checked = bm.checked_impls(
            impls, x, lambda name: dense_ref if name == "mhagen_dense" else expected, status)
        samples, _ = bm.time_interleaved(checked, x, {n: 0.05 for n in checked}, args.rounds,
                                         0.2, args.gap_ms / 1e3 if threads > 1 else 0.0)
        med = {n: float(np.median(v)) for n, v in samples.items()}
        peers = [n for n in med if not n.startswith("mhagen")]
        fastest = min(peers, key=med.get) if peers else None
        for n, t in med.items():
            rows.append({"threads": threads, "impl": n, "ms": t * 1e3, "gflops": flops / t / 1e9,
                         "vs_fastest_peer": t / med[fastest] if fastest else None,
                         "fastest_peer": fastest})
    meta = {"shape": list(args.shape), "lens": lens, "causal": args.causal,
            "target": args.target, "useful_flops": flops, "status": status,
            "cpu": bm.cpu_summary()}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        bm.save_results(args.out, {"meta": meta, "rows": rows}, text)
    return 0


def markdown(rows, meta):
    B, S, D, H = meta["shape"]
    lines = [f"Key padding: layer {B}x{S}x{D}x{H} (batch x seq x d_model x heads), rows of "
             f"{', '.join(map(str, meta['lens']))} tokens, "
             f"{'causal' if meta['causal'] else 'no other mask'}, target {meta['target']}; "
             f"medians in ms; GFLOP/s of the {meta['useful_flops'] / 1e9:.2f} GFLOP the "
             "lengths leave", "",
             "| threads | impl | ms | GFLOP/s | / fastest peer |", "|---|---|---:|---:|---:|"]
    for r in rows:
        peer = "—" if r["vs_fastest_peer"] is None or r["impl"] != "mhagen" else \
            f"{r['vs_fastest_peer']:.2f}"
        lines.append(f"| {r['threads']} | {r['impl']} | {r['ms']:.2f} | {r['gflops']:.1f} | "
                     f"{peer} |")
    lines.append("")
    lines += [f"- {k}: {v}" for k, v in meta["status"].items()]
    lines.append(f"- CPU: {meta['cpu']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
