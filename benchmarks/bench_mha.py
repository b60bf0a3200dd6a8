#!/usr/bin/env python
"""Benchmark mhagen's compiled multi-head attention layer against peers, in one process.

Every implementation computes the whole layer in float32 (QKV projections + attention +
output projection) with the same weights, converted from mhagen's per-head layout:

  mhagen          mhagen.build(layer, TARGET, ...) (TVM), built once per shape and mask;
                  --target picks the preset (default x86: this CPU; x86-avx2 measures the
                  AVX2 code on any host: peers' BLAS are then held to AVX2 as well)
  numpy           one packed QKV matmul, batched attention (max-subtracted softmax), W_O matmul
  torch_mha       torch.nn.MultiheadAttention (batch_first, need_weights=False, inference_mode)
  torch_sdpa      Linear(QKV) -> F.scaled_dot_product_attention -> Linear
  ort_mha         ONNX Runtime, com.microsoft.MultiHeadAttention between MatMul projections
  ort_attention   ONNX Runtime, standard opset-23 Attention between MatMul projections

Each output is checked against the float64 reference (layer.reference) with mhagen.tolerances
before timing; a failing peer is reported and excluded, a failing mhagen makes the exit code 1.
Timing interleaves the implementations in rounds and reports medians. See benchmarks/README.md.

--varlen BxSxDxH:LENS (e.g. 4x512x768x12:512,400,200,100) adds the ragged-batch case: B
sequences of LENS tokens (each <= S), unmasked and causal, at every thread count:
  mhagen_packed   one packed call, module(x [1, sum(LENS), D], cu_seqlens=...) of the
                  any-length build (batch=None, max_batch=B, seq_len=None, max_seq_len=S)
  mhagen_own      the same module called on each sequence alone, one call after another:
                  the sum of the sequences' own times
  mhagen_padded   the batch padded to [B, S, D], mhagen.mha(..., key_padding=True) built for
                  B x S, kv_lens = LENS
  ort_mha_padded, ort_attention_padded
                  ONNX Runtime on the padded batch with its key masks (as
                  benchmarks/bench_padding.py)
each checked on the sequences' real rows against layer.reference(x, w, cu_seqlens=...);
the table gives packed / own, packed / padded and packed / the faster ORT (written to
varlen/results.md and varlen/results.json in the output directory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import mhagen
import mhagen.host
import mhagen.runtime
import mhagen.target
from mhagen import tolerances
from mhagen.cost import graph_flops

HERE = Path(__file__).resolve().parent

DEFAULT_SHAPES = [(1, 128, 512, 8), (1, 512, 512, 8), (4, 512, 768, 12), (1, 2048, 1024, 16)]
LONG_SHAPE = (1, 16384, 1024, 16)
LONG_CHECK_ROWS = 256
LONG_SMALL_SEQ = 1024
MASKS = (False, True)
IMPLS = ("mhagen", "mhagen_any_len", "mhagen_host", "numpy", "torch_mha", "torch_sdpa",
         "ort_mha", "ort_attention")
ANY_LEN_MAX = 2048   # mhagen_any_len: one module for every seq_len up to this
DESCRIPTIONS = {
    "mhagen": "mhagen.build(layer, target) (TVM)",
    "mhagen_any_len": f"mhagen.build(layer, target, seq_len=None, max_seq_len={ANY_LEN_MAX}): "
                      "one module for every length (symbolic shapes)",
    "mhagen_host": "mhagen.build(layer, \"x86\"): this host's own CPU class, timed beside a "
                   "narrower --target (x86-avx2 on an AVX-512 host) for the same-share "
                   "comparison; its % column is of the host's own sgemm peak",
    "numpy": "numpy float32: packed QKV matmul, batched attention, W_O matmul",
    "torch_mha": "torch.nn.MultiheadAttention (batch_first, need_weights=False)",
    "torch_sdpa": "torch Linear -> F.scaled_dot_product_attention -> Linear",
    "ort_mha": "onnxruntime com.microsoft.MultiHeadAttention + MatMul projections",
    "ort_attention": "onnxruntime opset-23 Attention + MatMul projections",
}
REQUIRES = {"mhagen": (), "mhagen_any_len": (), "mhagen_host": (), "numpy": (),
            "torch_mha": ("torch",),
            "torch_sdpa": ("torch",),
            "ort_mha": ("onnx", "onnxruntime"), "ort_attention": ("onnx", "onnxruntime")}
SGEMM = (2048, 1024, 3072)   # [M, K] @ [K, N]
DISTURBED = 0.25             # cores busy in other processes while timing: numbers disturbed
# idle ms before each implementation's turn at > 1 thread: some peer's worker threads spin
# for over 100 ms after a call (Zen 4, 1x128, 2 threads: with 100 ms, mhagen's rounds after
# it took 2.7-2.9 ms instead of 1.5-1.7; with 300 ms none did)
GAP_MS = 300.0
# core_probe's fallback: float32 GEMMs of 64^3, which OpenBLAS runs on the calling thread
PROBE_BATCH, PROBE_N = 16, 64
# a turn whose probe ran below this share of the run's best probe shared its core with work
# outside this machine's view (a VM's sibling hardware thread): its times are contended
CONTENDED = 0.8
PROBE_REF = 0.0              # the best core probe of the run so far (GFLOP/s)
TARGET = "x86"               # the preset mhagen builds for (--target)
# what holds the peers' BLAS (and so the sgemm peak) to AVX2 when measuring the AVX2 class on
# a host with AVX-512: MKL (torch) and OpenBLAS (numpy) read these at start-up
AVX2_ENV = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}
# the environment of the child that measures the host class's own sgemm peak (set by main
# when --target is narrower than the host; None: no such measurement)
HOST_PEAK_ENV = None


def mask_name(causal: bool) -> str:
    return "causal" if causal else "none"


def shape_name(shape) -> str:
    return "x".join(str(v) for v in shape)


def parse_shape(text: str):
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} must be BATCHxSEQxD_MODELxHEADS, e.g. 1x128x512x8")
    b, s, d, h = (int(p) for p in parts)
    if d % h:
        raise argparse.ArgumentTypeError(f"shape {text!r}: d_model {d} is not divisible by "
                                         f"heads {h}")
    return (b, s, d, h)


def lengths_arg(least, example):
    """An argparse type: comma-separated integers >= least (one per batch row)."""
    def parse(text):
        try:
            lens = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            lens = []
        if not lens or min(lens) < least:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give one integer >= {least} per batch row, e.g. {example}")
        return lens
    return parse


def make_input(batch, seq, d_model, seed=0):
    """The same input for every implementation, 64-byte aligned (mhagen.aligned_empty) as a
    caller who wants mhagen to read it in place allocates it; the peers take any array."""
    x = mhagen.aligned_empty((batch, seq, d_model))
    x[...] = np.random.default_rng(seed).standard_normal((batch, seq, d_model))
    return x


def layer_flops(layer, batch, seq) -> int:
    """Dense flop count of the layer (what kernel.flops() returns; masked work included)."""
    return graph_flops(layer, **layer.dims(batch, seq))


# -- weight conversion (mhagen per-head layout -> peers) -----------------------------------
# mhagen: w_q/w_k/w_v [H, D, d] with y_h = x @ w[h] + b[h] (b [H, d]); w_o [H*d, D]; b_o [D].

def _heads_to_columns(w_heads):
    """[H, D, d] -> [D, H*d]: column block h is head h (x @ result = concatenated heads)."""
    h, d_in, d = w_heads.shape
    return np.ascontiguousarray(w_heads.transpose(1, 0, 2).reshape(d_in, h * d))


def packed_qkv(w):
    """One [D, 3*H*d] matrix and [3*H*d] bias: columns are q heads, then k heads, then v heads
    (head h of q is columns h*d:(h+1)*d), so x @ W + b = [Q | K | V], each head-major."""
    weight = np.concatenate([_heads_to_columns(w[f"w_{r}"]) for r in "qkv"], axis=1)
    bias = np.concatenate([np.asarray(w[f"b_{r}"]).reshape(-1) for r in "qkv"])
    return weight.astype(np.float32), bias.astype(np.float32)


def torch_in_proj(w):
    """torch.nn.MultiheadAttention.in_proj_weight [3E, E] and in_proj_bias [3E]: rows of the
    q block are the per-head W_q[h]^T stacked (torch computes x @ W^T), then k, then v."""
    weight = np.concatenate(
        [np.concatenate([np.asarray(w[f"w_{r}"][h]).T for h in range(w[f"w_{r}"].shape[0])],
                        axis=0) for r in "qkv"], axis=0)
    bias = np.concatenate([np.asarray(w[f"b_{r}"]).reshape(-1) for r in "qkv"])
    return np.ascontiguousarray(weight, np.float32), bias.astype(np.float32)


def torch_out_proj(w):
    """out_proj.weight [E, H*d] = w_o^T and out_proj.bias = b_o."""
    return (np.ascontiguousarray(np.asarray(w["w_o"]).T, np.float32),
            np.asarray(w["b_o"], np.float32))


# -- implementations: callables x [B, S, D] float32 -> y [B, S, D] float32 ------------------

class Mhagen:
    per_thread = False

    def __init__(self, layer, w, batch, seq, causal, threads=None, kernel=None):
        self.kernel = kernel or mhagen.build(layer, TARGET, batch=batch, seq_len=seq, weights=w)

    def __call__(self, x):
        return self.kernel(x)


class MhagenAnyLength(Mhagen):
    def __init__(self, layer, w, batch, seq, causal, threads=None, kernel=None):
        self.kernel = kernel or mhagen.build(layer, TARGET, batch=batch, seq_len=None,
                                             max_seq_len=max(seq, ANY_LEN_MAX), weights=w)


class MhagenHost(Mhagen):
    def __init__(self, layer, w, batch, seq, causal, threads=None, kernel=None):
        self.kernel = kernel or mhagen.build(layer, "x86", batch=batch, seq_len=seq, weights=w)


class NumpyMHA:
    per_thread = False

    def __init__(self, layer, w, batch, seq, causal, threads=None):
        self.w_qkv, self.b_qkv = packed_qkv(w)
        self.w_o = np.ascontiguousarray(w["w_o"], np.float32)
        self.b_o = np.asarray(w["b_o"], np.float32)
        self.heads, _, self.head_dim = w["w_q"].shape
        self.scale = np.float32(1.0 / math.sqrt(self.head_dim))
        # additive mask: -inf above the diagonal (query i sees keys 0..i)
        self.mask = (np.triu(np.full((seq, seq), -np.inf, np.float32), 1) if causal else None)

    def __call__(self, x):
        b, s, d_model = x.shape
        h, d = self.heads, self.head_dim
        qkv = x.reshape(b * s, d_model) @ self.w_qkv
        qkv += self.b_qkv
        qkv = qkv.reshape(b, s, 3, h, d).transpose(2, 0, 3, 1, 4)     # [3, B, H, S, d]
        q = np.ascontiguousarray(qkv[0]) * self.scale
        k = np.ascontiguousarray(qkv[1])
        v = np.ascontiguousarray(qkv[2])
        scores = q @ k.transpose(0, 1, 3, 2)                          # [B, H, S, S]
        if self.mask is not None:
            scores += self.mask
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores *= 1.0 / scores.sum(axis=-1, keepdims=True)
        o = scores @ v                                                # [B, H, S, d]
        o = o.transpose(0, 2, 1, 3).reshape(b * s, h * d)
        y = o @ self.w_o
        y += self.b_o
        return y.reshape(b, s, d_model)


class TorchMHA:
    per_thread = False

    def __init__(self, layer, w, batch, seq, causal, threads=None):
        import torch
        self.torch = torch
        heads, d_model, _ = w["w_q"].shape
        m = torch.nn.MultiheadAttention(d_model, heads, bias=True, batch_first=True)
        w_in, b_in = torch_in_proj(w)
        w_out, b_out = torch_out_proj(w)
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.from_numpy(w_in))
            m.in_proj_bias.copy_(torch.from_numpy(b_in))
            m.out_proj.weight.copy_(torch.from_numpy(w_out))
            m.out_proj.bias.copy_(torch.from_numpy(b_out))
        self.module = m.eval()
        self.causal = causal
        # True = may not attend: strictly above the diagonal
        self.mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1) if causal else None

    def __call__(self, x):
        with self.torch.inference_mode():
            t = self.torch.from_numpy(x)
            y, _ = self.module(t, t, t, need_weights=False, attn_mask=self.mask,
                               is_causal=self.causal)
            return y.numpy()


class TorchSDPA:
    per_thread = False

    def __init__(self, layer, w, batch, seq, causal, threads=None):
        import torch
        import torch.nn.functional as F
        self.torch, self.sdpa = torch, F.scaled_dot_product_attention
        self.heads, d_model, self.head_dim = w["w_q"].shape
        w_in, b_in = torch_in_proj(w)
        w_out, b_out = torch_out_proj(w)
        self.qkv = torch.nn.Linear(d_model, 3 * self.heads * self.head_dim)
        self.out = torch.nn.Linear(self.heads * self.head_dim, d_model)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.from_numpy(w_in))
            self.qkv.bias.copy_(torch.from_numpy(b_in))
            self.out.weight.copy_(torch.from_numpy(w_out))
            self.out.bias.copy_(torch.from_numpy(b_out))
        self.qkv.eval()
        self.out.eval()
        self.causal = causal
        self.mask = None     # or a boolean mask (True = seen) that replaces is_causal

    def __call__(self, x):
        torch = self.torch
        with torch.inference_mode():
            t = torch.from_numpy(x)
            b, s, _ = t.shape
            qkv = self.qkv(t).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            o = self.sdpa(qkv[0], qkv[1], qkv[2], attn_mask=self.mask,
                          is_causal=self.causal and self.mask is None)   # [B, H, S, d]
            y = self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
            return y.numpy()


def ort_session(model_bytes, threads):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def onnx_model(w, batch, seq, causal, op, key_mask=False):
    """x -> MatMul(W_qkv) -> Split -> attention op -> MatMul(W_O) -> Add(b_O), as bytes.

    op "ort_mha": com.microsoft.MultiHeadAttention(q, k, v, bias=b_qkv; unidirectional=causal).
    op "ort_attention": Add(b_qkv) -> opset-23 Attention(q, k, v; q_num_heads, kv_num_heads,
    is_causal) on 3-D [B, S, H*d] inputs.
    key_mask: a second input "key_mask" hides keys per batch row (key padding): int32
    [B, S] (1 = seen) as MultiHeadAttention's key_padding_mask, bool [B, 1, S, S] as
    Attention's attn_mask."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    heads, d_model, head_dim = w["w_q"].shape
    width = heads * head_dim
    w_qkv, b_qkv = packed_qkv(w)
    inits = [numpy_helper.from_array(w_qkv, "w_qkv"),
             numpy_helper.from_array(b_qkv, "b_qkv"),
             numpy_helper.from_array(np.ascontiguousarray(w["w_o"], np.float32), "w_o"),
             numpy_helper.from_array(np.asarray(w["b_o"], np.float32), "b_o"),
             numpy_helper.from_array(np.array([width] * 3, np.int64), "split")]
    if op == "ort_mha":
        nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv"]),
                 helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1),
                 helper.make_node("MultiHeadAttention",
                                  ["q", "k", "v", "b_qkv"] + ["key_mask"] * key_mask, ["attn"],
                                  domain="com.microsoft", num_heads=heads,
                                  unidirectional=int(causal))]
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    elif op == "ort_attention":
        nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
                 helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv"]),
                 helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1),
                 helper.make_node("Attention", ["q", "k", "v"] + ["key_mask"] * key_mask,
                                  ["attn"], q_num_heads=heads,
                                  kv_num_heads=heads, is_causal=int(causal))]
        opsets = [helper.make_opsetid("", 23)]
    else:
        raise ValueError(op)
    nodes += [helper.make_node("MatMul", ["attn", "w_o"], ["y0"]),
              helper.make_node("Add", ["y0", "b_o"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d_model])]
    if key_mask:
        inputs.append(helper.make_tensor_value_info("key_mask", *(
            (TensorProto.INT32, [batch, seq]) if op == "ort_mha" else
            (TensorProto.BOOL, [batch, 1, seq, seq]))))
    graph = helper.make_graph(
        nodes, f"mha_{op}", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, d_model])], inits)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="mhagen-bench")
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


