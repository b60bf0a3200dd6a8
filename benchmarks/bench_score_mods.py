#!/usr/bin/env python
"""Benchmark layers with score modifiers (ALiBi, softcap, T5's relative bias) against the same
layer without one and against PyTorch's CPU paths for them, in one process.

Every implementation computes the whole layer in float32 (QKV projections, attention with the
modifier, output projection) with the same weights, and is checked against the float64
reference (layer.reference) before timing:

  mhagen          the layer with the modifier (applied in the fused kernel's score tile)
  mhagen_plain    the same layer without a modifier (the cost of the modifier is the ratio)
  torch_sdpa      Linear(QKV) -> F.scaled_dot_product_attention with an explicit float bias
                  mask (ALiBi's slope * (j - i), or T5's table[h, bucket(j - i)]; -inf
                  above the diagonal when causal) ->
                  Linear; SDPA cannot express softcap (a function of the score), so no row
  torch_eager     Linear(QKV) -> Q K^T * scale -> modifier (ALiBi bias add, or
                  cap * tanh(s / cap)) -> mask -> softmax -> @ V -> Linear, in torch ops
  flex_attention  torch.compile(flex_attention) with the modifier as its score_mod, where
                  it compiles on this machine's CPU (else reported as unavailable)

Timing interleaves the implementations in rounds (medians), as benchmarks/bench_mha.py.

Run: python benchmarks/bench_score_mods.py [--shape 1x2048x1024x16] [--threads 1,2]
                                           [--mods alibi,softcap,relative_bias] [--causal]
                                           [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402

import mhagen  # noqa: E402
from mhagen.ir.expr import alibi_slopes, t5_bucket  # noqa: E402

SOFTCAP = 30.0      # Gemma 2's attention softcap
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128     # T5's defaults


def t5_table(heads):
    return np.random.default_rng(7).standard_normal((heads, T5_BUCKETS)).astype(np.float32)


def modifier(kind, heads):
    if kind == "relative_bias":
        return mhagen.relative_bias(t5_table(heads), max_distance=T5_MAX_DISTANCE)
    return {"alibi": mhagen.alibi(heads), "softcap": mhagen.softcap(SOFTCAP)}[kind]


def t5_buckets(seq):
    """bucket(d) for d = kv_idx - q_idx in [-(seq-1), seq-1], at index d + seq - 1."""
    return np.array([t5_bucket(d, T5_BUCKETS, T5_MAX_DISTANCE, True)
                     for d in range(1 - seq, seq)])


class TorchLayer:
    """The layer in torch ops (eager, or SDPA with a float bias mask)."""

    def __init__(self, w, seq, kind, causal, sdpa):
        import torch
        self.torch = torch
        self.heads, _, self.d = w["w_q"].shape
        w_in, b_in = bm.torch_in_proj(w)
        w_out, b_out = bm.torch_out_proj(w)
        self.w_in, self.b_in = torch.from_numpy(w_in), torch.from_numpy(b_in)
        self.w_out, self.b_out = torch.from_numpy(w_out), torch.from_numpy(b_out)
        self.kind, self.causal, self.sdpa = kind, causal, sdpa
        i = torch.arange(seq)
        hidden = (i[None, :] > i[:, None]) if causal else torch.zeros(seq, seq, dtype=bool)
        self.hidden = hidden
        if kind == "alibi":
            slopes = torch.tensor(alibi_slopes(self.heads), dtype=torch.float32)
            bias = slopes[:, None, None] * (i[None, :] - i[:, None]).float()[None]
            self.bias = bias.masked_fill(hidden[None], float("-inf"))       # [H, S, S]
        elif kind == "relative_bias":
            table = torch.from_numpy(t5_table(self.heads))
            buckets = torch.from_numpy(t5_buckets(seq))[i[None, :] - i[:, None] + seq - 1]
            self.bias = table[:, buckets].masked_fill(hidden[None], float("-inf"))
        elif sdpa:
            raise ValueError("SDPA cannot carry softcap (a function of the score)")

    def attend(self, q, k, v):
        torch = self.torch
        if self.sdpa:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                    attn_mask=self.bias)
        s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(self.d))
        if self.kind in ("alibi", "relative_bias"):
            s = s + self.bias
        else:
            s = SOFTCAP * torch.tanh(s / SOFTCAP)
            s = s.masked_fill(self.hidden, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    def __call__(self, x):
        torch, F = self.torch, self.torch.nn.functional
        with torch.inference_mode():
            t = torch.from_numpy(x)
            b, s, _ = t.shape
            qkv = F.linear(t, self.w_in, self.b_in)
            q, k, v = qkv.view(b, s, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
            o = self.attend(q, k, v)
            y = F.linear(o.transpose(1, 2).reshape(b, s, -1), self.w_out, self.b_out)
            return y.numpy()


class FlexLayer(TorchLayer):
    def __init__(self, w, seq, kind, causal, sdpa=False):
        super().__init__(w, seq, kind, causal, False)
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        slopes = torch.tensor(alibi_slopes(self.heads), dtype=torch.float32)
        table = torch.from_numpy(t5_table(self.heads))
        buckets = torch.from_numpy(t5_buckets(seq))

        def score_mod(score, b, h, q_idx, kv_idx):
            if kind == "alibi":
                return score + slopes[h] * (kv_idx - q_idx)
            if kind == "relative_bias":
                return score + table[h, buckets[kv_idx - q_idx + seq - 1]]
            return SOFTCAP * torch.tanh(score / SOFTCAP)
        self.block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, seq, seq,
                                            device="cpu") if causal else None
        self.flex = torch.compile(flex_attention)
        self.score_mod = score_mod

    def attend(self, q, k, v):
        return self.flex(q.contiguous(), k.contiguous(), v.contiguous(),
                         score_mod=self.score_mod, block_mask=self.block_mask)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="x86")
    p.add_argument("--shape", type=bm.parse_shape, default=bm.parse_shape("1x2048x1024x16"))
    p.add_argument("--mods", default="alibi,softcap,relative_bias")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gap-ms", type=float, default=100.0)
    p.add_argument("--peers", default="torch_sdpa,torch_eager,flex_attention")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    bm.runnable_target(p, args.target)
    B, S, D, H = args.shape
    x = bm.make_input(B, S, D)
    rows, status = [], {}
    for kind in [m for m in args.mods.split(",") if m]:
        layer = mhagen.mha(D, H, causal=args.causal, score_mod=modifier(kind, H))
        plain = mhagen.mha(D, H, causal=args.causal)
        w = layer.init_weights(0)
        expected = layer.reference(x, w)
        plain_ref = plain.reference(x, w)
        for threads in [int(t) for t in args.threads.split(",")]:
            bm.set_threads(threads)
            impls = {"mhagen": mhagen.build(layer, args.target, batch=B, seq_len=S, weights=w),
                     "mhagen_plain": mhagen.build(plain, args.target, batch=B, seq_len=S,
                                                  weights=w)}
            for name in [n for n in args.peers.split(",") if n]:
                try:
                    impls[name] = {"torch_sdpa": TorchLayer, "torch_eager": TorchLayer,
                                   "flex_attention": FlexLayer}[name](
                        w, S, kind, args.causal, name == "torch_sdpa")
                    if name == "flex_attention":
                        impls[name](x)    # compile (may fail on CPU)
                except Exception as err:     # a peer that cannot run is reported, not fatal
                    impls.pop(name, None)
                    status[f"{kind} {name}"] = f"unavailable: {type(err).__name__}: " \
                                               f"{str(err).splitlines()[0][:120] if str(err) else ''}"
            checked = bm.checked_impls(
                impls, x, lambda name: plain_ref if name == "mhagen_plain" else expected,
                status, label=f"{kind} {{}}")
            samples, _ = bm.time_interleaved(checked, x, {n: 0.05 for n in checked},
                                             args.rounds, 0.2,
                                             args.gap_ms / 1e3 if threads > 1 else 0.0)
            med = {n: float(np.median(v)) for n, v in samples.items()}
            peers = [n for n in med if not n.startswith("mhagen")]
            fastest = min(peers, key=med.get) if peers else None
            for n, t in med.items():
                rows.append({"mod": kind, "threads": threads, "impl": n, "ms": t * 1e3,
                             "vs_plain": t / med["mhagen_plain"],
                             "vs_fastest_peer": t / med[fastest] if fastest else None,
                             "fastest_peer": fastest})
    text = markdown(rows, status, args)
    print(text)
    if args.out:
        bm.save_results(args.out, {"rows": rows, "status": status}, text)
    return 0


def markdown(rows, status, args):
    B, S, D, H = args.shape
    lines = [f"Score modifiers, layer {B}x{S}x{D}x{H} (batch x seq x d_model x heads), "
             f"{'causal' if args.causal else 'no mask'}, target {args.target}; medians in ms",
             "", "| modifier | threads | impl | ms | / mhagen_plain | / fastest peer |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        peer = "—" if r["vs_fastest_peer"] is None else f"{r['vs_fastest_peer']:.2f}"
        lines.append(f"| {r['mod']} | {r['threads']} | {r['impl']} | {r['ms']:.2f} | "
                     f"{r['vs_plain']:.2f} | {peer} |")
    lines.append("")
    lines += [f"- {k}: {v}" for k, v in status.items()]
    lines.append(f"- CPU: {bm.cpu_summary()}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
