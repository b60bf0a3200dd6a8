"""The per-row arguments of a decoding module's call (mhagen/module.py asks here): each row's
new-token count, packed tokens (cu_seqlens), the cache's lengths and, with a paged cache, the
sequences' block tables, all checked before anything is written.

Forms (what a module built from a decoding layer, mhagen.mha(..., kv_cache=N), takes):
  fixed      seq_len=S: x [batch, S, d_model], every row S new tokens (a KVCache) - the
             module's own path, not this one, unless the cache is paged
  packed     seq_len=None: x [1, total, d_model] with cu_seqlens [rows + 1] (row b adds
             cu[b+1] - cu[b] tokens, 0 allowed), or x [rows, S, d_model] (every row S); the
             kernels take cu_seqlens and run batch 1 x `total` rows (mhagen/lower/fused.py)
  paged      kv_block_size=: a PagedKVCache and seqs (the pool's sequences the rows are;
             at most the module's batch, padded with rows of no tokens), its block tables
             gathered per call after reserve() made room (copy-on-write, new blocks)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhagen.call_checks import check_cu_seqlens, check_input
from mhagen.errors import InputError
from mhagen.inputs import LENGTHS, argument
from mhagen.kvcache import KVCache
from mhagen.paged_cache import PagedKVCache
from mhagen.staging import deliver


@dataclass
class DecodeArgs:
    """One checked decoding call: x as the kernels take it and the call's dims (batch,
    seq), each row's count, the cache, the pool's sequences (paged) and the output's shape
    for the caller (out_shape; the kernels write [batch, seq, features])."""
    x: np.ndarray
    batch: int
    seq: int
    counts: list
    cache: object
    seqs: list | None
    cu: np.ndarray | None
    out_shape: tuple

    def stage(self, module) -> dict:
        """fill(), then {buffer name: tensor} of the lengths, offsets, block tables and
        caches (tensors()). The last step before the kernels run."""
        self.fill(module)
        return self.tensors(module)

    def tensors(self, module) -> dict:
        """{buffer name: tensor} of the staging arrays fill() writes and of the caches (the
        same objects every call: a prepared call binds them once)."""
        staging, buffers = module.staging, module.program.buffers
        names = [module.graph.cache_lens_input.name] + [
            n for n in ("cu_seqlens", "block_tables") if n in buffers]
        out = {n: staging.staged(buffers[n], None)[1] for n in names}
        out["k_cache"], out["v_cache"] = self.cache.tensors()
        return out

    def fill(self, module) -> None:
        """Make room in a paged cache (reserve: all or nothing), then fill the module's
        staging arrays of the lengths (and offsets, block tables) for this call."""
        staging, buffers = module.staging, module.program.buffers
        lens = staging.staged(buffers[module.graph.cache_lens_input.name], None)[0]
        rows = len(self.counts)
        if self.seqs is None:
            lens[...] = self.cache.lens
        else:
            self.cache.reserve(self.seqs, self.counts)
            lens[rows:] = 0
            self.cache.gather(self.seqs, lens, staging.staged(buffers["block_tables"], None)[0])
        if self.cu is not None:
            cu = staging.staged(buffers["cu_seqlens"], None)[0]
            cu[:rows + 1] = self.cu
            cu[rows + 1:] = self.cu[-1]      # rows past the call's: no tokens

    def check_room(self, max_len: int) -> None:
        """InputError unless every row's cache has room for its new tokens."""
        held = [self.cache.lens(s) for s in self.seqs] if self.seqs is not None else \
            self.cache.lens.tolist()
        for b, (n, h) in enumerate(zip(self.counts, held)):
            if h < 0 or h + n > max_len:
                raise InputError(f"row {b} of the cache holds {h} tokens; {n} new ones need "
                                 f"lens <= {max_len - n} (max_len {max_len}): reset the "
                                 "cache or build with a larger kv_cache=")

    def advance(self) -> None:
        """Each row's length advanced by its count (after the kernels wrote the rows)."""
        if self.seqs is None:
            self.cache.lens += np.asarray(self.counts, np.int32)
        else:
            self.cache.advance(self.seqs, self.counts)