class OrtImpl:
    per_thread = True   # intra_op_num_threads is fixed when the session is created
    op = None

    def __init__(self, layer, w, batch, seq, causal, threads=1):
        self.session = ort_session(onnx_model(w, batch, seq, causal, self.op), threads)

    def __call__(self, x):
        return self.session.run(None, {"x": x})[0]


class OrtMHA(OrtImpl):
    op = "ort_mha"


class OrtAttention(OrtImpl):
    op = "ort_attention"


FACTORIES = {"mhagen": Mhagen, "mhagen_any_len": MhagenAnyLength, "mhagen_host": MhagenHost,
             "numpy": NumpyMHA,
             "torch_mha": TorchMHA,
             "torch_sdpa": TorchSDPA, "ort_mha": OrtMHA, "ort_attention": OrtAttention}


def make_impl(name, layer, w, batch, seq, causal, threads=1, **kw):
    return FACTORIES[name](layer, w, batch, seq, causal, threads, **kw)


def active_impls():
    """IMPLS, less mhagen_host unless --target is narrower than the host (main sets that)."""
    return tuple(i for i in IMPLS if i != "mhagen_host" or HOST_PEAK_ENV is not None)


def peer_status(names):
    """name -> None when importable, else 'missing (...)'."""
    import importlib
    out = {}
    for name in names:
        out[name] = None
        for mod in REQUIRES[name]:
            try:
                importlib.import_module(mod)
            except Exception as err:  # ImportError, or a broken install
                out[name] = f"missing ({mod}: {type(err).__name__}: {err})"
                break
    return out


# -- float64 oracle for a few query rows (the long case; tested against layer.reference) ----

