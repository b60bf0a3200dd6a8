"""ONNX round trip: export the default layer (d_model 512, 8 heads) to ONNX, run it in
onnxruntime and in mhagen, compare both with the float64 reference and time them; then
import the ONNX model back into a mhagen graph, rebuild it and compare again.

Run: python examples/onnx_roundtrip.py [--form decomposed|fused] [--seq-len 32] [--batch 1]
                                       [--d-model 512 --heads 8] [--causal] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import mhagen
from mhagen.onnx import export_onnx, import_onnx
from mhagen.tolerances import tolerance


def ort_latency(session, x, repeat=5, min_ms=50):
    """Median seconds per onnxruntime call."""
    session.run(None, {"x": x})
    times = []
    for _ in range(repeat):
        n, start = 0, time.perf_counter()
        while n < 3 or (time.perf_counter() - start) * 1e3 < min_ms:
            session.run(None, {"x": x})
            n += 1
        times.append((time.perf_counter() - start) / n)
    return float(np.median(times))


def run(d_model=512, heads=8, batch=1, seq_len=32, causal=False, form="decomposed",
        out_dir=None, seed=0) -> dict:
    """Export, run, compare, import, rebuild; returns what main() prints."""
    layer = mhagen.mha(d_model, heads, causal=causal)
    w = layer.init_weights(seed)
    x = np.random.default_rng(seed).standard_normal((batch, seq_len, d_model)).astype(np.float32)
    expected = layer.reference(x, w)
    with tempfile.TemporaryDirectory(prefix="mhagen-onnx-") as tmp:
        path = export_onnx(layer, Path(out_dir or tmp) / f"mha-{form}.onnx", w, form=form,
                           batch=batch, seq_len=seq_len)
        return _compare(layer, w, x, expected, path, form)


def _compare(layer, w, x, expected, path, form):
    import onnxruntime as ort
    batch, seq_len = x.shape[:2]

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = session.run(None, {"x": x})[0]
    kernel = mhagen.build(layer, "x86", batch=batch, seq_len=seq_len, weights=w)
    y_mhagen = kernel(x)

    (found,) = import_onnx(path)
    rebuilt = mhagen.build(found.graph, "x86", batch=batch, seq_len=seq_len,
                           weights=found.weights)
    y_rebuilt = rebuilt(x)
    return {
        "layer": layer, "path": path, "found": found, "tolerance": tolerance(expected),
        "ort_error": mhagen.max_error(y_ort, expected),
        "mhagen_error": mhagen.max_error(y_mhagen, expected),
        "ort_vs_mhagen": mhagen.max_error(y_ort, y_mhagen),
        "rebuilt_vs_ort": mhagen.max_error(y_rebuilt, y_ort),
        "same_graph": found.graph == layer,
        "weights_error": max(float(np.max(np.abs(found.weights[k] - w[k]))) for k in w),
        "ort_latency": ort_latency(session, x), "mhagen_latency": kernel.latency(x),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", choices=("decomposed", "fused"), default="decomposed")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", type=Path, help="keep the .onnx file here (default: a temp dir)")
    args = ap.parse_args(argv)

    r = run(args.d_model, args.heads, args.batch, args.seq_len, args.causal, args.form, args.out)
    print(f"exported {r['layer']!r}\n  as {r['path']} ({args.form} form"
          + ("" if args.out else "; a temporary file, --out DIR keeps it") + ")")
    print(f"input x [{args.batch}, {args.seq_len}, {args.d_model}]; tolerance "
          f"{r['tolerance']:.1e}")
    print(f"onnxruntime vs reference max error: {r['ort_error']:.2e}")
    print(f"mhagen      vs reference max error: {r['mhagen_error']:.2e}")
    print(f"onnxruntime vs mhagen    max error: {r['ort_vs_mhagen']:.2e}")
    print(f"latency: onnxruntime {r['ort_latency'] * 1e3:.3f} ms, "
          f"mhagen {r['mhagen_latency'] * 1e3:.3f} ms (median)")
    print(f"imported back: {r['found']}")
    print(f"  same graph as exported: {r['same_graph']}; weights within "
          f"{r['weights_error']:.1e}")
    print(f"rebuilt mhagen vs onnxruntime max error: {r['rebuilt_vs_ort']:.2e}")
    worst = max(r["ort_error"], r["mhagen_error"], r["rebuilt_vs_ort"])
    if not (worst <= r["tolerance"] and r["same_graph"]):
        print(f"FAIL: max error {worst:.2e} (tolerance {r['tolerance']:.1e}), same graph "
              f"{r['same_graph']}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