def decode_arguments(module, x, cache, cu_seqlens, seqs) -> DecodeArgs:
    """The checked arguments of a call of a packed or paged decoding module (module._packed
    / module._paged); raises InputError, nothing written, where one does not fit."""
    paged, packed = module._paged, module._packed
    graph, spec = module.graph, module._cache_spec
    if cache is None:
        raise InputError(f"graph {graph.name!r} decodes with a K/V cache: pass cache=" + (
            "module.new_paged_cache(num_blocks) and seqs=[...]" if paged else
            "module.new_cache()"))
    if paged:
        seqs = _check_pool(module, cache, seqs)
    else:
        if isinstance(cache, PagedKVCache):
            raise InputError("this module reads a contiguous mhagen.KVCache; a PagedKVCache "
                             "needs a module built with kv_block_size=")
        if seqs is not None:
            raise InputError("seqs= names the sequences of a PagedKVCache; a KVCache's rows "
                             "are the call's rows")
        if not isinstance(cache, KVCache):
            raise InputError(f"cache= takes a mhagen.KVCache, got {type(cache).__name__}")
        cache.check(graph, module.batch, 0, module._cache_dtype, spec)
    rows = len(seqs) if paged else module.batch
    x = check_input(graph, x, module.storage.takes)
    if cu_seqlens is not None:
        if not packed:
            raise InputError("cu_seqlens= (each row's own number of new tokens) needs a "
                             "module built with seq_len=None (max_seq_len=N)")
        if x.shape[0] != 1:
            raise InputError(f"with cu_seqlens, x holds the rows' tokens packed: [1, total, "
                             f"{module.d_model}], got {x.shape}")
        cu = check_cu_seqlens(cu_seqlens, x.shape[1], sequences=rows)
        counts = np.diff(cu).tolist()
    else:
        if x.shape[0] != rows:
            raise InputError(f"x has {x.shape[0]} rows; this call runs {rows} ("
                             + ("len(seqs)" if paged else "the cache's batch") + "): x is "
                             f"[{rows}, new tokens, {module.d_model}] (or packed [1, total, "
                             f"{module.d_model}] with cu_seqlens=)")
        if not packed and x.shape[1] != module.seq_len:
            raise InputError(f"x has {x.shape[1]} new tokens a row; this module was built for "
                             f"seq_len={module.seq_len} (build with seq_len=None for any)")
        if packed and not 1 <= x.shape[1] <= module.seq_len:
            raise InputError(f"x has seq_len {x.shape[1]}; this module runs seq_len 1.."
                             f"{module.seq_len} (rebuild with max_seq_len={x.shape[1]}), or "
                             f"up to {module.batch * module.seq_len} tokens in all packed "
                             "with cu_seqlens=")
        counts = [x.shape[1]] * rows
        cu = np.arange(rows + 1, dtype=np.int32) * x.shape[1] if packed else None
    total = sum(counts)
    if packed and not 1 <= total <= module.batch * module.seq_len:
        raise InputError(f"the call has {total} new tokens; this module runs 1.."
                         f"{module.batch * module.seq_len} a call (batch x max_seq_len; "
                         "rebuild with a larger max_seq_len)")
    out_features = module.out_shape[2]
    if packed:
        shape = (1, total, out_features) if cu_seqlens is not None else \
            (rows, x.shape[1], out_features)
        args = DecodeArgs(x.reshape(1, total, -1), 1, total, counts, cache, seqs, cu, shape)
    else:
        args = DecodeArgs(x, x.shape[0], x.shape[1], counts, cache, seqs, None,
                          (x.shape[0], x.shape[1], out_features))
    args.check_room(spec["max_len"])
    return args


class PreparedDecode:
    """A packed or paged decoding call with its arrays bound (Module.prepare): each run
    checks the rows' room, makes room in a paged cache, fills the lengths (and offsets,
    block tables), runs the kernels and advances the lengths; the rows' counts are the
    ones given to prepare()."""

    def __init__(self, module, kernels, args, result, target):
        self.module, self.kernels, self.args = module, kernels, args
        self.params, self.result, self.target = module._params, result, target

    def __call__(self) -> np.ndarray:
        m = self.module
        if m._params is not self.params:
            raise InputError("the module's weights were bound again after prepare(): "
                             "prepare the call again")
        with m._lock:
            self.args.check_room(m._cache_spec["max_len"])
            self.args.fill(m)
            for func, call_args in self.kernels:
                func(*call_args)
            self.args.advance()
            return deliver(self.result, self.target).reshape(self.args.out_shape)


def _check_pool(module, pool, seqs) -> list:
    """The sequence ids of a paged call, checked, and the pool checked against the
    module's cache (kv_heads, head_dim, block size, max_len, dtype)."""
    if not isinstance(pool, PagedKVCache):
        raise InputError("this module reads a paged cache (built with kv_block_size="
                         f"{module.kv_block_size}): pass cache=module.new_paged_cache("
                         f"num_blocks), got {type(pool).__name__}")
    spec = module._cache_spec
    want = (spec["kv_heads"], module.kv_block_size, spec["head_dim"])
    if (pool.k.shape[1:] != (want[0], want[1], want[2]) or pool.v.shape != pool.k.shape
            or pool.max_len != spec["max_len"]):
        raise InputError(f"the paged cache has blocks {pool.k.shape[1:]} [kv_heads, "
                         f"block_size, head_dim] and max_len {pool.max_len}; this module "
                         f"reads {want} and max_len {spec['max_len']}: make it with "
                         "module.new_paged_cache(num_blocks)")
    for name in ("k", "v"):
        argument(getattr(pool, name), f"cache.{name}", dtype=module._cache_dtype,
                 aligned=True, in_place="the kernels write it in place: make the cache "
                 "with module.new_paged_cache(num_blocks)")
    if seqs is None:
        raise InputError("a paged call names its rows' sequences: seqs=[ids from "
                         "cache.add() / cache.fork()]")
    seqs = argument(seqs, "seqs", need=LENGTHS, expects="[sequence ids]").reshape(-1).tolist()
    if not 1 <= len(seqs) <= module.batch or (module.seq_len is not None
                                              and not module._packed
                                              and len(seqs) != module.batch):
        raise InputError(f"seqs has {len(seqs)} sequences; this module runs "
                         + (f"1..{module.batch}" if module._packed else str(module.batch))
                         + " a call (its batch)")
    for s in seqs:
        pool.lens(s)      # an unknown id: refused, saying which ids there are
    if len(set(seqs)) != len(seqs):
        raise InputError(f"seqs lists a sequence twice ({seqs}): a call writes each "
                         "sequence's tokens once")
    return seqs