def reference_rows(w, x, rows, causal=False):
    """float64 output rows `rows` of the layer (same math as layer.reference), [B, len(rows), D]."""
    x64 = np.asarray(x, np.float64)
    rows = np.asarray(rows)
    heads, _, d = w["w_q"].shape
    keys = np.arange(x64.shape[1])
    outs = []
    for h in range(heads):
        q = x64[:, rows] @ np.asarray(w["w_q"][h], np.float64) + w["b_q"][h]
        k = x64 @ np.asarray(w["w_k"][h], np.float64) + w["b_k"][h]
        v = x64 @ np.asarray(w["w_v"][h], np.float64) + w["b_v"][h]
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        if causal:
            s = np.where(keys[None, None, :] <= rows[None, :, None], s, -np.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        outs.append(p @ v)
    return np.concatenate(outs, axis=-1) @ np.asarray(w["w_o"], np.float64) + w["b_o"]


# -- threads, memory ----------------------------------------------------------------------

_BLAS_LIMITER = []


def set_threads(n):
    """TVM pool, torch intra-op and numpy's BLAS to n threads (ORT: per session)."""
    mhagen.runtime.set_num_threads(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    _BLAS_LIMITER[:] = [threadpool_limits(limits=n, user_api="blas")]
    return True


def _proc_status():
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes():
    st = _proc_status()
    if "VmHWM" in st:
        return st["VmHWM"]
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_bytes():
    return _proc_status().get("VmRSS")


def _trim_heap() -> bool:
    """Give freed heap pages back to the OS (glibc malloc_trim), so that memory freed during
    setup and reused later cannot hide an allocation from the RSS peak."""
    import gc
    gc.collect()
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


class PeakMeter:
    """Peak RSS above a baseline taken at start(): reset VmHWM when Linux lets us (then the
    peak covers only what runs after start()), else max(ru_maxrss) since process start."""

    def start(self):
        self.trimmed = _trim_heap()
        self.reset = _reset_peak()
        self.baseline = _rss_bytes() or _peak_bytes()
        self.method = ("VmHWM after clear_refs reset, minus VmRSS baseline" if self.reset else
                       "ru_maxrss/VmHWM since process start, minus RSS baseline")
        if self.trimmed:
            self.method += " (heap trimmed with malloc_trim before the baseline)"

    def peak_above_baseline(self):
        return max(0, _peak_bytes() - self.baseline)


def memory_child(spec):
    """Runs in a child process: peak RSS of one implementation (or the long case)."""
    if spec.get("mode") == "long":
        return long_child(spec)
    name, causal, threads = spec["impl"], spec["causal"], spec["threads"]
    b, s, d_model, heads = spec["shape"]
    for mod in REQUIRES[name]:
        __import__(mod)
    set_threads(threads)
    rss_imports = _rss_bytes()
    layer = mhagen.mha(d_model, heads, causal=causal)
    w = layer.init_weights(0)
    x = make_input(b, s, d_model)
    rss_inputs = _rss_bytes()
    impl = make_impl(name, layer, w, b, s, causal, threads)
    meter = PeakMeter()
    meter.start()
    for _ in range(spec.get("calls", 3)):
        impl(x)
    return {"peak_bytes": meter.peak_above_baseline(), "method": meter.method,
            "setup_bytes": (meter.baseline - rss_inputs) if rss_inputs else None,
            "baseline_bytes": meter.baseline, "rss_after_imports": rss_imports,
            "threads": threads}


def long_child(spec):
    """The long case: mhagen only, [1, 16384, 1024], 16 heads, no mask."""
    b, s, d_model, heads = spec["shape"]
    threads = spec["threads"]
    layer = mhagen.mha(d_model, heads)
    w = layer.init_weights(0)
    x = make_input(b, s, d_model)
    t0 = time.perf_counter()
    kernel = mhagen.build(layer, spec.get("target", TARGET), batch=b, seq_len=s, weights=w)
    build_s = time.perf_counter() - t0
    set_threads(max(threads))
    meter = PeakMeter()
    meter.start()
    t0 = time.perf_counter()
    y = kernel(x)
    first_s = time.perf_counter() - t0
    peak_above = meter.peak_above_baseline()
    peak_abs = _peak_bytes()
    lat = {}
    for n in threads:
        set_threads(n)
        times = []
        load = LoadMeter()
        for _ in range(spec["calls"]):
            t0 = time.perf_counter()
            kernel(x)
            times.append(time.perf_counter() - t0)
        lat[str(n)] = {"median_ms": float(np.median(times)) * 1e3,
                       "samples_ms": [t * 1e3 for t in times],
                       "other_load_cores": load.other_cores()}
    flops = kernel.flops()
    # check 1: float64 oracle of the first and last LONG_CHECK_ROWS query rows of this very run
    checks = []
    r = min(LONG_CHECK_ROWS, s)
    for label, rows in (("first", np.arange(r)), ("last", np.arange(s - r, s))):
        ref = reference_rows(w, x, rows)
        got = y[:, rows]
        err, tol = tolerances.max_error(got, ref), tolerances.tolerance(ref)
        checks.append({"what": f"{label} {r} query rows of the seq-{s} output vs a float64 "
                               "oracle of those rows (reference_rows)",
                       "max_error": err, "tolerance": tol,
                       "ok": bool(np.all(np.isfinite(got)) and err <= tol)})
    # check 2: the same layer and weights built at a smaller seq, vs layer.reference (full)
    small = min(LONG_SMALL_SEQ, s)
    xs = make_input(b, small, d_model, seed=1)
    ks = mhagen.build(layer, spec.get("target", TARGET), batch=b, seq_len=small, weights=w)
    ref = layer.reference(xs, w)
    got = ks(xs)
    err, tol = tolerances.max_error(got, ref), tolerances.tolerance(ref)
    checks.append({"what": f"same layer and weights built at seq {small}, full output vs "
                           "layer.reference", "max_error": err, "tolerance": tol,
                   "ok": bool(np.all(np.isfinite(got)) and err <= tol)})
    return {"shape": list(spec["shape"]), "build_s": build_s, "first_call_s": first_s,
            "latency": lat, "flops": flops, "peak_bytes": peak_above,
            "peak_abs_bytes": peak_abs, "baseline_bytes": meter.baseline,
            "method": meter.method, "threads_for_peak": max(threads), "checks": checks,
            "checked": all(c["ok"] for c in checks)}


def run_child(spec, timeout=900, env=None):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CHILD-RESULT "):
            return json.loads(line[len("CHILD-RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


# -- timing -------------------------------------------------------------------------------

def measure_peak(n, args, peaks, when):
    """sgemm peak at n threads into peaks[str(n)]: up to 1 + retries attempts, keeping the
    least disturbed one (also against an earlier measurement)."""
    set_threads(n)
    calibrate_probe()

    def badness(p):   # contended (the core probe around it), then CPU used by others
        return (p["probe_share"] < CONTENDED, p["other_load_cores"] or 0.0)

    for _ in range(1 + max(0, args.retries)):
        wait_quiet(args.wait_quiet)
        before = core_probe()
        p = sgemm_peak(n, 3 if args.quick else 7)
        around = (before, core_probe())
        p["probe_share"] = min(around) / seen_probes(around)
        p["when"] = when
        old = peaks.get(str(n))
        if old is None or badness(p) < badness(old):
            peaks[str(n)] = p
        if not badness(p)[0] and (p["other_load_cores"] or 0.0) < DISTURBED:
            break
    p = peaks[str(n)]
    p["probe_gflops"] = PROBE_REF
    print(f"core probe: best {p['probe_gflops']:.1f} GFLOP/s so far (turns below "
          f"{CONTENDED:.0%} of the run's best count as contended; around the sgemm peak "
          f"{p['probe_share']:.0%})", flush=True)
    print(f"sgemm peak at {n} thread(s) ({when} of run): {p['gflops']:.1f} GFLOP/s (numpy "
          f"{p['numpy_gflops']:.1f}, torch {p.get('torch_gflops', float('nan')):.1f}; kept the "
          f"{p['when']} measurement, other processes {fmt(p['other_load_cores'], '.2f', '?')} "
          "cores)", flush=True)
    if HOST_PEAK_ENV is not None:
        # the host's own class: the same measurement in a child process whose BLAS libraries
        # load without the AVX2 settings, right after this one
        host = None
        for _ in range(1 + max(0, args.retries)):   # the least contended of the attempts
            before = core_probe()
            got = run_child({"peak": n, "runs": p["runs"]}, env=HOST_PEAK_ENV)
            around = (before, core_probe())
            got["probe_share"] = min(around) / seen_probes(around)
            if host is None or got["probe_share"] > host["probe_share"]:
                host = got
            if got["probe_share"] >= CONTENDED:
                break
        if "error" in host:
            p["host_error"] = host["error"]
            print(f"  host-class sgemm peak: {host['error']}", flush=True)
        else:
            p.update({f"host_{k}": host[k] for k in ("gflops", "numpy_gflops", "torch_gflops",
                                                     "best", "other_load_cores",
                                                     "probe_share") if k in host})
            print(f"  this host's own class (BLAS without the AVX2 settings): "
                  f"{p['host_gflops']:.1f} GFLOP/s (numpy {p['host_numpy_gflops']:.1f}, torch "
                  f"{p.get('host_torch_gflops', float('nan')):.1f})", flush=True)


def sgemm_peak(threads, runs):
    """Best of torch.mm and numpy matmul on [2048,1024] @ [1024,3072] fp32, median of runs."""
    m, k, n = SGEMM
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    flops = 2 * m * k * n
    out = {"threads": threads, "shape": f"{m}x{k} @ {k}x{n}", "runs": runs}

    def med(f):
        f()
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return flops / float(np.median(ts)) / 1e9

    c = np.empty((m, n), np.float32)
    load = LoadMeter()
    out["numpy_gflops"] = med(lambda: np.matmul(a, b, out=c))
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        tc = torch.empty(m, n)
        out["torch_gflops"] = med(lambda: torch.mm(ta, tb, out=tc))
    out["other_load_cores"] = load.other_cores()
    best = max(("numpy", "torch"), key=lambda lib: out.get(f"{lib}_gflops", 0.0))
    out["gflops"], out["best"] = out[f"{best}_gflops"], best
    return out


class LoadMeter:
    """CPU time used by other processes while we time (from /proc/stat minus our own CPU
    time), in cores: other sessions or daemons on the machine disturb the numbers."""

    def __init__(self):
        self.start()

    @staticmethod
    def _busy():
        try:
            with open("/proc/stat") as f:
                v = [int(t) for t in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / hz   # user nice system irq softirq steal

    def start(self):
        t = os.times()
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), t.user + t.system

    def other_cores(self):
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return None
        t = os.times()
        wall = time.perf_counter() - self.t0
        own = t.user + t.system - self.own0
        return max(0.0, (busy - self.busy0 - own) / wall) if wall > 0 else None


def wait_quiet(max_s, threshold=0.2, window_s=0.5):
    """Wait (up to max_s) until other processes use less than `threshold` cores for a
    window; returns the seconds waited. For shared machines (--wait-quiet)."""
    t0 = time.perf_counter()
    while max_s > 0 and time.perf_counter() - t0 < max_s:
        meter = LoadMeter()
        time.sleep(window_s)
        other = meter.other_cores()
        if other is None or other < threshold:
            break
    return time.perf_counter() - t0


def checked_impls(impls, x, reference, status, label="{}", dtypes=None):
    """The implementations whose output on x is within mhagen.tolerances of reference(name)
    (the smaller scripts' check before timing; dtypes: name -> the layer dtype whose
    tolerance row applies, default float32). status[label] gets each one's max error;
    a peer that raises or misses is reported there and left out; mhagen's own (names
    starting "mhagen") failing ends the run."""
    checked = {}
    for name, f in impls.items():
        key, ref = label.format(name), reference(name)
        try:
            y = f(x)
        except Exception as err:     # a peer that cannot run is reported, not fatal
            if name.startswith("mhagen"):
                raise
            status[key] = f"unavailable: {type(err).__name__}: {str(err)[-160:]}"
            continue
        err = tolerances.max_error(y, ref)
        tol = tolerances.tolerance(ref, (dtypes or {}).get(name))
        status.setdefault(key, f"max error {err:.3g} (tolerance {tol:.3g})")
        if err <= tol:
            checked[name] = f
        elif name.startswith("mhagen"):
            raise SystemExit(f"{key} is wrong: max error {err:.3g} > {tol:.3g}")
        else:
            status[key] = f"excluded: max error {err:.3g} > tolerance {tol:.3g}"
    return checked


def core_probe(calls=40):
    """GFLOP/s of a small layer's AVX2 kernels (1x64x128x2, mhagen's x86-avx2 build, L1/L2
    resident; where the host cannot run them, float32 GEMMs of 64^3 in numpy): the
    floating-point throughput the process gets right now, on the calling thread's core at 1
    thread, and at more the slowest of the usable CPUs, the calling thread pinned to each in
    turn (probe_cpus), since a turn at n threads waits for its slowest core.
    On a VM another tenant can share a core's pipes through its sibling hardware thread,
    unseen in /proc/stat, and that costs code with more instructions per flop more:
    on a Zen 4 VM the AVX2 layer (1x512x512x8, 1 thread) took 1.00-1.06x the AVX-512
    layer's time while an AVX2 FMA loop ran at its best and 1.18-1.29x while it ran at half.
    The two cores of that VM are hit apart: probed in turn 40 times (December 6), core 0 ran
    at 75-101 GFLOP/s and core 1 at 76-99, core 1 under 80% of its best in 25 rounds and
    core 0 in 6. AVX2 code is the probe because it loses the most there (the AVX-512 GEMMs of
    OpenBLAS missed a 25% slowdown of the AVX2 kernels). The probe runs on one thread at a
    time: probing on every worker would leave TVM's workers spinning into the next
    implementation's turn."""
    global _PROBE
    if _PROBE is None:
        _PROBE = _avx2_probe() or _numpy_probe()
    run, flops, _ = _PROBE
    threads = mhagen.runtime.num_threads()
    mhagen.runtime.set_num_threads(1)   # no TVM workers woken to spin into the next turn
    try:
        return min(_probe_on(cpu, run, flops, calls)
                   for cpu in (probe_cpus() if threads > 1 else [None]))
    finally:
        mhagen.runtime.set_num_threads(threads)


def probe_cpus():
    """The CPUs a probe at more than one thread visits: every one this process may use
    (TVM's pool places its n threads among them), or [None] (the calling thread where it
    is) where Python cannot pin threads."""
    if not hasattr(os, "sched_getaffinity"):
        return [None]
    return sorted(os.sched_getaffinity(0))


def _probe_on(cpu, run, flops, calls):
    """GFLOP/s of `calls` runs on the calling thread, pinned to `cpu` meanwhile (None: not
    pinned); the thread's CPU set is restored after."""
    saved = None
    if cpu is not None:
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
    try:
        run()
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        return flops * calls / (time.perf_counter() - t0) / 1e9
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


_PROBE = None   # (call, flops, what it runs) once built


def probe_name():
    return _PROBE[2] if _PROBE else "none"


def _avx2_probe():
    """(call, flops, name) of the small layer's kernels built for x86-avx2, or None here."""
    try:
        if platform.machine() != "x86_64" or not mhagen.target.resolve("x86-avx2").runs_here():
            return None
        layer = mhagen.mha(128, 2)
        x = make_input(1, 64, 128)
        kernels = mhagen.build(layer, "x86-avx2", batch=1, seq_len=64,
                               weights=layer.init_weights(0)).prepare(x).kernels
    except Exception:   # the probe is an instrument: numpy's serves where this cannot run
        return None

    def run():
        for f, a in kernels:
            f(*a)
    return run, layer_flops(layer, 1, 64), "a 1x64x128x2 layer's x86-avx2 kernels"


def _numpy_probe():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((PROBE_BATCH, PROBE_N, PROBE_N), dtype=np.float32)
    c = np.empty_like(a)
    return ((lambda: np.matmul(a, a, out=c)), 2 * PROBE_BATCH * PROBE_N ** 3,
            f"numpy float32 GEMMs of {PROBE_N}^3")


def calibrate_probe(tries=15):
    """PROBE_REF: the best of `tries` probes (raised later by any better one)."""
    return seen_probes(core_probe() for _ in range(tries))


def time_interleaved(funcs, x, est, rounds, target_s, gap_s=0.0, probes=None):
    """Rounds; in each every implementation (rotating order) waits gap_s idle (other
    libraries' worker threads stop spinning: OpenBLAS, OpenMP, ORT and TVM pools busy-wait a
    while after a call), runs one untimed warm-up call, then `calls` timed calls.
    probes: a dict filled with name -> the core probe (GFLOP/s) before each of its turns,
    where given.
    Returns name -> list of per-call seconds, one per round."""
    names = list(funcs)
    calls = {n: max(1, min(20, int(round(target_s / max(est[n], 1e-6))))) for n in names}
    samples = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            f = funcs[n]
            if gap_s:
                time.sleep(gap_s)
            if probes is not None:
                probes.setdefault(n, []).append(core_probe())
            f(x)   # warm-up: caches and thread pool after the previous implementation
            t0 = time.perf_counter()
            for _ in range(calls[n]):
                f(x)
            samples[n].append((time.perf_counter() - t0) / calls[n])
    return samples, calls


def seen_probes(values):
    """Raise PROBE_REF (the run's best probe) to the best of these; returns it."""
    global PROBE_REF
    PROBE_REF = max([PROBE_REF, *values])
    return PROBE_REF


def contended_turns(probes):
    """How many turns of a timing attempt ran on a contended core (probe < CONTENDED x the
    run's best, which the attempt's own probes may raise)."""
    flat = [p for ps in probes.values() for p in ps]
    ref = seen_probes(flat)
    return sum(p < CONTENDED * ref for p in flat)


def save_results(out_dir: Path, payload: dict, text: str) -> None:
    """results.json and results.md in out_dir (created): the other bench_*.py scripts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1))
    (out_dir / "results.md").write_text(text + "\n")


def cpu_summary() -> str:
    """The CPU model, LLVM's name for it and its SIMD features, for result files."""
    host = mhagen.target.resolve("x86") if platform.machine() == "x86_64" else None
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            model = m.group(1).strip() if m else model
    except OSError:
        pass
    if host is None:
        return model
    simd = " ".join(f for f in host.features if f.startswith(("avx", "fma")))
    return f"{model} (LLVM {host.cpu}; {simd}; L2 {host.l2_kib} KiB, L3 {host.l3_kib} KiB)"


def loud(msg):
    bar = "!" * 78
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", flush=True)


# -- the ragged batch (--varlen) -----------------------------------------------------------

def parse_varlen(text: str):
    """BxSxDxH:LENS -> ((B, S, D, H), [lens]); B lengths, each 1..S."""
    shape_text, _, lens_text = text.partition(":")
    shape = parse_shape(shape_text)
    lens = lengths_arg(0, "512,400,200,100")(lens_text)
    if len(lens) != shape[0] or max(lens) > shape[1]:
        raise argparse.ArgumentTypeError(
            f"--varlen {text}: give {shape[0]} lengths (one per sequence of the shape's "
            f"batch), each at most seq {shape[1]}")
    return shape, lens


class OrtPaddedBatch:
    """ONNX Runtime on the padded batch [B, S, D] with each row's key mask (op: ort_mha,
    ort_attention), as benchmarks/bench_padding.py."""

    def __init__(self, w, batch, seq, lens, causal, op, threads):
        self.session = ort_session(onnx_model(w, batch, seq, causal, op, key_mask=True),
                                   threads)
        seen = np.arange(seq)[None, :] < np.asarray(lens)[:, None]      # [B, S] keys
        self.mask = seen.astype(np.int32) if op == "ort_mha" else np.ascontiguousarray(
            np.broadcast_to(seen[:, None, None, :], (batch, 1, seq, seq)))

    def __call__(self, x):
        return self.session.run(None, {"x": x, "key_mask": self.mask})[0]


def varlen_impls(layer, padded_layer, w, shape, lens, causal, threads, status):
    """name -> (call of no argument, its answer's real rows [1, total, D] from its output)."""
    B, S, D, H = shape
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = make_input(1, int(cu[-1]), D, seed=3)
    padded = np.zeros((B, S, D), np.float32)
    for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        padded[b, :e - a] = x[0, a:e]
    seqs = [np.ascontiguousarray(x[:, a:e]) for a, e in zip(cu[:-1], cu[1:]) if e > a]
    rows = lambda y: np.concatenate([y[b:b + 1, :n] for b, n in enumerate(lens)], axis=1)
    packed = mhagen.build(layer, TARGET, batch=None, max_batch=B, seq_len=None,
                          max_seq_len=S, weights=w)
    out = mhagen.aligned_empty(x.shape)
    padded_module = mhagen.build(padded_layer, TARGET, batch=B, seq_len=S, weights=w)
    kv_lens = np.asarray(lens, np.int32)
    impls = {"mhagen_packed": (lambda: packed(x, cu_seqlens=cu, out=out), lambda y: y),
             "mhagen_own": (lambda: [packed(s) for s in seqs],
                            lambda ys: np.concatenate(ys, axis=1)),
             "mhagen_padded": (lambda: padded_module(padded, kv_lens=kv_lens), rows)}
    for op in ("ort_mha", "ort_attention"):
        try:
            ort = OrtPaddedBatch(w, B, S, lens, causal, op, threads)
            impls[f"{op}_padded"] = ((lambda o: lambda: o(padded))(ort), rows)
        except Exception as err:     # a peer that cannot run here is reported, not fatal
            status[f"{op}_padded"] = f"unavailable: {type(err).__name__}: {str(err)[:160]}"
    return impls, x, cu


def run_varlen(spec, causal, args, status):
    """Check and time the ragged batch at every thread count: rows of the varlen table."""
    shape, lens = spec
    B, S, D, H = shape
    layer = mhagen.mha(D, H, causal=causal)
    padded_layer = mhagen.mha(D, H, causal=causal, key_padding=True)
    w = layer.init_weights(0)
    name = f"{shape_name(shape)}:{','.join(map(str, lens))} mask={mask_name(causal)}"
    print(f"\n== varlen {name}", flush=True)
    out = []
    for n in args.threads:
        set_threads(n)
        impls, x, cu = varlen_impls(layer, padded_layer, w, shape, lens, causal, n, status)
        expected = layer.reference(x, w, cu_seqlens=cu)
        checked = {k: (lambda f: lambda _: f())(f) for k, (f, real) in impls.items()
                   if _varlen_ok(k, f, real, expected, status)}
        est = {}
        for k, f in checked.items():
            t0 = time.perf_counter()
            f(None)
            est[k] = time.perf_counter() - t0
        samples, _ = time_interleaved(checked, None, est, args.rounds, args.target_ms / 1e3,
                                      args.gap_ms / 1e3 if n > 1 else 0.0)
        med = {k: float(np.median(v)) * 1e3 for k, v in samples.items()}
        orts = [med[k] for k in ("ort_mha_padded", "ort_attention_padded") if k in med]
        p = med["mhagen_packed"]
        row = {"case": name, "shape": shape_name(shape), "lens": lens, "mask": mask_name(causal),
               "threads": n, "median_ms": med,
               "packed_vs_own": p / med["mhagen_own"], "packed_vs_padded": p / med["mhagen_padded"],
               "packed_vs_ort": p / min(orts) if orts else None}
        out.append(row)
        print(f"  threads={n}: " + "  ".join(f"{k} {v:.2f}ms" for k, v in med.items())
              + f"  packed/own {row['packed_vs_own']:.2f}, packed/padded "
              f"{row['packed_vs_padded']:.2f}, packed/ORT "
              f"{fmt(row['packed_vs_ort'], '.2f')}", flush=True)
        impls.clear()
        checked.clear()
    return out


def _varlen_ok(name, f, real, expected, status):
    """Whether impl `name` (call f, its real rows by `real`) matches the packed reference;
    its max error (or failure) into status. mhagen's failing ends the run."""
    try:
        y = real(f())
    except Exception as err:    # a peer that cannot run is reported, not fatal
        if name.startswith("mhagen"):
            raise
        status[name] = f"unavailable: {type(err).__name__}: {str(err)[-160:]}"
        return False
    err, tol = tolerances.max_error(y, expected), tolerances.tolerance(expected)
    status[name] = f"max error {err:.3g} (tolerance {tol:.3g})"
    if err <= tol:
        return True
    if name.startswith("mhagen"):
        raise SystemExit(f"{name} is wrong on the ragged batch: max error {err:.3g} > {tol:.3g}")
    status[name] = f"excluded: max error {err:.3g} > tolerance {tol:.3g}"
    return False


def varlen_markdown(rows, status, meta) -> str:
    impls = list(dict.fromkeys(k for r in rows for k in r["median_ms"]))
    lines = [f"Ragged batch, packed (--varlen): {meta['cpu']}; target {TARGET}; medians in ms, "
             "ratios of mhagen_packed's median (targets: / own <= 1.1, / ORT padded <= 0.9)",
             "", "| case | threads | " + " | ".join(impls)
             + " | packed / own | packed / padded | packed / ORT |",
             "|---|---:|" + "---:|" * (len(impls) + 3)]
    for r in rows:
        lines.append(f"| {r['case']} | {r['threads']} | "
                     + " | ".join(fmt(r["median_ms"].get(k), ".2f") for k in impls)
                     + f" | {r['packed_vs_own']:.2f} | {r['packed_vs_padded']:.2f} | "
                     f"{fmt(r['packed_vs_ort'], '.2f')} |")
    lines += ["", *[f"- {k}: {v}" for k, v in status.items()]]
    return "\n".join(lines)


# -- the benchmark ------------------------------------------------------------------------

def run_case(shape, causal, args, status, rows, memory_specs):
    """Check and time every implementation on one shape and mask, at every thread count."""
    b, s, d_model, heads = shape
    layer = mhagen.mha(d_model, heads, causal=causal)
    w = layer.init_weights(0)
    x = make_input(b, s, d_model)
    t0 = time.perf_counter()
    ref = layer.reference(x, w)
    tol = tolerances.tolerance(ref)
    print(f"\n== {shape_name(shape)} mask={mask_name(causal)}  (reference "
          f"{time.perf_counter() - t0:.1f} s, tolerance {tol:.2g})", flush=True)
    flops = layer_flops(layer, b, s)
    shared, errors, failed = {}, {}, set()
    base = {"batch": b, "seq": s, "d_model": d_model, "heads": heads, "mask": mask_name(causal),
            "shape": shape_name(shape), "flops": flops}
    for n in args.threads:
        set_threads(n)
        live, est, case_rows = {}, {}, {}
        for name in active_impls():
            row = dict(base, impl=name, threads=n, checked=False, status="ok")
            case_rows[name] = row
            rows.append(row)
            if name not in args.impls:
                row["status"] = "skipped (--impls)"
                continue
            if status[name]:
                row["status"] = status[name]
                continue
            if name in errors:
                row["status"] = errors[name]
                continue
            if name in failed:
                row["status"] = "check failed (excluded)"
                continue
            try:
                impl = shared.get(name)
                if impl is None:
                    t1 = time.perf_counter()
                    impl = make_impl(name, layer, w, b, s, causal, n)
                    if name == "mhagen":
                        row["build_s"] = time.perf_counter() - t1
                        flops = impl.kernel.flops()
                        base["flops"] = row["flops"] = flops
                    if not impl.per_thread:
                        shared[name] = impl
                y = impl(x)
            except Exception as err:  # a peer that does not run here: reported, excluded
                msg = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
                if not FACTORIES[name].per_thread:
                    errors[name] = msg
                row["status"] = msg
                loud(f"{name} failed to run on {shape_name(shape)} {mask_name(causal)} "
                     f"({n} threads): {msg}")
                if args.verbose:
                    traceback.print_exc()
                continue
            err = tolerances.max_error(y, ref) if y.shape == ref.shape else float("inf")
            ok = y.shape == ref.shape and bool(np.all(np.isfinite(y))) and err <= tol
            row.update(max_error=err, tolerance=tol, checked=ok)
            if not ok:
                row["status"] = "check failed (excluded)"
                failed.add(name)
                loud(f"CHECK FAILED: {name} on {shape_name(shape)} mask={mask_name(causal)} "
                     f"threads={n}: max error {err:.3g} > tolerance {tol:.3g} "
                     f"(shape {y.shape}); excluded from timing")
                continue
            t1 = time.perf_counter()
            impl(x)
            est[name] = time.perf_counter() - t1
            live[name] = impl
        attempt = None
        for k in range(1 + max(0, args.retries)):
            waited = wait_quiet(args.wait_quiet) if args.wait_quiet else 0.0
            load, probes = LoadMeter(), {}
            samples, calls = time_interleaved(live, x, est, args.rounds, args.target_ms / 1e3,
                                              args.gap_ms / 1e3 if n > 1 else 0.0,
                                              probes=probes)
            other = load.other_cores()
            turns = sum(len(v) for v in probes.values())
            contended = contended_turns(probes)
            # least disturbed: fewest contended turns, then least CPU used by others
            badness = (contended, other if other is not None else 0.0)
            if attempt is None or badness < attempt[4]:
                attempt = (samples, calls, other, probes, badness)
            quiet = (other is None or other < DISTURBED) and contended <= turns // 4
            if quiet:
                break
            if k < args.retries:
                why = [f"other processes used {other:.2f} cores"] if other is not None \
                    and other >= DISTURBED else []
                if contended > turns // 4:
                    why.append(f"{contended} of {turns} turns ran on a contended core "
                               f"(core probe < {CONTENDED:.0%} of its best)")
                print(f"  threads={n}: {' and '.join(why)} while timing (waited {waited:.0f} "
                      "s); timing again", flush=True)
        samples, calls, other, probes, _ = attempt
        for name, r in case_rows.items():
            r["timing_attempts"] = k + 1
            if name in probes:
                r["probe_share"] = [p / PROBE_REF for p in probes[name]]
                r["contended_rounds"] = sum(p < CONTENDED * PROBE_REF for p in probes[name])
        if "mhagen" in live:   # kernels only, buffers prepared: what kernel.latency() reports
            case_rows["mhagen"]["kernel_only_ms"] = live["mhagen"].kernel.latency(
                number=calls["mhagen"], repeat=3, min_repeat_ms=0) * 1e3
        for r in case_rows.values():
            r["other_load_cores"] = other
        for name, ts in samples.items():
            med = float(np.median(ts))
            case_rows[name].update(median_ms=med * 1e3, min_ms=float(np.min(ts)) * 1e3,
                                   samples_ms=[t * 1e3 for t in ts], calls_per_round=calls[name],
                                   gflops=flops / med / 1e9)
        timed = [r for r in case_rows.values() if "median_ms" in r]
        if timed:   # mhagen_host (this host's own class) is a reference, not a contender
            best = min((r["median_ms"] for r in timed if r["impl"] != "mhagen_host"),
                       default=min(r["median_ms"] for r in timed))
            for r in timed:
                r["ratio_to_fastest"] = r["median_ms"] / best
                r["fastest"] = r["median_ms"] == best and r["impl"] != "mhagen_host"
        for r in case_rows.values():
            r["flops"] = flops
        line = "  ".join(f"{r['impl']} {r['median_ms']:.2f}ms" for r in timed)
        print(f"  threads={n}: {line}  [other processes: "
              f"{fmt(other, '.2f', '?')} cores busy]", flush=True)
        # ORT sessions hold their own thread pools: drop them before the next thread count
        live.clear()
    shared.clear()
    if not args.no_memory:
        mt = max(args.threads)
        for name in active_impls():
            if name in args.impls and not status[name] and name not in errors \
                    and name not in failed:
                memory_specs.append({"impl": name, "shape": list(shape), "causal": causal,
                                     "threads": mt, "target": TARGET})


def measure_memory(memory_specs, rows):
    print(f"\n== peak memory: {len(memory_specs)} child processes", flush=True)
    for spec in memory_specs:
        res = run_child(spec)
        key = (spec["impl"], shape_name(spec["shape"]), mask_name(spec["causal"]))
        for r in rows:
            if (r["impl"], r["shape"], r["mask"]) == key:
                if "error" in res:
                    r["memory_error"] = res["error"]
                else:
                    r["peak_mem_mb"] = res["peak_bytes"] / 2**20
                    r["setup_mem_mb"] = (res["setup_bytes"] / 2**20
                                         if res.get("setup_bytes") is not None else None)
                    r["memory_threads"] = res["threads"]
                    r["memory_method"] = res["method"]
        shown = (f"{res['peak_bytes'] / 2**20:.1f} MiB" if "error" not in res
                 else res["error"])
        print(f"  {key[0]:<14} {key[1]:<16} {key[2]:<7} {shown}", flush=True)


def peak_shares(rows, impl, threads, peak):
    """shape -> share of the sgemm peak of impl's unmasked rows at seq >= 512 (the shares
    issue 11 compares)."""
    return {r["shape"]: r["gflops"] / peak for r in rows
            if r["impl"] == impl and r["threads"] == threads and r["mask"] == "none"
            and r["seq"] >= 512 and "median_ms" in r}


def summarize(rows, threads, peaks):
    out = {}
    for n in threads:
        mh = [r for r in rows if r["impl"] == "mhagen" and r["threads"] == n
              and "median_ms" in r]
        nomask = [r for r in mh if r["mask"] == "none"]
        shapes_nomask = sorted({r["shape"] for r in rows if r["threads"] == n
                                and r["mask"] == "none"})
        fastest = [r["shape"] for r in nomask if r.get("fastest")]
        worst = max(mh, key=lambda r: r["ratio_to_fastest"]) if mh else None
        worst_fastest = None
        if worst:
            worst_fastest = next((r["impl"] for r in rows if r["threads"] == n
                                  and r["shape"] == worst["shape"] and r["mask"] == worst["mask"]
                                  and r.get("fastest")), None)
        peak = peaks[str(n)]["gflops"]
        share = peak_shares(rows, "mhagen", n, peak)
        causal_ratio = {}
        for r in rows:
            if r["threads"] == n and r["seq"] == 2048 and r["mask"] == "causal" \
                    and "median_ms" in r:
                other = next((o for o in rows if o["threads"] == n and o["impl"] == r["impl"]
                              and o["shape"] == r["shape"] and o["mask"] == "none"
                              and "median_ms" in o), None)
                if other:
                    causal_ratio.setdefault(r["impl"], {})[r["shape"]] = \
                        r["median_ms"] / other["median_ms"]
        s = {"threads": n, "mhagen_fastest_nomask": len(fastest),
             "nomask_shapes": len(shapes_nomask), "mhagen_fastest_shapes": fastest,
             "worst_ratio": worst["ratio_to_fastest"] if worst else None,
             "worst_at": f"{worst['shape']} {worst['mask']}" if worst else None,
             "worst_fastest_impl": worst_fastest,
             "mhagen_peak_share_seq512_nomask": share, "sgemm_peak_gflops": peak,
             "causal_over_nomask_seq2048": causal_ratio}
        parts = [f"threads={n}: mhagen fastest on {len(fastest)}/{len(shapes_nomask)} "
                 "no-mask shapes"]
        if worst:
            parts.append(f"worst mhagen/fastest {worst['ratio_to_fastest']:.2f} "
                         f"({s['worst_at']}, fastest {worst_fastest})")
        else:
            parts.append("worst mhagen/fastest n/a (mhagen not timed)")
        if share:
            parts.append("mhagen share of sgemm peak "
                         f"({peak:.0f} GFLOP/s) at seq>=512 no mask: " +
                         ", ".join(f"{k} {v:.0%}" for k, v in share.items()))
        else:
            parts.append("mhagen share of sgemm peak at seq>=512 no mask: n/a (no such shape)")
        mr = causal_ratio.get("mhagen")
        if mr:
            others = ", ".join(f"{impl} {v:.2f}" for impl, d in causal_ratio.items()
                               if impl != "mhagen" for v in d.values())
            parts.append("causal/no-mask time at seq 2048: mhagen " +
                         ", ".join(f"{v:.2f}" for v in mr.values()) +
                         (f" (peers: {others})" if others else ""))
        else:
            parts.append("causal/no-mask time at seq 2048: n/a (no seq-2048 shape timed)")
        host_peak = peaks[str(n)].get("host_gflops")
        host_share = peak_shares(rows, "mhagen_host", n, host_peak) if host_peak else {}
        if host_share:
            s["host_class_peak_share_seq512_nomask"] = host_share
            s["host_sgemm_peak_gflops"] = host_peak
            parts.append(f"same run, this host's own class: mhagen_host share of its sgemm "
                         f"peak ({host_peak:.0f} GFLOP/s) at seq>=512 no mask: " +
                         ", ".join(f"{k} {v:.0%}" for k, v in host_share.items()) +
                         " (--target's share minus it: " +
                         ", ".join(f"{k} {100 * (share[k] - v):+.0f} points"
                                   for k, v in host_share.items() if k in share) + ")")
        any_len = {r["shape"] + " " + r["mask"]: o["median_ms"] / r["median_ms"]
                   for r in mh for o in rows if o["impl"] == "mhagen_any_len"
                   and o["threads"] == n and o["shape"] == r["shape"]
                   and o["mask"] == r["mask"] and "median_ms" in o}
        s["any_len_over_exact"] = any_len
        if any_len:
            parts.append("any-length module / exact build: " +
                         ", ".join(f"{k} {v:.2f}" for k, v in any_len.items()))
        s["line"] = "; ".join(parts)
        out[str(n)] = s
    return out


def row_peak(row, peak):
    """The sgemm peak a row's share is of: mhagen_host's is the host class's own."""
    if row["impl"] == "mhagen_host" and "host_gflops" in peak:
        return peak["host_gflops"]
    return peak["gflops"]


def fmt(v, spec, missing="—"):
    return missing if v is None else format(v, spec)


def markdown(meta, peaks, rows, summary, impl_status, long_result):
    lines = ["# mhagen multi-head attention benchmark", ""]
    lines.append(f"{meta['date']} · {meta['cpu']} · {meta['cores']} cores · "
                 f"python {meta['python']} · numpy {meta['numpy']} ({meta['numpy_blas']}) · "
                 f"torch {meta.get('torch', '-')} · onnxruntime {meta.get('onnxruntime', '-')}")
    lines.append("")
    if "target" in meta:
        t, h = meta["target"], meta["host"]
        lines.append(f"mhagen target **{t['preset']}** (class {t['cpu_class']}, LLVM cpu "
                     f"{t['llvm_cpu']}) on a host whose LLVM cpu is **{h['llvm_cpu']}** (class "
                     f"{h['cpu_class']}; L1d {h['l1d_kib']} KiB, L2 {h['l2_kib']} KiB, L3 "
                     f"{h['l3_kib']} KiB; {' '.join(h['simd_features'])}).")
        lines.append("")
    env = ", ".join(f"{k}={v}" for k, v in meta["env"].items() if v is not None) or "none set"
    lines.append(f"Thread-related environment: {env}.")
    lines.append("")
    lines.append("Whole layer in float32 (QKV projections + attention + output projection), same "
                 "weights everywhere; every output checked against the float64 reference "
                 "(mhagen.tolerances) before timing. Times are medians over interleaved rounds; "
                 "GFLOP/s use the same dense flop count for all (kernel.flops(), masked work "
                 "included); × fastest is the time ratio to the fastest checked implementation "
                 "on that row group; peak MB is the peak RSS above the child process's baseline "
                 f"(after imports, inputs, weights and setup) at {max(meta['threads'])} "
                 "thread(s).")
    lines.append("")
    lines.append("## Implementations")
    lines.append("")
    for name in active_impls():
        lines.append(f"- **{name}**: {impl_status[name]} — {DESCRIPTIONS[name]}")
    lines.append("")
    for n in meta["threads"]:
        p = peaks[str(n)]
        if not any(r["threads"] == n for r in rows):
            lines.append(f"sgemm peak at {n} thread(s): {p['gflops']:.1f} GFLOP/s.")
            lines.append("")
            continue
        lines.append(f"## {n} thread{'s' if n > 1 else ''}")
        lines.append("")
        lines.append(f"sgemm peak ({p['shape']} fp32, median of {p['runs']}, measured at the "
                     f"{p.get('when', 'start')} of the run): "
                     f"**{p['gflops']:.1f} GFLOP/s** (numpy {p['numpy_gflops']:.1f}"
                     + (f", torch {p['torch_gflops']:.1f}" if "torch_gflops" in p else "")
                     + ")" + (f"; this host's own class (BLAS without the AVX2 settings, in a "
                              f"child process right after): **{p['host_gflops']:.1f} GFLOP/s** "
                              f"(numpy {p['host_numpy_gflops']:.1f}"
                              + (f", torch {p['host_torch_gflops']:.1f}"
                                 if "host_torch_gflops" in p else "") + "), the peak of the "
                              "mhagen_host rows" if "host_gflops" in p else ""))
        lines.append("")
        lines.append("| shape BxSxDxH | mask | implementation | median ms | GFLOP/s | × fastest "
                     "| % sgemm peak | peak MB | max err (tol) | status |")
        lines.append("|---|---|---|---:|---:|---:|---:|---:|---|---|")
        for r in rows:
            if r["threads"] != n:
                continue
            timed = "median_ms" in r
            ratio = fmt(r.get("ratio_to_fastest"), ".2f")
            if r.get("fastest"):
                ratio = f"**{ratio}**"
            err = (f"{r['max_error']:.1e} ({r['tolerance']:.1e})" if "max_error" in r else "—")
            mem = fmt(r.get("peak_mem_mb"), ".1f",
                      "err" if r.get("memory_error") else "—")
            name = f"**{r['impl']}**" if r["impl"] == "mhagen" else r["impl"]
            lines.append(
                f"| {r['shape']} | {r['mask']} | {name} | "
                f"{fmt(r.get('median_ms'), '.3f')} | {fmt(r.get('gflops'), '.1f')} | {ratio} | "
                f"{(format(r['gflops'] / row_peak(r, p), '.0%') if timed else '—')} | {mem} | "
                f"{err} | {r['status'] if r['status'] != 'ok' else 'ok, checked'}"
                + (f", contended {r['contended_rounds']}/{len(r['probe_share'])}"
                   if r.get("contended_rounds") else "") + " |")
        lines.append("")
        mine = [r for r in rows if r["threads"] == n]
        if any("probe_share" in r for r in mine):
            lines.append(f"Core probe ({meta.get('probe', probe_name())} on the calling "
                         f"thread before each turn, best "
                         f"{PROBE_REF or p.get('probe_gflops', 0.0):.1f} GFLOP/s): "
                         f"a turn below {CONTENDED:.0%} of the best ran on a core "
                         "shared with work this machine cannot see (a VM's sibling hardware "
                         "thread), marked \"contended k/rounds\" in the status; code with more "
                         "instructions per flop (AVX2 against AVX-512) loses more there.")
            lines.append("")
        ko = [f"{r['shape']} {r['mask']} {r['kernel_only_ms']:.3f}" for r in mine
              if r["impl"] == "mhagen" and "kernel_only_ms" in r]
        if ko:
            lines.append("mhagen kernels only (kernel.latency(): weights bound, buffers "
                         "prepared, no numpy copies), ms: " + ", ".join(ko) + ".")
            lines.append("")
        loads = {}
        for r in mine:
            if r.get("other_load_cores") is not None:
                loads[f"{r['shape']} {r['mask']}"] = r["other_load_cores"]
        if loads or p.get("other_load_cores") is not None:
            worst = max(list(loads.values()) + [p.get("other_load_cores") or 0.0])
            lines.append("CPU used by other processes while timing (cores): sgemm "
                         f"{fmt(p.get('other_load_cores'), '.2f', '?')}, " +
                         ", ".join(f"{k} {v:.2f}" for k, v in loads.items()) +
                         (f" — **disturbed** (up to {worst:.2f} of {meta['cores']} cores busy "
                          "elsewhere)" if worst >= DISTURBED else " (quiet)") + ".")
            lines.append("")
        lines.append(f"**Summary:** {summary[str(n)]['line']}")
        lines.append("")
    if long_result is not None:
        lines += long_markdown(long_result, peaks)
    return "\n".join(lines) + "\n"


def long_markdown(res, peaks):
    lines = ["## Long sequence (mhagen only)", ""]
    if "error" in res:
        return lines + [f"long case failed: {res['error']}", ""]
    shape = shape_name(res["shape"])
    lines.append(f"Shape {shape} (batch x seq x d_model x heads), no mask; built in "
                 f"{res['build_s']:.1f} s; {res['flops'] / 1e9:.0f} GFLOP per call.")
    lines.append("")
    lines.append("| threads | median s | GFLOP/s | % sgemm peak | other processes (cores) |")
    lines.append("|---:|---:|---:|---:|---:|")
    for n, lat in res["latency"].items():
        ms = lat["median_ms"]
        gf = res["flops"] / (ms / 1e3) / 1e9
        peak = peaks.get(n, {}).get("gflops")
        lines.append(f"| {n} | {ms / 1e3:.2f} | {gf:.1f} | "
                     f"{format(gf / peak, '.0%') if peak else '—'} | "
                     f"{fmt(lat.get('other_load_cores'), '.2f', '?')} |")
    lines.append("")
    lines.append(f"Peak RSS at {res['threads_for_peak']} thread(s): "
                 f"**{res['peak_bytes'] / 2**20:.0f} MiB above baseline**, process peak "
                 f"{res['peak_abs_bytes'] / 2**30:.2f} GiB (baseline "
                 f"{res['baseline_bytes'] / 2**20:.0f} MiB: python, TVM, the built module, "
                 f"x and weights) — {'under' if res['peak_abs_bytes'] < 2**31 else 'OVER'} "
                 "2 GiB.")
    lines.append("")
    lines.append("Checked (the full float64 reference at this size is too slow and large):")
    for c in res["checks"]:
        lines.append(f"- {c['what']}: max error {c['max_error']:.2e} "
                     f"(tolerance {c['tolerance']:.2e}) {'ok' if c['ok'] else 'FAILED'}")
    lines.append("")
    return lines


def plot(rows, peaks, threads, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        print(f"plot skipped: matplotlib unavailable ({err})")
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(threads), 2, figsize=(13, 3.8 * len(threads)), squeeze=False)
    impls = active_impls()
    width = 0.8 / len(impls)
    for i, n in enumerate(threads):
        for j, mask in enumerate(("none", "causal")):
            ax = axes[i][j]
            for k, name in enumerate(impls):
                vals = []
                for sh in shapes:
                    r = next((r for r in rows if r["impl"] == name and r["threads"] == n
                              and r["mask"] == mask and r["shape"] == sh), None)
                    vals.append(r.get("gflops", 0.0) if r else 0.0)
                xs = [p + (k - (len(impls) - 1) / 2) * width for p in range(len(shapes))]
                ax.bar(xs, vals, width, label=name)
            ax.axhline(peaks[str(n)]["gflops"], color="k", ls="--", lw=1, label="sgemm peak")
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=8)
            ax.set_ylabel("GFLOP/s")
            ax.set_title(f"mask={mask}, {n} thread{'s' if n > 1 else ''}")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.8 * len(threads))))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine_meta(args):
    import numpy
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "numpy": numpy.__version__, "mhagen": mhagen.__version__,
            "threads": args.threads, "rounds": args.rounds, "quick": args.quick,
            "gap_ms": args.gap_ms, "wait_quiet_s": args.wait_quiet, "retries": args.retries,
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                   "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                   "MKL_NUM_THREADS", "TVM_NUM_THREADS",
                                                   "MKL_ENABLE_INSTRUCTIONS")}}
    t, host = args.target_info, args.host_info
    meta["target"] = {"preset": t.name, "cpu_class": t.cpu_class, "llvm_cpu": t.cpu,
                      "vector_bits": t.vector_bits, "vector_registers": t.vector_registers}
    meta["host"] = {"llvm_cpu": host.cpu, "cpu_class": host.cpu_class,
                    "l1d_kib": host.l1d_kib, "l2_kib": host.l2_kib, "l3_kib": host.l3_kib,
                    "simd_features": [f for f in host.features
                                      if f.startswith(("avx", "fma", "sse4"))]}
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            if m:
                meta["cpu"] = m.group(1).strip()
    except OSError:
        pass
    meta["cores"] = mhagen.host.host_cores()
    meta["cpus"] = len(mhagen.host.usable_cpus())
    blas = "BLAS unknown"
    try:
        from threadpoolctl import threadpool_info
        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            blas = f"{info[0].get('internal_api')} {info[0].get('architecture', '')}".strip()
    except ImportError:
        blas = "threadpoolctl missing: numpy threads not controlled"
    meta["numpy_blas"] = blas
    for mod in ("torch", "onnxruntime", "onnx"):
        if mod in sys.modules:
            meta[mod] = sys.modules[mod].__version__
    try:
        import tvm
        meta["tvm"] = tvm.__version__
    except Exception:
        pass
    return meta


