"""Generate token by token with a K/V cache: a prompt's prefill, then one token per step.

A LLaMA-style layer (grouped K/V heads, rotary embeddings, causal) is built once from a
decoding graph, `mhagen.mha(..., kv_cache=max_len)`, with seq_len=None: one module takes any
number of new tokens per call (up to --max-prompt), so the prompt goes in one call and each
decode step is a run of one token through `module.prepare` (the step's arrays bound once),
all writing into one `mhagen.KVCache`. The outputs of the
prompt and of every step, side by side, must equal the same causal layer run on the whole
sequence at once (float64 reference): exits 1 if they do not.

Run: python examples/decode.py [--target x86] [--prompt 32] [--steps 16] [--max-len 256]
     [--max-prompt 64]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import mhagen
from mhagen.tolerances import max_error, tolerance


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="x86")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256, help="tokens the cache holds")
    p.add_argument("--max-prompt", type=int, help="most new tokens per call (default: the "
                   "prompt rounded up to 64, at most --max-len)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    args = p.parse_args(argv)

    style = dict(kv_heads=args.kv_heads, causal=True, rotary=True)
    layer = mhagen.mha(args.d_model, args.heads, kv_cache=args.max_len, **style)
    weights = layer.init_weights(seed=0)
    most = args.max_prompt or min(-(-args.prompt // 64) * 64, args.max_len)
    module = mhagen.build(layer, args.target, batch=1, seq_len=None, max_seq_len=most,
                          weights=weights)
    print(f"{layer!r}\n{module}")

    tokens = args.prompt + args.steps
    x = np.random.default_rng(0).standard_normal((1, tokens, args.d_model)).astype(np.float32)
    cache = module.new_cache()
    outs = [module(x[:, :args.prompt], cache=cache)]          # the prompt: one call
    token = mhagen.aligned_empty((1, 1, args.d_model))
    step = module.prepare(token, cache=cache)     # a step's arrays bound once (I/O binding)
    for t in range(args.prompt, tokens):
        token[...] = x[:, t:t + 1]                            # a decode step: one token
        outs.append(step().copy())                            # (every run reuses its output)
    generated = np.concatenate(outs, axis=1)
    print(f"cache after {args.steps} steps: {cache}")

    whole = mhagen.mha(args.d_model, args.heads, **style).reference(x, weights)
    err, tol = max_error(generated, whole), tolerance(whole)
    per_step = module.latency(x[:, -1:], cache=cache) * 1e3
    print(f"prefill + {args.steps} decode steps vs the whole sequence at once: "
          f"max error {err:.3g} (tolerance {tol:.3g})")
    print(f"decode step latency at cache length {int(cache.lens[0])}: {per_step:.3f} ms")
    if not err <= tol:
        print("MISMATCH: step-by-step generation differs from the full sequence")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
