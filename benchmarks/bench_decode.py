#!/usr/bin/env python
"""Benchmark one KV-cache decode step of a whole layer against peers, in one process.

A decode step: one new token per sequence; its Q/K/V projections, its K/V appended to a cache
that already holds `cache - 1` tokens (or, with --lens, each batch row its own count: a
ragged batch, as a server decoding several requests at once has), attention over those
tokens and the new one, the output projection. Every implementation keeps its own cache
with the same contents and the same weights, and is checked against the float64 reference
(mhagen's, with a float64 cache) before timing:

  mhagen          mhagen.build(mhagen.mha(D, H, kv_heads=G, kv_cache=N, causal=True),
                  seq_len=1): QKV GEMM, cache append, split-KV attention, output GEMM; run
                  through module.prepare(x, cache=cache) (the arrays bound once, as ort_gqa's
                  I/O binding; a step copies the new token into the bound x)
  mhagen_call     the same module called as module(x, cache=cache) every step (not a
                  contender: the ratio to mhagen is the Python work of a call)
  mhagen_paged<B>[_ordered]   with --paged B: the same step reading a paged cache
                  (mhagen.PagedKVCache, blocks of B tokens; build kv_block_size=B), prepared
                  as mhagen; the pool's blocks handed out in a shuffled order (every
                  sequence's blocks scattered over the pool, the worst case), or in order
                  with --pool ordered (each sequence's blocks side by side)
  mhagen_varlen   with --varlen: a module built for any number of new tokens (seq_len=None,
                  max_seq_len 4) called in the packed form, cu_seqlens = [0, 1, ..., batch]
                  (each row its own count, here one token each), prepared as mhagen
  mhagen_<dtype>[_cache_<cache dtype>]   with --half: the layer in that dtype (x, weights
                  and output) keeping a cache of that dtype (default float32), e.g.
                  --half bfloat16,float16,float32:bfloat16,bfloat16:bfloat16; prepared as
                  mhagen, checked against the reference of the same rounded weights (and
                  cache rows) with the layer dtype's tolerance
  torch_sdpa      Linear(QKV) -> cache[b, :, L_b] = k, v -> F.scaled_dot_product_attention
                  over cache[:, :, :max L_b + 1] (enable_gqa; a boolean key mask only when
                  the rows' lengths differ) -> Linear (the cache preallocated, as mhagen's)
  ort_attention   ONNX Runtime: MatMul(QKV) -> opset-23 Attention(q, k, v, past_key,
                  past_value[, attn_mask]) -> MatMul; ONNX's past/present form copies the
                  cache into present_key/present_value on every step (that is how the op is
                  defined); ragged rows: the past padded to the longest, masked
  ort_gqa         ONNX Runtime: MatMul(QKV) -> com.microsoft.GroupQueryAttention(packed qkv,
                  past_key, past_value, seqlens_k) -> MatMul, the cache bound in place
                  (I/O binding, past and present one buffer, as onnxruntime-genai runs it):
                  ORT's own op for decoding batches of any lengths

Timing interleaves the implementations in rounds (medians). "GB/s" is the bytes one step
must read at least (every weight once, the whole K/V cache once) over its time; "% read bw"
compares that with a plain read of a 512 MiB array by torch in the same run (the machine's
memory bandwidth at that thread count).

Run: python benchmarks/bench_decode.py [--target x86] [--threads 1,2] [--kv-heads G]
         [--lens 4000,100] [--half bfloat16,float32:bfloat16] [--paged 16] [--pool
         shuffled,ordered] [--varlen] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402  (shared helpers: weights layouts, timing, threads)

import mhagen  # noqa: E402
from mhagen.dtypes import numpy_dtype  # noqa: E402
from mhagen.ir.kinds import SUPPORTED_DTYPES  # noqa: E402
from mhagen.tolerances import judged_as  # noqa: E402


# one layer mhagen runs: its weights, the reference output, its tolerance row
# (mhagen.tolerances.judged_as), the bytes a step reads at least
Variant = namedtuple("Variant", "layer weights expected judged bytes_read")


def random_cache(cache, seed=1):
    """Fill a KVCache (any dtype) with the same random keys/values for every implementation."""
    rng = np.random.default_rng(seed)
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    return cache


def head_counts(w):
    """(query heads, K/V heads, head_dim) of mhagen's weights."""
    heads, _, head_dim = w["w_q"].shape
    return heads, w["w_k"].shape[0], head_dim


