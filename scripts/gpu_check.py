"""Check mhagen's CUDA artifacts on a GPU machine: correctness against the float64 reference and
the fused attention's speed against PyTorch's scaled_dot_product_attention (flash backend).

Two steps, on two machines (scripts/gpu_check.sh wraps them):

  prepare  here, where mhagen, TVM and nvcc are: builds the CUDA artifacts into a bundle (at
           most 64 MiB): check cases (the default layer, an awkward fp32 one with seq 97 and
           head_dim 40, a causal grouped-K/V fp16 one) with their inputs and float64
           reference outputs, and bench cases (fp16, seq 1024-8192, head_dim 64 and 128).
           Each artifact is kernels.fatbin + libmha.so: no TVM is needed to run it.
  run      on the GPU machine (Python with torch and the NVIDIA driver; no mhagen, no TVM,
           no numpy): loads each libmha.so with ctypes, runs the check cases through mha_run
           (host arrays) and mha_run_device (torch CUDA tensors, torch's stream) and compares
           with the reference (mhagen's tolerance table for the dtype; for half precision
           FlashAttention's 2x-the-half-reference rule when that is looser); times
           the attention kernel alone (mha_run_kernel_device) and SDPA on the same shapes;
           writes results.md and results.json into the bundle.

Exit codes of run: 0 all checks pass, 1 a check failed, 2 no GPU (or torch without CUDA).
`run --host-only` skips what needs torch's GPU (device-pointer runs, the benchmark): with a
stand-in driver (MHA_CUDA_DRIVER) it tests everything up to the GPU, which is how
tests/test_gpu_check.py exercises this file.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

BUNDLE_LIMIT = 64 << 20          # what the GPU machine accepts
FORMAT = "mhagen.gpu_bundle"
KEEP = ("manifest.json", "kernels.fatbin", "weights.safetensors", "libmha.so", "mha.h")
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


# ---- prepare (mhagen, TVM, nvcc) ---------------------------------------------------------------

def check_cases(quick: bool) -> list:
    """(name, mha kwargs, batch, seq, key lengths or None) of the layers run against the
    reference."""
    padded = ("small_padded_fp32", dict(d_model=64, num_heads=2, key_padding=True), 2, 40,
              [40, 7])
    if quick:
        return [("small_fp32", dict(d_model=64, num_heads=2), 1, 40, None), padded]
    return [("default_fp32", dict(d_model=512, num_heads=8), 1, 128, None),
            ("awkward_fp32", dict(d_model=320, num_heads=8), 2, 97, None),    # head_dim 40
            ("causal_gqa_fp16", dict(d_model=512, num_heads=8, kv_heads=2, causal=True,
                                     dtype="float16"), 2, 97, None),
            ("default_bf16", dict(d_model=512, num_heads=8, dtype="bfloat16"), 1, 128, None),
            ("padded_fp16", dict(d_model=256, num_heads=4, key_padding=True,
                                 dtype="float16"), 3, 97, [97, 40, 0]),
            padded]


def bench_cases(quick: bool) -> list:
    """(name, mha kwargs, batch, seq, None) of the attention benchmark (random weights)."""
    if quick:
        return [("bench_s128_d64", dict(d_model=128, num_heads=2), 1, 128, None)]
    heads, batch = 4, 4
    out = [(f"bench_s{s}_d{d}", dict(d_model=heads * d, num_heads=heads, dtype="float16"),
            batch, s, None) for d in (64, 128) for s in (1024, 2048, 4096, 8192)]
    return out + [("bench_s4096_d128_causal", dict(d_model=heads * 128, num_heads=heads,
                                                   causal=True, dtype="float16"), batch, 4096,
                   None)]


def _save_case(out: Path, name: str, kwargs: dict, batch: int, seq: int, lengths,
               preset: str, kind: str) -> dict:
    import numpy as np

    import mhagen
    from mhagen.tolerances import TOLERANCES
    from mhagen.weights import init_weights
    layer = mhagen.mha(**kwargs)
    weights = init_weights(layer, seed=1)
    start = time.perf_counter()
    module = mhagen.build(layer, preset, batch=batch, seq_len=seq, weights=weights)
    seconds = time.perf_counter() - start
    art = module.save(out / name)
    if not (art / "libmha.so").is_file():
        c_api = json.loads((art / "manifest.json").read_text())["c_api"]
        raise SystemExit(f"{name}: no C API was built ({c_api})")
    for f in art.iterdir():            # what the GPU machine needs, nothing else
        if f.name not in KEEP:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    dtype = layer.dtype
    case = {"name": name, "kind": kind, "dtype": dtype, "batch": batch, "seq_len": seq,
            "d_model": kwargs["d_model"], "heads": kwargs["num_heads"],
            "head_dim": kwargs["d_model"] // kwargs["num_heads"],
            "causal": bool(kwargs.get("causal")), "build_seconds": round(seconds, 1),
            "tolerance": TOLERANCES[dtype]}
    if kind == "check":
        x = np.random.default_rng(2).standard_normal((batch, seq, kwargs["d_model"]))
        from mhagen.dtypes import numpy_dtype
        from mhagen.reference import run_reference
        x = x.astype(numpy_dtype(dtype))
        kv_lens = None if lengths is None else np.asarray(lengths, np.int32)
        expected = run_reference(layer, x, weights, kv_lens=kv_lens)
        case["lengths"] = lengths
        t = TOLERANCES[dtype]
        allowed = t["atol"] + t["rtol"] * float(np.max(np.abs(expected)))
        if dtype != "float32":   # GPUs keep qkv and the attention output in half precision:
            # FlashAttention's rule, 2x a half-precision reference's own error, if larger
            rounded = run_reference(layer, x, weights, kv_lens=kv_lens, rounded_to=dtype)
            allowed = max(allowed, 2 * float(np.max(np.abs(rounded - expected))) + 1e-5)
        case["allowed_error"] = allowed
        (art / "x.bin").write_bytes(np.ascontiguousarray(x).tobytes())
        (art / "expected.bin").write_bytes(np.asarray(expected, np.float64).tobytes())
        case["expected_shape"] = list(np.shape(expected))
    return case


def prepare(out: Path, preset: str, quick: bool) -> int:
    import platform

    import mhagen
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cases = []
    plan = [(c, "check") for c in check_cases(quick)] + [(c, "bench") for c in bench_cases(quick)]
    for (name, kwargs, batch, seq, lengths), kind in plan:
        print(f"building {name} ({kind}) ...", flush=True)
        cases.append(_save_case(out, name, kwargs, batch, seq, lengths, preset, kind))
    for script in ("gpu_check.py", "gpu_check.sh"):
        shutil.copy(Path(__file__).with_name(script), out / script)
    (out / "cases.json").write_text(json.dumps({
        "format": FORMAT, "preset": preset, "mhagen_version": mhagen.__version__,
        "built_on": f"{platform.node()} ({platform.machine()})", "cases": cases}, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"bundle {out}: {len(cases)} artifacts, {size / 2**20:.1f} MiB")
    if size > BUNDLE_LIMIT:
        print(f"error: the bundle is larger than {BUNDLE_LIMIT >> 20} MiB", file=sys.stderr)
        return 1
    return 0


# ---- run (torch, the CUDA driver; no mhagen) ---------------------------------------------------

class Artifact:
    """One artifact's libmha.so through ctypes."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path / "libmha.so"))
        lib.mha_create.restype = ctypes.c_void_p
        lib.mha_create.argtypes = [ctypes.c_char_p]
        lib.mha_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p]
        lib.mha_run_padded.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.mha_run_device.argtypes = [ctypes.c_void_p] * 4
        lib.mha_run_kernel_device.argtypes = [ctypes.c_void_p, ctypes.c_int] + \
            [ctypes.c_void_p] * 3
        lib.mha_kernel_name.restype = ctypes.c_char_p
        lib.mha_last_error.restype = ctypes.c_char_p
        lib.mha_destroy.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.handle = lib.mha_create(str(path).encode())
        if not self.handle:
            raise RuntimeError(f"mha_create({path}): {self.error()}")
        self.kernels = [lib.mha_kernel_name(k).decode() for k in range(lib.mha_num_kernels())]

    def error(self) -> str:
        return self.lib.mha_last_error().decode()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: status {rc}: {self.error()}")

    def run_host(self, x, y, batch, seq, lengths=None):
        if lengths is None:
            self.check(self.lib.mha_run(self.handle, x.data_ptr(), batch, seq, y.data_ptr()),
                       "mha_run")
        else:   # key padding: host arrays only
            self.check(self.lib.mha_run_padded(self.handle, x.data_ptr(), batch, seq,
                                               lengths.data_ptr(), y.data_ptr()),
                       "mha_run_padded")

    def run_device(self, x, y, stream):
        self.check(self.lib.mha_run_device(self.handle, x.data_ptr(), y.data_ptr(), stream),
                   "mha_run_device")

    def run_kernel(self, k, x, y, stream):
        self.check(self.lib.mha_run_kernel_device(self.handle, k, x.data_ptr(), y.data_ptr(),
                                                  stream), "mha_run_kernel_device")

    def close(self):
        if self.handle:
            self.lib.mha_destroy(self.handle)
            self.handle = None


