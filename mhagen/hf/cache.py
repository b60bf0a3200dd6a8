"""MhagenCache: Hugging Face's `Cache` API in front of mhagen's K/V caches.

An optimized model (mhagen/hf/optimizer.py) keeps each replaced decoder layer's keys and
values in a `mhagen.KVCache` that its kernels write in place; this class is what
`model(...)`, `model.generate(...)` and Hugging Face's mask code see instead of a
`DynamicCache`:

- `layers[i]` (one per model layer index) answers `get_seq_length()`, `get_mask_sizes()`,
  `get_max_length()`; `layers[i].kv` is that layer's KVCache (None until its first call).
- `columns`: the token columns the model has been given so far (Hugging Face's sequence
  length: padding columns included). The KVCaches hold only the real tokens: a row's
  padding is never written (`StepPlan` moves each row's real tokens to the front of the
  call and the lengths are set to the real count), so `kv.lens[b]` is row b's real
  tokens, the positions rotary embeddings and ALiBi see (as generate's
  `position_ids = attention_mask.cumsum(-1) - 1`).
- Beam search and friends: `reorder_cache`, `batch_select_indices`,
  `batch_repeat_interleave`, `crop`, `reset` act on every layer's rows.

torch and transformers are imported at this module's top: it is loaded only by
mhagen.hf.optimize, never by `import mhagen`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mhagen.arrays import aligned_empty
from mhagen.errors import InputError
from mhagen.kvcache import KVCache


class MhagenCacheLayer(CacheLayerMixin):
    """One model layer's entry: its mhagen KVCache (`kv`) and the shared column count."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "MhagenCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.kv: KVCache | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise InputError(f"layer {self.index} of this cache is kept by mhagen's kernels (its "
                         "attention module was replaced by mhagen.hf.optimize); a torch "
                         "attention module cannot append to it: run the optimized model, "
                         "or give the torch model a DynamicCache of its own")

    def get_seq_length(self) -> int:
        return self.owner.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.columns + query_length, 0

    def get_max_length(self) -> int:
        return self.owner.max_len

    def reset(self) -> None:
        if self.kv is not None:
            self.kv.lens[...] = 0

    def reorder_cache(self, beam_idx) -> None:
        self.take_rows(beam_idx)

    def batch_select_indices(self, indices) -> None:
        self.take_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv is not None:
            self.take_rows(np.repeat(np.arange(self.kv.batch), int(repeats)))

    def crop(self, tokens_to_remove: int) -> None:
        if self.kv is not None and tokens_to_remove:
            self.kv.lens[...] = np.maximum(self.kv.lens - abs(int(tokens_to_remove)), 0)

    def take_rows(self, rows) -> None:
        """Keep (and repeat, reorder) the cache rows `rows` (any 1-D integer index)."""
        if self.kv is None:
            return
        rows = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows,
                          dtype=np.int64).reshape(-1)
        k, v = (aligned_empty((len(rows),) + a.shape[1:], a.dtype) for a in (self.kv.k,
                                                                            self.kv.v))
        np.take(self.kv.k, rows, axis=0, out=k)
        np.take(self.kv.v, rows, axis=0, out=v)
        self.kv = KVCache(k, v, np.ascontiguousarray(self.kv.lens[rows], dtype=np.int32))


