"""The textbook layer ("Attention Is All You Need"): d_model 512, 8 heads of 64 dims.

Random weights, compiled for x86, checked against the float64 reference and timed.

Run: python examples/textbook_512x8.py [--seq-len 128] [--batch 1] [--causal]
"""
from __future__ import annotations

import argparse
import re
import sys

import numpy as np

import mhagen

MAX_ERROR = 1e-4


def graph_summary(layer) -> str:
    """str(layer) cut to the header, head 0's nodes, and the merge (heads 1-7 repeat head 0)."""
    lines = str(layer).splitlines()
    keep = [lines[0]]
    for line in lines[1:]:
        name = line.split()[0].lstrip("%")
        if name in ("x", "concat", "y", "return") or re.fullmatch(r"[a-z]+0", name):
            keep.append(line)
    keep.insert(-3, f"  ... heads 1-7: the same nodes with their own weights "
                    f"({len(lines) - len(keep)} lines)")
    return "\n".join(keep)


def run(batch=1, seq_len=128, causal=False, seed=0) -> dict:
    """Build and check the layer; returns what main() prints."""
    layer = mhagen.mha(512, 8, head_dim=64, causal=causal)
    w = layer.init_weights(seed)
    x = np.random.default_rng(seed).standard_normal((batch, seq_len, 512)).astype(np.float32)
    kernel = mhagen.build(layer, target="x86", batch=batch, seq_len=seq_len, weights=w)
    error = mhagen.max_error(kernel(x), layer.reference(x, w))
    latency = kernel.latency(x)
    return {"layer": layer, "error": error, "latency": latency, "flops": kernel.flops(),
            "gflops": kernel.flops() / latency / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--causal", action="store_true", help="query i sees keys 0..i only")
    args = ap.parse_args(argv)

    r = run(args.batch, args.seq_len, args.causal)
    print(graph_summary(r["layer"]))
    print()
    print(f"shape:      x [{args.batch}, {args.seq_len}, 512], causal={args.causal}")
    print(f"max error:  {r['error']:.2e} vs float64 reference")
    print(f"latency:    {r['latency'] * 1e3:.3f} ms (median)")
    print(f"throughput: {r['gflops']:.1f} GFLOP/s ({r['flops'] / 1e9:.3f} GFLOP per call)")
    if not r["error"] <= MAX_ERROR:
        print(f"FAIL: max error {r['error']:.2e} > {MAX_ERROR:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