class MhagenCall:
    """module(x, cache=cache) each step; `past`: [batch] tokens cached before the step."""

    def __init__(self, layer, w, batch, past, target):
        self.module = mhagen.build(layer, target, batch=batch, seq_len=1, weights=w)
        self.cache = random_cache(self.module.new_cache())
        self.past = past

    def __call__(self, x):
        self.cache.lens[...] = self.past          # every timed step appends at the same place
        return self.module(x, cache=self.cache)


class MhagenStep(MhagenCall):
    """The arrays bound once (module.prepare, as ORT's I/O binding for ort_gqa): a step
    copies the new token into the bound x (rounded to a half layer's dtype) and runs."""

    def __init__(self, layer, w, batch, past, target):
        super().__init__(layer, w, batch, past, target)
        self.x = mhagen.aligned_empty(self.module.in_shape, self.module.dtype)
        self.cache.lens[...] = past
        self.run = self.module.prepare(self.x, cache=self.cache)

    def __call__(self, x):
        self.x[...] = x
        self.cache.lens[...] = self.past
        return self.run()


class MhagenPagedStep:
    """The step reading a paged cache (kv_block_size=block) that holds the same rows as the
    others' caches, prepared as MhagenStep; `order`: "shuffled" (the pool's free blocks in
    a random order, so each sequence's blocks lie scattered) or "ordered"."""

    def __init__(self, layer, w, batch, past, target, block, order):
        self.module = mhagen.build(layer, target, batch=batch, seq_len=1, weights=w,
                                   kv_block_size=block)
        rows = random_cache(mhagen.KVCache.empty(layer, batch))
        per_seq = -(-rows.max_len // block)
        self.pool = pool = self.module.new_paged_cache(batch * per_seq)
        if order == "shuffled":
            held = [pool.add() for _ in range(pool.num_blocks)]
            pool.reserve(held, [1] * len(held))
            for s in np.random.default_rng(2).permutation(held):
                pool.free(int(s))
        self.seqs = [pool.add() for _ in range(batch)]
        for seq, b, n in zip(self.seqs, range(batch), past):
            pool.reserve([seq], [int(n)])
            pool.write(seq, 0, rows.k[b, :, :n], rows.v[b, :, :n])
            pool.advance([seq], [int(n)])
        self.past = [int(n) for n in past]
        self.x = mhagen.aligned_empty(self.module.in_shape, self.module.dtype)
        self.run = self.module.prepare(self.x, cache=pool, seqs=self.seqs)

    def __call__(self, x):
        self.x[...] = x
        for seq, n in zip(self.seqs, self.past):   # every timed step appends at one place
            self.pool.truncate(seq, n)
        return self.run()


class MhagenVarlenStep(MhagenStep):
    """A module of any number of new tokens (seq_len=None, max_seq_len 4) called packed:
    x [1, batch, d] with cu_seqlens [0, 1, ..., batch], prepared as MhagenStep."""

    def __init__(self, layer, w, batch, past, target):
        self.module = mhagen.build(layer, target, batch=batch, seq_len=None, max_seq_len=4,
                                   weights=w)
        self.cache = random_cache(self.module.new_cache())
        self.past = past
        self.x = mhagen.aligned_empty((1, batch, self.module.d_model), self.module.dtype)
        self.cache.lens[...] = past
        self.run = self.module.prepare(self.x, cache=self.cache,
                                       cu_seqlens=np.arange(batch + 1, dtype=np.int32))

    def __call__(self, x):
        self.x[...] = x.reshape(self.x.shape)
        self.cache.lens[...] = self.past
        return self.run().reshape(x.shape[0], 1, -1)


class TorchStep:
    def __init__(self, layer, w, batch, past, target=None, threads=1):
        import torch
        import torch.nn.functional as F
        self.torch, self.sdpa = torch, F.scaled_dot_product_attention
        self.heads, self.kv_heads, self.head_dim = head_counts(w)
        w_in, b_in = bm.torch_in_proj(w)
        w_out, b_out = bm.torch_out_proj(w)
        self.w_in, self.b_in = torch.from_numpy(w_in), torch.from_numpy(b_in)
        self.w_out, self.b_out = torch.from_numpy(w_out), torch.from_numpy(b_out)
        ref = random_cache(mhagen.KVCache.empty(layer, batch))
        self.k, self.v = torch.from_numpy(ref.k.copy()), torch.from_numpy(ref.v.copy())
        self.rows, self.past = torch.arange(batch), torch.from_numpy(np.asarray(past, np.int64))
        self.end = int(self.past.max()) + 1
        ragged = bool((self.past != self.past[0]).any())
        # a key is seen when it is cached for the row or is the row's new token
        self.mask = (torch.arange(self.end)[None, :] <= self.past[:, None])[:, None, None] \
            if ragged else None

    def __call__(self, x):
        torch, E = self.torch, self.end
        with torch.inference_mode():
            t = torch.from_numpy(x)
            b = t.shape[0]
            qkv = torch.nn.functional.linear(t, self.w_in, self.b_in)
            H, G, d = self.heads, self.kv_heads, self.head_dim
            q, k, v = qkv[:, 0].split([H * d, G * d, G * d], dim=-1)
            self.k[self.rows, :, self.past] = k.view(b, G, d)
            self.v[self.rows, :, self.past] = v.view(b, G, d)
            o = self.sdpa(q.view(b, H, 1, d), self.k[:, :, :E], self.v[:, :, :E],
                          attn_mask=self.mask, enable_gqa=G != H)
            y = torch.nn.functional.linear(o.transpose(1, 2).reshape(b, 1, -1), self.w_out,
                                           self.b_out)
            return y.numpy()


def ort_decode_model(w, batch, past_len, op, cache_len=None, ragged=False):
    """x -> MatMul(W_qkv) -> Add(b_qkv) -> attention -> MatMul(W_O) -> Add(b_O), as bytes.

    op "ort_attention": Split -> opset-23 Attention(q, k, v, [attn_mask], past_key,
    past_value) with a past of past_len tokens (attn_mask [B, 1, 1, past_len + 1] when
    ragged). op "ort_gqa": com.microsoft.GroupQueryAttention on the packed qkv, past and
    present [B, G, cache_len, d], seqlens_k [B] (cached tokens per row), total_len."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    heads, kv_heads, head_dim = head_counts(w)
    d_model = w["w_q"].shape[1]
    w_qkv, b_qkv = bm.packed_qkv(w)
    inits = [numpy_helper.from_array(w_qkv, "w_qkv"), numpy_helper.from_array(b_qkv, "b_qkv"),
             numpy_helper.from_array(np.ascontiguousarray(w["w_o"], np.float32), "w_o"),
             numpy_helper.from_array(np.asarray(w["b_o"], np.float32), "b_o")]
    nodes = [helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_qkv"], ["qkv"])]
    f32 = TensorProto.FLOAT
    if op == "ort_attention":
        inits.append(numpy_helper.from_array(
            np.array([heads * head_dim] + [kv_heads * head_dim] * 2, np.int64), "split"))
        nodes += [helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1),
                  helper.make_node("Attention", ["q", "k", "v", "attn_mask" if ragged else "",
                                                 "past_key", "past_value"],
                                   ["attn", "present_key", "present_value"],
                                   q_num_heads=heads, kv_num_heads=kv_heads)]
        cache = [batch, kv_heads, past_len, head_dim]
        extra = [helper.make_tensor_value_info(n, f32, cache) for n in ("past_key", "past_value")]
        if ragged:
            extra.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL,
                                                       [batch, 1, 1, past_len + 1]))
        outputs, opsets = [], [helper.make_opsetid("", 23)]
    elif op == "ort_gqa":
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k",
                                    "total_len"], ["attn", "present_key", "present_value"],
            domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads))
        cache = [batch, kv_heads, cache_len, head_dim]
        extra = [helper.make_tensor_value_info(n, f32, cache) for n in ("past_key", "past_value")]
        extra += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
                  helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
        outputs = [helper.make_tensor_value_info(n, f32, cache)
                   for n in ("present_key", "present_value")]
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    else:
        raise ValueError(op)
    nodes += [helper.make_node("MatMul", ["attn", "w_o"], ["y0"]),
              helper.make_node("Add", ["y0", "b_o"], ["y"])]
    graph = helper.make_graph(
        nodes, f"mha_decode_{op}",
        [helper.make_tensor_value_info("x", f32, [batch, 1, d_model])] + extra,
        [helper.make_tensor_value_info("y", f32, [batch, 1, d_model])] + outputs, inits)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


class OrtStep:
    """opset-23 Attention: the past is the rows' cached tokens, padded to the longest row
    and masked when the rows differ (the new token then sits after the padding, which
    attention without positions cannot tell from its place in mhagen's cache)."""

    def __init__(self, layer, w, batch, past, target=None, threads=1):
        longest = int(np.max(past))
        ragged = bool(np.any(past != longest))
        self.session = bm.ort_session(
            ort_decode_model(w, batch, longest, "ort_attention", ragged=ragged), threads)
        ref = random_cache(mhagen.KVCache.empty(layer, batch))
        self.feeds = {"past_key": np.ascontiguousarray(ref.k[:, :, :longest]),
                      "past_value": np.ascontiguousarray(ref.v[:, :, :longest])}
        if ragged:
            seen = np.arange(longest + 1)[None, :] < np.asarray(past)[:, None]
            seen[:, longest] = True                       # the row's new token
            self.feeds["attn_mask"] = seen[:, None, None, :]

    def __call__(self, x):
        return self.session.run(["y"], dict(self.feeds, x=x))[0]


class OrtGqaStep:
    """GroupQueryAttention with the cache bound in place: each step writes the new K/V at
    seqlens_k[b] of the one buffer and reads that row's tokens only."""

    def __init__(self, layer, w, batch, past, target=None, threads=1):
        import onnxruntime as ort
        ref = random_cache(mhagen.KVCache.empty(layer, batch))
        self.session = bm.ort_session(
            ort_decode_model(w, batch, None, "ort_gqa", cache_len=ref.max_len), threads)
        self.k = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ref.k))
        self.v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ref.v))
        self.binding = b = self.session.io_binding()
        b.bind_cpu_input("seqlens_k", np.asarray(past, np.int32))
        b.bind_cpu_input("total_len", np.array(int(np.max(past)) + 1, np.int32))
        b.bind_ortvalue_input("past_key", self.k)
        b.bind_ortvalue_input("past_value", self.v)
        b.bind_ortvalue_output("present_key", self.k)
        b.bind_ortvalue_output("present_value", self.v)
        self.y = np.empty((batch, 1, w["w_q"].shape[1]), np.float32)
        b.bind_output("y", "cpu", element_type=np.float32, shape=self.y.shape,
                      buffer_ptr=self.y.ctypes.data)

    def __call__(self, x):
        self.binding.bind_cpu_input("x", x)
        self.session.run_with_iobinding(self.binding)
        return self.y