class MhagenCache(Cache):
    """Hugging Face's Cache API over one optimized model's mhagen KVCaches (module docstring).

    num_layers: the model's layer count (Hugging Face's layer_idx range); max_len: tokens per
    row each KVCache holds (optimize's max_seq_len). Made by the optimized model itself when
    a forward needs a cache and none (or an empty DynamicCache, as generate() makes) is
    given; `report.new_cache()` makes one to pass explicitly."""

    def __init__(self, num_layers: int, max_len: int, *, owner=None):
        self.max_len = int(max_len)
        self.columns = 0
        self.owner = owner           # the optimized model's state (mhagen.hf.fused.ModelState)
        self.offsets = None          # per row: position_ids - cached position (rotary check)
        super().__init__(layers=[MhagenCacheLayer(self, i) for i in range(num_layers)])

    def kv_for(self, index: int, module, batch: int) -> KVCache:
        """Layer `index`'s KVCache for a call of `batch` rows on `module` (a decoding
        mhagen.Module): made empty on first use, refused when the rows do not match."""
        layer = self.layers[index]
        if layer.kv is None:
            layer.kv = KVCache.empty(module, batch)
            if self.columns:
                raise InputError(f"layer {index} has no keys yet but the cache has seen "
                                 f"{self.columns} tokens: a cache is used by one model")
        elif layer.kv.batch != batch:
            raise InputError(f"the cache holds {layer.kv.batch} rows and this call has "
                             f"{batch}: pass the cache of this batch, or cache.reset()")
        return layer.kv

    def lens(self) -> np.ndarray | None:
        """The real tokens cached per row (the first layer holding keys), None when empty."""
        for layer in self.layers:
            if layer.kv is not None:
                return layer.kv.lens
        return None

    def reset(self):
        self.columns = 0
        self.offsets = None
        for layer in self.layers:
            layer.kv = None

    def crop(self, tokens_to_remove: int) -> None:
        # Cache.crop's legacy form: a non-negative argument is the length to keep
        remove = self.columns - tokens_to_remove if tokens_to_remove >= 0 else -tokens_to_remove
        remove = max(0, min(remove, self.columns))
        super().crop(-remove if remove else 0)
        self.columns -= remove

    def take_rows(self, rows) -> None:
        for layer in self.layers:
            layer.take_rows(rows)
        if self.offsets is not None:
            rows = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows,
                              dtype=np.int64).reshape(-1)
            self.offsets = self.offsets[rows]

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.offsets is not None:
            self.offsets = np.repeat(self.offsets, int(repeats))

    def batch_select_indices(self, indices):
        self.take_rows(indices)

    def reorder_cache(self, beam_idx):
        self.take_rows(beam_idx)

    @property
    def batch_size(self) -> int:
        lens = self.lens()
        return -1 if lens is None else len(lens)

    def __repr__(self):
        lens = self.lens()
        return (f"MhagenCache(layers={len(self.layers)}, max_len={self.max_len}, "
                f"columns={self.columns}, lens={None if lens is None else lens.tolist()})")


@dataclass
class StepPlan:
    """How one forward's new token columns map onto the KVCaches' rows.

    columns: the call's token columns S. dense: every column of every row is a real token
    (the call runs as it is). Otherwise `gather` [B, W] lists each row's columns with its
    real tokens first (in order; W = the most real tokens of a row), `counts` [B] the
    real tokens per row: the layers run on x gathered to [B, W] (a row's padding tail
    comes after its real tokens, so causal attention keeps it out of them), scatter the
    answers back and set each row's length to its old length + counts[b] (the tail's K/V
    rows, past that length, are never read)."""
    columns: int
    dense: bool
    counts: np.ndarray | None = None
    width: int = 0
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @classmethod
    def of(cls, new_mask, columns: int) -> "StepPlan":
        """The plan for a call of `columns` new columns; new_mask: [B, columns] (1 real,
        0 padding; torch, any dtype) or None (all real)."""
        if new_mask is None:
            return cls(columns, True)
        real = new_mask.to(torch.bool)
        if bool(real.all()):
            return cls(columns, True)
        counts = real.sum(dim=1)
        width = int(counts.max())
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :width]
        valid = torch.arange(width)[None, :] < counts[:, None]
        return cls(columns, False, counts.numpy().astype(np.int32), width, order, valid)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> [B, W, D]: each row's real tokens first."""
        index = self.gather[..., None].expand(-1, -1, x.shape[-1])
        return torch.gather(x, 1, index)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, W, D] -> [B, S, D]: the real tokens' answers where they came from, zeros at
        padding."""
        out = y.new_zeros((y.shape[0], self.columns, y.shape[-1]))
        y = y * self.valid[..., None].to(y.dtype)
        return out.scatter_(1, self.gather[..., None].expand(-1, -1, y.shape[-1]), y)