def runnable_target(parser, name):
    """The resolved --target, or the parser's error (exit 2) when the benchmark cannot run
    its code on this machine (another arch, CPU features this one lacks)."""
    try:
        target = mhagen.target.resolve(name)
    except mhagen.TargetError as err:
        parser.error(str(err))
    if not target.runs_here():
        parser.error(f"--target {name}: the benchmark runs the code here, but "
                     f"{target.cannot_run()}")
    return target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="first shape only, fewer rounds, 1 thread (unless --threads)")
    p.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1 2)")
    p.add_argument("--shapes", nargs="+", metavar="BxSxDxH",
                   help="shapes batch x seq x d_model x heads (default: "
                        + " ".join(shape_name(s) for s in DEFAULT_SHAPES)
                        + "); 'none' for no shapes (with --long)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="implementations to run (default: all)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 7, quick 3)")
    p.add_argument("--target-ms", type=float,
                   help="aim for this many ms per implementation per round (default 40, quick 15)")
    p.add_argument("--gap-ms", type=float, default=GAP_MS,
                   help="idle gap before each implementation's turn in a round when threads > 1 "
                        f"(lets the previous library's spinning worker threads park; default "
                        f"{GAP_MS:g})")
    p.add_argument("--wait-quiet", type=float, metavar="S",
                   help="before each timing phase wait up to S seconds for other processes to "
                        "use < 0.2 cores (shared machines; default 30, quick 5; 0: no wait)")
    p.add_argument("--retries", type=int,
                   help="time a shape/mask/threads group again (keeping the least disturbed "
                        "attempt) when other processes used >= 0.25 cores meanwhile "
                        "(default 2, quick 0)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the per-implementation peak-memory child processes")
    p.add_argument("--long", action="store_true",
                   help="also run the long case: mhagen only, 1x16384x1024x16, no mask "
                        "(latency and peak RSS in a child process)")
    p.add_argument("--target", default="x86",
                   help="mhagen's target preset (default x86: this CPU; x86-avx2: the AVX2 "
                        "class, on any host)")
    p.add_argument("--varlen", type=parse_varlen, metavar="BxSxDxH:LENS",
                   help="also the ragged batch of B sequences of LENS tokens (e.g. "
                        "4x512x768x12:512,400,200,100): packed vs each sequence's own calls "
                        "vs padded (mhagen, ONNX Runtime); --shapes none for it alone")
    p.add_argument("--out-dir",
                   help="where to write results.md, results.json, results.png (default "
                        "benchmarks/results/<cpu class>_on_<host cpu>/)")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failing peers")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.target_info = runnable_target(p, args.target)
    args.host_info = mhagen.target.resolve("x86")
    if args.out_dir is None:
        args.out_dir = str(HERE / "results" / f"{args.target_info.cpu_class}_on_"
                           f"{args.host_info.cpu}")
    if args.shapes is None:
        args.shapes = DEFAULT_SHAPES[:1] if args.quick else list(DEFAULT_SHAPES)
    elif [s.lower() for s in args.shapes] == ["none"]:
        args.shapes = []
    else:
        try:
            args.shapes = [parse_shape(s) for s in args.shapes]
        except argparse.ArgumentTypeError as err:
            p.error(str(err))
    if args.threads is None:
        args.threads = [1] if args.quick else [1, 2]
    cpus = len(mhagen.host.usable_cpus())
    bad = [n for n in args.threads if n < 1 or n > cpus]
    if bad:
        p.error(f"--threads {bad}: this machine lets us use 1..{cpus} threads")
    args.threads = sorted(set(args.threads))
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.wait_quiet is None:
        args.wait_quiet = 5.0 if args.quick else 30.0
    if args.retries is None:
        args.retries = 0 if args.quick else 2
    if args.target_ms is None:
        args.target_ms = 15.0 if args.quick else 40.0
    if not args.shapes and not args.long and not args.varlen:
        p.error("nothing to run: give --shapes, --long or --varlen")
    return args