PEERS = {"torch_sdpa": TorchStep, "ort_attention": OrtStep, "ort_gqa": OrtGqaStep}


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
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped/multi-query); default heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lens", type=bm.lengths_arg(0, "4000,100"),
                   help="tokens each batch row has cached before the step, e.g. 4000,100 "
                   "(a ragged batch; sets --batch; each < --cache)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--half", default="", help="also mhagen with half-precision weights "
                   "and/or cache: DTYPE[:CACHE_DTYPE],... (e.g. bfloat16,float32:bfloat16; "
                   "the cache float32 unless given)")
    p.add_argument("--paged", default="", help="also mhagen reading a paged cache of "
                   "blocks of these many tokens, e.g. 16 or 16,64 (mhagen_paged<B>)")
    p.add_argument("--pool", default="shuffled", help="the paged pools' block order: "
                   "shuffled, ordered or both (shuffled,ordered)")
    p.add_argument("--varlen", action="store_true", help="also mhagen's packed form "
                   "(seq_len=None, cu_seqlens), one token a row (mhagen_varlen)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--gap-ms", type=float, default=bm.GAP_MS,
                   help="idle gap before each implementation's turn when threads > 1 (other "
                   "libraries' worker threads stop spinning), as bench_mha.py")
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    args = p.parse_args(argv)
    bm.runnable_target(p, args.target)
    bm.TARGET = args.target
    D, H, N = args.d_model, args.heads, args.cache
    G = args.kv_heads or H
    if args.lens is not None and max(args.lens) >= N:
        p.error(f"--lens {max(args.lens)}: a row holds at most --cache - 1 = {N - 1} tokens "
                "before the step")
    past = np.array(args.lens if args.lens is not None else [N - 1] * args.batch, np.int32)
    B = len(past)
    x = bm.make_input(B, 1, D, seed=3)
    d = D // H
    weight_values = 2 * D * H * d + 2 * D * G * d + D + H * d + 2 * G * d   # and biases
    cache_values = 2 * G * d * int(np.sum(past + 1))     # the K and V rows a step reads

    def variant(dtype, cache_dtype, reference_cache_dtype=None):
        """The layer with its weights and cache in these dtypes: its weights, the float64
        reference's output on x (the cache's old rows as an array of reference_cache_dtype
        holds them, default the cache's own), its tolerance row, the bytes a step reads."""
        vl = mhagen.mha(D, H, kv_heads=G, kv_cache=N, causal=True, dtype=dtype,
                        cache_dtype=cache_dtype)
        vw = vl.init_weights(0)
        vc = random_cache(mhagen.KVCache.empty(vl, B, reference_cache_dtype))
        vc.lens[...] = past
        return Variant(vl, vw, vl.reference(x, vw, cache=vc), judged_as(vl),
                       numpy_dtype(dtype).itemsize * weight_values
                       + numpy_dtype(cache_dtype).itemsize * cache_values)

    base = variant("float32", "float32", np.float64)   # mhagen's, mhagen_call's, the peers'
    layer, w, bytes_read = base.layer, base.weights, base.bytes_read
    variants = {"mhagen": base}
    for spec in (s for s in args.half.split(",") if s):
        dt, _, cd = spec.partition(":")
        cd = cd or "float32"
        if {dt, cd} - set(SUPPORTED_DTYPES) or (dt, cd) == ("float32",) * 2:
            p.error(f"--half {spec}: give DTYPE[:CACHE_DTYPE] of {', '.join(SUPPORTED_DTYPES)}, "
                    "not both float32")
        variants[f"mhagen_{dt}" + (f"_cache_{cd}" if cd != "float32" else "")] = \
            variant(dt, cd)
    peers = [s for s in args.peers.split(",") if s]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        p.error(f"--peers {','.join(unknown)}: unknown; choose among {', '.join(PEERS)}")
    rows, status = [], {}
    for threads in [int(t) for t in args.threads.split(",")]:
        bm.set_threads(threads)
        impls = {"mhagen": MhagenStep(layer, w, B, past, args.target),
                 "mhagen_call": MhagenCall(layer, w, B, past, args.target)}
        impls.update((n, MhagenStep(v.layer, v.weights, B, past, args.target))
                     for n, v in variants.items() if n != "mhagen")
        for block in (int(b) for b in args.paged.split(",") if b):
            for order in (o for o in args.pool.split(",") if o):
                name = f"mhagen_paged{block}" + ("_ordered" if order == "ordered" else "")
                impls[name] = MhagenPagedStep(layer, w, B, past, args.target, block, order)
        if args.varlen:
            impls["mhagen_varlen"] = MhagenVarlenStep(layer, w, B, past, args.target)
        for name in peers:
            try:
                impls[name] = PEERS[name](layer, w, B, past, threads=threads)
            except Exception as err:           # a peer that cannot run is reported, not fatal
                status[name] = f"unavailable: {err}"
        checked = bm.checked_impls(
            impls, x, lambda name: variants.get(name, base).expected, status,
            label="{} decode step", dtypes={n: v.judged for n, v in variants.items()})
        est = {n: 1e-3 for n in checked}
        samples, _ = bm.time_interleaved(checked, x, est, args.rounds, 0.05,
                                         args.gap_ms / 1e3 if threads > 1 else 0.0)
        bw = read_bandwidth(threads)
        med = {n: float(np.median(s)) for n, s in samples.items()}
        fastest_peer = min((n for n in med if not n.startswith("mhagen")), key=med.get,
                           default=None)
        for n, t in med.items():
            read = variants.get(n, base).bytes_read
            rows.append({"threads": threads, "impl": n, "ms": t * 1e3,
                         "gb_s": read / t / 1e9,
                         "read_bw_share": read / t / 1e9 / bw, "read_bw_gb_s": bw,
                         "vs_fastest_peer": (t / med[fastest_peer]) if fastest_peer else None,
                         "vs_mhagen": t / med["mhagen"] if "mhagen" in med else None})
    cached = (f"rows cache {', '.join(str(n + 1) for n in past)} of {N} tokens"
              if args.lens is not None else f"cache {N}")
    heads = f"{H} heads" + (f", {G} K/V heads" if G != H else "")
    meta = {"shape": f"batch {B}, d_model {D}, {heads}, {cached} (one new token)",
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
             f"{meta['bytes_read'] / 1e6:.1f} MB read at least per step (float32 weights; "
             "half-precision rows: 2 bytes a value of theirs)",
             "", "| threads | impl | ms | GB/s | % read bw | / fastest peer | / mhagen |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        contender = r["impl"].startswith("mhagen") and r["impl"] != "mhagen_call"
        ratio = "—" if r["vs_fastest_peer"] is None or not contender else \
            f"{r['vs_fastest_peer']:.2f}"
        own = "—" if r.get("vs_mhagen") is None or r["impl"] == "mhagen" else \
            f"{r['vs_mhagen']:.2f}"
        lines.append(f"| {r['threads']} | {r['impl']} | {r['ms']:.3f} | {r['gb_s']:.1f} | "
                     f"{100 * r['read_bw_share']:.0f}% | {ratio} | {own} |")
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