def _compare(torch, y, expected, allowed) -> tuple:
    """(max error, allowed): the case's allowed error was set by prepare, from mhagen's
    tolerance table (atol + rtol * max|expected|, mhagen/tolerances.py) and, for half
    precision, FlashAttention's rule (2x a half-precision reference's own error)."""
    y = y.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(y).all()):
        return float("inf"), allowed
    return float((y - expected).abs().max()), allowed


def run_checks(torch, bundle: Path, cases: list, host_only: bool) -> list:
    rows = []
    for case in (c for c in cases if c["kind"] == "check"):
        art = bundle / case["name"]
        dt = getattr(torch, TORCH_DTYPES[case["dtype"]])
        b, s, d = case["batch"], case["seq_len"], case["d_model"]
        x = torch.frombuffer(bytearray((art / "x.bin").read_bytes()), dtype=dt).reshape(b, s, d)
        expected = torch.frombuffer(bytearray((art / "expected.bin").read_bytes()),
                                    dtype=torch.float64).reshape(case["expected_shape"])
        row = {"case": case["name"], "dtype": case["dtype"], "shape": [b, s, d]}
        try:
            a = Artifact(art)
            try:
                y = torch.empty(case["expected_shape"], dtype=dt)
                lengths = case.get("lengths")
                a.run_host(x, y, b, s, None if lengths is None else
                           torch.tensor(lengths, dtype=torch.int32))
                row["host"] = _compare(torch, y, expected, case["allowed_error"])
                if not host_only and lengths is None:   # (lengths: host entry points only)
                    xd, yd = x.cuda(), torch.empty(case["expected_shape"], dtype=dt,
                                                   device="cuda")
                    a.run_device(xd, yd, torch.cuda.current_stream().cuda_stream)
                    torch.cuda.synchronize()
                    row["device"] = _compare(torch, yd, expected, case["allowed_error"])
            finally:
                a.close()
        except RuntimeError as err:
            row["error"] = str(err)
        row["ok"] = "error" not in row and all(
            err <= allowed for key in ("host", "device") if key in row
            for err, allowed in [row[key]])
        rows.append(row)
        print(f"{'PASS' if row['ok'] else 'FAIL'} {case['name']}: "
              + (row.get("error") or ", ".join(f"{k} max error {row[k][0]:.3g} (allowed "
                                                f"{row[k][1]:.3g})" for k in ("host", "device")
                                                if k in row)), flush=True)
    return rows