def narrower_than_host(target, host) -> bool:
    """True when the target's vectors are narrower than this CPU's (AVX2 code on an AVX-512
    host): the peers' BLAS should then be held to the same class."""
    return target.vector_bits < host.vector_bits


def main(argv=None):
    global TARGET
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if "peak" in spec:   # the host class's sgemm peak (measure_peak)
            try:
                import torch  # noqa: F401  (the peak is the best of numpy and torch)
            except ImportError:
                pass
            set_threads(spec["peak"])
            res = sgemm_peak(spec["peak"], spec["runs"])
        else:
            TARGET = spec.get("target", TARGET)
            res = memory_child(spec)
        print("CHILD-RESULT " + json.dumps(res), flush=True)
        return 0
    TARGET = args.target
    if narrower_than_host(args.target_info, args.host_info) and any(
            os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # re-run with the peers' BLAS held to AVX2 (read at library load, so before imports)
        print(f"--target {args.target} on a wider host: re-running with "
              + " ".join(f"{k}={v}" for k, v in AVX2_ENV.items()), flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  dict(os.environ, **AVX2_ENV))
    status = peer_status(IMPLS)
    global HOST_PEAK_ENV
    if narrower_than_host(args.target_info, args.host_info):
        HOST_PEAK_ENV = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    for name in active_impls():
        if status[name]:
            loud(f"peer {name} is {status[name]}: reported as missing")
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(k):
            print(f"note: {k}={os.environ[k]} is set; numpy's OpenBLAS may be slowed. For a fair "
                  "numpy number run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python "
                  "benchmarks/bench_mha.py")
    have_tpc = set_threads(args.threads[0])
    if not have_tpc:
        print("note: threadpoolctl is missing: numpy's BLAS threads are not controlled")
    meta = machine_meta(args)
    print(f"mhagen benchmark: {meta['cpu']}, {meta['cores']} cores, threads {args.threads}, "
          f"shapes {[shape_name(s) for s in args.shapes]}, rounds {args.rounds}", flush=True)

    peaks = {}
    for n in args.threads if args.shapes or args.long else ():
        measure_peak(n, args, peaks, "start")

    rows, memory_specs = [], []
    t_start = time.perf_counter()
    for shape in args.shapes:
        for causal in MASKS:
            run_case(shape, causal, args, status, rows, memory_specs)
    for n in args.threads if peaks else ():   # a busy neighbour at the start: measure
        if ((peaks[str(n)]["other_load_cores"] or 0.0) >= DISTURBED     # again at the end
                or peaks[str(n)]["probe_share"] < CONTENDED) and rows:
            measure_peak(n, args, peaks, "end")
    if memory_specs:
        measure_memory(memory_specs, rows)
    varlen_rows, varlen_status = [], {}
    for causal in (MASKS if args.varlen else ()):
        varlen_rows += run_varlen(args.varlen, causal, args, varlen_status)

    long_result = None
    if args.long:
        print(f"\n== long case {shape_name(LONG_SHAPE)} (mhagen only, child process)",
              flush=True)
        long_result = run_child({"mode": "long", "shape": list(LONG_SHAPE), "target": TARGET,
                                 "threads": args.threads, "calls": 2 if args.quick else 3},
                                timeout=3600)

    impl_status = {}
    for name in active_impls():
        mine = [r for r in rows if r["impl"] == name]
        if name not in args.impls:
            impl_status[name] = "skipped (--impls)"
        elif status[name]:
            impl_status[name] = status[name]
        elif not mine:
            impl_status[name] = "not run"
        elif all(r["checked"] for r in mine):
            impl_status[name] = "ok, checked on every shape/mask/threads"
        else:
            bad = sorted({f"{r['shape']} {r['mask']} {r['threads']}t: {r['status']}"
                          for r in mine if not r["checked"]})
            impl_status[name] = "EXCLUDED where it failed: " + "; ".join(bad)
    summary = summarize(rows, args.threads, peaks) if rows else {
        str(n): {"line": f"threads={n}: no shapes run"} for n in args.threads}
    meta["elapsed_s"] = time.perf_counter() - t_start
    meta["probe"] = probe_name()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if varlen_rows:
        save_results(out / "varlen", {"meta": meta, "rows": varlen_rows,
                                      "status": varlen_status},
                     varlen_markdown(varlen_rows, varlen_status, meta))
        print("\n" + varlen_markdown(varlen_rows, varlen_status, meta))
    if not rows and not long_result:
        print(f"wrote {out / 'varlen' / 'results.md'}")
        return 0
    md = markdown(meta, peaks, rows, summary, impl_status, long_result)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "implementations": impl_status, "sgemm_peak": peaks, "rows": rows,
         "summary": summary, "long": long_result}, indent=1))
    png = plot(rows, peaks, args.threads, out / "results.png") if rows else None
    print("\n" + md)
    for n in args.threads:
        print("SUMMARY " + summary[str(n)]["line"])
    if long_result is not None and "error" not in long_result:
        lat = ", ".join(f"{n} thr {v['median_ms'] / 1e3:.2f} s"
                        for n, v in long_result["latency"].items())
        print(f"LONG {shape_name(LONG_SHAPE)}: {lat}; peak RSS "
              f"{long_result['peak_bytes'] / 2**20:.0f} MiB above baseline, process "
              f"{long_result['peak_abs_bytes'] / 2**30:.2f} GiB; checked="
              f"{long_result['checked']}")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}"
          + (f", {png}" if png else ""))

    mh = [r for r in rows if r["impl"] in ("mhagen", "mhagen_any_len")
          and r["impl"] in args.impls]
    bad = [r for r in mh if not r["checked"]]
    if bad:
        loud("mhagen FAILED its check on: " + "; ".join(
            f"{r['shape']} {r['mask']} {r['threads']}t ({r['status']})" for r in bad))
        return 1
    if long_result is not None and not long_result.get("checked"):
        loud(f"mhagen long case failed: {long_result.get('error') or long_result['checks']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
