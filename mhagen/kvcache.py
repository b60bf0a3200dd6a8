"""KVCache: the keys and values a decoding layer (`mhagen.mha(..., kv_cache=N)`) keeps between
calls, and the layout its kernels read.

    k, v   [batch, kv_heads, max_len, head_dim]  (Hugging Face's layout; the cache dtype:
           float32 unless the layer says `cache_dtype=`, whatever the layer's dtype; any
           float dtype for the reference), 64-byte aligned, C-contiguous
    lens   [batch] int32: tokens already cached per batch row
(KVCache(k, v, lens) takes numpy arrays, or torch CPU tensors / DLPack arrays of that
layout, held as numpy views of their memory: written in place.)

A call with S new tokens writes their K/V rows at lens[b] .. lens[b] + S - 1 in place,
attends with the queries at absolute positions lens[b] + t, and advances lens by S. Rows at
and past lens[b] + S are never read, so a cache need not be cleared between sequences:
`reset()` sets lens to 0 (or `lens[b] = 0` for one row).
"""
from __future__ import annotations

import numpy as np

from mhagen.arrays import aligned_empty, aligned_zeros
from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError
from mhagen.inputs import LENGTHS, argument, shared
from mhagen.runtime import tensor


def cache_shape(graph) -> dict | None:
    """{kv_heads, max_len, head_dim, dtype} of a decoding graph (one with cache nodes, or its
    fused form), else None. dtype: what the cache stores (float32 unless the graph says)."""
    caches = [n for n in graph.nodes if n.kind == "cache"]
    fused = [n for n in graph.nodes if n.kind == "attention" and n.attrs.get("cache")]
    if fused:
        a = fused[0].attrs
        return {"kv_heads": len(set(a["k_offsets"])), "max_len": a["cache"]["max_len"],
                "head_dim": a["head_dim"], "dtype": a["cache"].get("dtype", "float32")}
    if not caches:
        return None
    nodes = {n.name: n for n in graph.nodes}
    src = nodes[caches[0].inputs[0]]
    while src.kind == "rotary":
        src = nodes[src.inputs[0]]
    head_dim = (src.attrs["out_features"] if src.kind == "head_projection" else
                graph.shapes_partial(caches[0].inputs[0])[-1])
    return {"kv_heads": 1 + max(n.attrs["head"] for n in caches),
            "max_len": caches[0].attrs["max_len"], "head_dim": head_dim,
            "dtype": caches[0].attrs.get("dtype", "float32")}


class KVCache:
    """The K/V cache of one decoding layer for `batch` sequences (see the module docstring)."""

    def __init__(self, k, v, lens):
        # torch tensors and DLPack arrays are held as numpy views of their memory: the
        # kernels write the rows and advance the lengths in the caller's tensors
        self.k, self.v, self.lens = (shared(a, f"cache.{name}") for name, a in
                                     (("k", k), ("v", v), ("lens", lens)))
        self._tensors = None

    def tensors(self):
        """TVM tensors over k and v (what a module call passes its kernels), made once
        while k and v stay the same arrays: new ones each decode step cost ~2 us."""
        held = self._tensors
        if held is None or held[0] is not self.k or held[1] is not self.v:
            held = self._tensors = (self.k, self.v, tensor(self.k), tensor(self.v))
        return held[2], held[3]

    @classmethod
    def empty(cls, layer, batch: int = 1, dtype=None) -> "KVCache":
        """An empty cache for `layer` (a decoding graph, or a Module built from one); dtype:
        its arrays' (default what the layer's cache stores, mhagen.mha(cache_dtype=);
        np.float64 for a reference that keeps every digit of the rows it is given)."""
        graph = getattr(layer, "graph", layer)
        spec = cache_shape(graph)
        if spec is None:
            raise InputError(f"layer {graph.name!r} keeps no K/V cache; build it with "
                             "mhagen.mha(..., kv_cache=max_len)")
        shape = (int(batch), spec["kv_heads"], spec["max_len"], spec["head_dim"])
        dtype = numpy_dtype(spec["dtype"]) if dtype is None else dtype
        return cls(aligned_zeros(shape, dtype), aligned_zeros(shape, dtype),
                   np.zeros(int(batch), np.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> "KVCache":
        self.lens[...] = 0
        return self

    def copy(self) -> "KVCache":
        return KVCache.from_arrays(self.k, self.v, self.lens)

    @classmethod
    def from_arrays(cls, k, v, lens) -> "KVCache":
        """A cache holding copies of k, v ([batch, kv_heads, max_len, head_dim]; float
        arrays keep their dtype, integers become float64) and lens (int32): numpy arrays,
        lists or torch CPU tensors, read as mhagen/inputs.py says."""
        shape = "[batch, kv_heads, max_len, head_dim]"
        k, v = (argument(a, f"cache.{n}", expects=shape) for n, a in (("k", k), ("v", v)))
        lens = argument(lens, "cache.lens", need=LENGTHS, expects="[batch]")
        ck, cv = aligned_empty(k.shape, k.dtype), aligned_empty(v.shape, v.dtype)
        ck[...], cv[...] = k, v
        return cls(ck, cv, np.array(lens, dtype=np.int32).reshape(-1))

    def check(self, graph, batch: int, new_tokens: int, dtype=None, spec=None) -> None:
        """Raise InputError unless this cache fits `graph` at [batch, new_tokens] (dtype:
        the float dtype the kernels need, with aligned C-contiguous writable arrays; spec:
        cache_shape(graph) when the caller has it)."""
        spec = spec or cache_shape(graph)
        shape = (batch, spec["kv_heads"], spec["max_len"], spec["head_dim"])
        for name in ("k", "v"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.shape != shape:
                raise InputError(f"cache.{name} must be an array of shape {shape} "
                                 "[batch, kv_heads, max_len, head_dim], got "
                                 f"{getattr(a, 'shape', type(a).__name__)}; make one with "
                                 "mhagen.KVCache.empty(module, batch)")
            if dtype is not None:
                argument(a, f"cache.{name}", dtype=dtype, aligned=True, in_place=(
                    "the kernels write it in place: make the cache with "
                    "mhagen.KVCache.empty(module, batch) or KVCache.from_arrays(k, v, lens)"))
        lens = argument(self.lens, "cache.lens", dtype=np.int32, shape=(batch,),
                        in_place="each call advances it in place")
        check_room(lens, new_tokens, spec["max_len"])

    def __repr__(self):
        return (f"<mhagen.KVCache batch {self.batch}, max_len {self.max_len}, "
                f"lens {self.lens.tolist()}, {self.k.dtype}>")


def check_room(lens, new_tokens: int, max_len: int) -> None:
    """Raise InputError unless every row of `lens` (cached tokens) has room for new_tokens
    more in a cache of max_len (a module's call and a prepared run check each call)."""
    room = max_len - new_tokens
    held = lens.tolist()       # python min/max: a tenth of numpy's reductions per call
    if held and (min(held) < 0 or max(held) > room):
        raise InputError(f"the cache holds {held} tokens per row; {new_tokens} "
                         f"new ones need lens <= {room} (max_len {max_len}): "
                         "reset the cache or build with a larger kv_cache=")