def _time_ms(torch, fn, repeats: int) -> float:
    """Median of `repeats` timings of fn() with CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_bench(torch, bundle: Path, cases: list, repeats: int) -> list:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for case in (c for c in cases if c["kind"] == "bench"):
        b, s, d, h = case["batch"], case["seq_len"], case["d_model"], case["heads"]
        hd, dt = case["head_dim"], getattr(torch, TORCH_DTYPES[case["dtype"]])
        flops = 4 * b * h * s * s * hd * (0.5 if case["causal"] else 1.0)
        a = Artifact(bundle / case["name"])
        try:
            stream = torch.cuda.current_stream().cuda_stream
            x = torch.randn(b, s, d, dtype=dt, device="cuda")
            y = torch.empty(b, s, d, dtype=dt, device="cuda")
            a.run_device(x, y, stream)        # fills qkv for the attention kernel
            k = a.kernels.index("attention")
            ours = _time_ms(torch, lambda: a.run_kernel(k, x, y, stream), repeats)
            layer = _time_ms(torch, lambda: a.run_device(x, y, stream), repeats)
        finally:
            a.close()
        q, kk, v = (torch.randn(b, h, s, hd, dtype=dt, device="cuda") for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa = _time_ms(torch, lambda: F.scaled_dot_product_attention(
                q, kk, v, is_causal=case["causal"]), repeats)
        row = {"case": case["name"], "batch": b, "heads": h, "seq_len": s, "head_dim": hd,
               "causal": case["causal"], "mhagen_attention_ms": ours, "mhagen_layer_ms": layer,
               "sdpa_ms": sdpa, "mhagen_tflops": flops / ours / 1e9,
               "sdpa_tflops": flops / sdpa / 1e9, "ratio": sdpa / ours}
        rows.append(row)
        print(f"{case['name']}: mhagen {row['mhagen_tflops']:.1f} TFLOP/s, SDPA "
              f"{row['sdpa_tflops']:.1f}, mhagen/SDPA throughput {row['ratio']:.2f}", flush=True)
    return rows


def write_results(bundle: Path, meta: dict, checks: list, bench: list) -> None:
    lines = [f"# mhagen CUDA artifacts on {meta['device']}", "",
             f"Built with mhagen {meta['mhagen_version']} for `{meta['preset']}` on "
             f"{meta['built_on']}; run with torch {meta['torch']}, CUDA {meta['cuda']}.", "",
             "| check | dtype | shape | host arrays: max error (allowed) | device arrays | ok |",
             "|---|---|---|---|---|---|"]
    for r in checks:
        cells = [f"{r[k][0]:.3g} ({r[k][1]:.3g})" if k in r else r.get("error", "-")
                 for k in ("host", "device")]
        lines.append(f"| {r['case']} | {r['dtype']} | {r['shape']} | {cells[0]} | {cells[1]} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    if bench:
        lines += ["", "Fused attention alone (mha_run_kernel_device) vs "
                  "`scaled_dot_product_attention` (flash backend), same shapes, fp16, medians "
                  "of CUDA-event timings:", "",
                  "| batch x heads | seq | head_dim | causal | mhagen ms | TFLOP/s | SDPA ms | "
                  "TFLOP/s | mhagen / SDPA throughput | whole layer ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in bench:
            lines.append(f"| {r['batch']}x{r['heads']} | {r['seq_len']} | {r['head_dim']} | "
                         f"{r['causal']} | {r['mhagen_attention_ms']:.3f} | "
                         f"{r['mhagen_tflops']:.1f} | {r['sdpa_ms']:.3f} | "
                         f"{r['sdpa_tflops']:.1f} | {r['ratio']:.2f} | "
                         f"{r['mhagen_layer_ms']:.3f} |")
    (bundle / "results.md").write_text("\n".join(lines) + "\n")
    (bundle / "results.json").write_text(json.dumps({**meta, "checks": checks, "bench": bench},
                                                    indent=1))


def run(bundle: Path, host_only: bool, repeats: int) -> int:
    meta = json.loads((bundle / "cases.json").read_text())
    if meta.get("format") != FORMAT:
        print(f"error: {bundle}/cases.json is not a gpu_check bundle", file=sys.stderr)
        return 1
    try:
        import torch
    except ImportError:
        print("error: the run step needs PyTorch", file=sys.stderr)
        return 2
    if not host_only and not torch.cuda.is_available():
        print("error: torch sees no CUDA GPU (torch.cuda.is_available() is False); run this "
              "on the GPU machine, or pass --host-only to test up to the GPU", file=sys.stderr)
        return 2
    device = "no GPU (--host-only)" if host_only else torch.cuda.get_device_name()
    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver_override": os.environ.get("MHA_CUDA_DRIVER", "")}
    checks = run_checks(torch, bundle, meta["cases"], host_only)
    bench = [] if host_only else run_bench(torch, bundle, meta["cases"], repeats)
    write_results(bundle, {**{k: meta[k] for k in ("preset", "mhagen_version", "built_on")},
                           **info}, checks, bench)
    print(f"wrote {bundle}/results.md")
    return 0 if all(r["ok"] for r in checks) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("prepare", help="build the bundle (needs mhagen, TVM, nvcc)")
    pp.add_argument("--out", type=Path, default=Path("gpu_bundle"))
    pp.add_argument("--target", default="cuda-sm90")
    pp.add_argument("--quick", action="store_true", help="one small case of each kind (tests)")
    pr = sub.add_parser("run", help="run the bundle (needs torch and an NVIDIA GPU)")
    pr.add_argument("bundle", type=Path, nargs="?", default=Path(__file__).resolve().parent)
    pr.add_argument("--host-only", action="store_true",
                    help="no torch GPU: host-array checks only (with a stand-in driver)")
    pr.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if args.step == "prepare":
        return prepare(args.out, args.target, args.quick)
    return run(args.bundle, args.host_only, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
