"""The attention core: per query head h,

    softmax(mask(score_mod(Q_h K_g^T * scale))) V_g,    g = h // (num_heads // kv_heads),

over query, key and value heads as a model hands them over: no projections, no rotary
(Hugging Face's attention interface, torch's scaled_dot_product_attention). The layout is
theirs: q [batch, num_heads, q_len, head_dim], k and v [batch, kv_heads, kv_len, head_dim]
(kv_len >= q_len where the mask or score modifier reads query positions); the output is
[batch, q_len, num_heads, head_dim] (what Hugging Face's attention functions return).

Positions are absolute and bottom-right aligned: key j is at kv_idx = j, and query t at
q_idx = kv_len - q_len + t (the queries are the last q_len positions, as a decoder's new
tokens after its cached ones; with q_len == kv_len that is plain q_idx = t). Masks and score
modifiers read them; `q_len` and `kv_len` in their expressions are the call's q_len and its
keys' length (a batch row's kv_lens[b] with key padding).

Key padding (key_padding=True): each batch row b sees only keys kv_starts[b] <= j <
kv_lens[b], given per call (default 0 and kv_len): left padding (a decoder's batch in
generate()) starts later, right padding (an encoder's) ends earlier. A query row that sees
no key gives zeros.

This module holds the layer's description, its checks and the float64 reference; the
compiled module is mhagen/core_module.py, its kernels schedules/cpu/core.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mhagen.dtypes import numpy_dtype, to_storage
from mhagen.errors import InputError
from mhagen.inputs import LENGTHS, argument
from mhagen.ir import expr as ex
from mhagen.ir.numpy_ops import NUMPY_OPS
from mhagen.ir.reference import softmax_rows


@dataclass(frozen=True, eq=False)
class AttentionCore:
    """An attention core layer (made by mhagen.attention_core, which checks the options)."""
    num_heads: int
    head_dim: int
    kv_heads: int
    scale: float
    causal: bool = False
    window: int | None = None          # sliding window: q_idx - kv_idx < window (causal)
    mask: ex.Expr | None = None        # any other boolean mask expression, combined by &
    score_mod: ex.Expr | None = None   # applied to the scaled score before the mask
    key_padding: bool = False          # per-call kv_lens / kv_starts
    dtype: str = "float32"             # of q, k, v and the output (compute: float32)
    name: str = "attention_core"
    options: dict = field(default_factory=dict, compare=False)

    @property
    def full_mask(self) -> ex.Expr | None:
        """causal & window & mask (None: every key visible)."""
        parts = ([ex.causal()] if self.causal else []) + (
            [ex.q_idx - ex.kv_idx < self.window] if self.window is not None else []) + (
            [self.mask] if self.mask is not None else [])
        full = None
        for part in parts:
            full = part if full is None else (full & part)
        return full

    @property
    def reads_query_positions(self) -> bool:
        """Whether the mask or score modifier reads q_idx (else q_len may exceed kv_len:
        cross-attention, whose queries have no place among the keys)."""
        return any(e is not None and "q_idx" in ex.variables(e)
                   for e in (self.full_mask, self.score_mod))

    @property
    def group(self) -> int:
        """Query heads a K/V head."""
        return self.num_heads // self.kv_heads

    def key(self) -> tuple:
        """What tells two cores' kernels apart (a build cache's key): every option but the
        name."""
        return (self.num_heads, self.head_dim, self.kv_heads, float(self.scale),
                bool(self.causal), self.window,
                None if self.mask is None else json.dumps(self.mask.to_json()),
                None if self.score_mod is None else json.dumps(self.score_mod.to_json()),
                bool(self.key_padding), self.dtype)

    def __eq__(self, other):
        return isinstance(other, AttentionCore) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"<AttentionCore {self.name}({opts})>"

    def __str__(self):
        return (f"attention_core {self.name}: q [batch, {self.num_heads}, q_len, "
                f"{self.head_dim}], k/v [batch, {self.kv_heads}, kv_len, {self.head_dim}] "
                f"-> [batch, q_len, {self.num_heads}, {self.head_dim}] {self.dtype}; "
                f"scale {self.scale:.6g}, mask {self.full_mask!r}, score_mod "
                f"{self.score_mod!r}" + (", key padding (kv_lens, kv_starts)"
                                         if self.key_padding else ""))

    # -- calls ---------------------------------------------------------------------------
    def check_shapes(self, q_shape, k_shape, v_shape) -> tuple:
        """(batch, q_len, kv_len) of a call's q, k, v shapes; InputError where they do not
        fit this core."""
        H, G, d = self.num_heads, self.kv_heads, self.head_dim
        want = (f"q [batch, {H}, q_len, {d}], k and v [batch, {G}, kv_len, {d}] with "
                "kv_len >= q_len")
        for name, shape, heads in (("q", q_shape, H), ("k", k_shape, G), ("v", v_shape, G)):
            if len(shape) != 4 or shape[1] != heads or shape[3] != d:
                raise InputError(f"{name} has shape {tuple(shape)}; this attention core takes "
                                 f"{want}")
        if tuple(k_shape) != tuple(v_shape):
            raise InputError(f"k {tuple(k_shape)} and v {tuple(v_shape)} differ; they must "
                             f"have one shape [batch, {G}, kv_len, {d}]")
        batch, q_len, kv_len = q_shape[0], q_shape[2], k_shape[2]
        if k_shape[0] != batch:
            raise InputError(f"q has batch {batch} and k, v batch {k_shape[0]}; give them "
                             "one batch")
        if kv_len < q_len and self.reads_query_positions:
            raise InputError(f"q_len {q_len} > kv_len {kv_len}: the queries are the last "
                             "q_len of the kv_len positions (bottom-right), which this "
                             "core's mask or score_mod reads, so k and v need at least as "
                             "many rows as q")
        return int(batch), int(q_len), int(kv_len)

    def check_bounds(self, kv_lens, kv_starts, batch: int, kv_len: int):
        """(kv_lens, kv_starts) of a call as int32 [batch] arrays (defaults kv_len and 0);
        None, None for a core without key padding (which refuses them)."""
        if not self.key_padding:
            if kv_lens is not None or kv_starts is not None:
                raise InputError("this attention core takes no key lengths; build it with "
                                 "mhagen.attention_core(..., key_padding=True) to pass "
                                 "kv_lens / kv_starts")
            return None, None
        out = []
        for name, given, default in (("kv_lens", kv_lens, kv_len), ("kv_starts", kv_starts, 0)):
            if given is None:
                out.append(np.full(batch, default, np.int32))
                continue
            a = argument(given, name, need=LENGTHS, expects=f"of shape ({batch},)")
            if a.shape != (batch,):
                raise InputError(f"{name} must be integers of shape ({batch},), got "
                                 f"{a.dtype} {a.shape}")
            held = a.tolist()
            if held and (min(held) < 0 or max(held) > kv_len):
                raise InputError(f"{name} must lie in 0..{kv_len} (kv_len, the keys' "
                                 f"length), got {held}")
            out.append(np.ascontiguousarray(a))
        return out[0], out[1]

    def reference(self, q, k, v, kv_lens=None, kv_starts=None) -> np.ndarray:
        """The float64 oracle: [batch, q_len, num_heads, head_dim] (see the module
        docstring for positions and key padding). A half-precision core is evaluated on
        q, k, v rounded to its dtype (what its module computes with), in float64."""
        q, k, v = (self._stored(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
        batch, q_len, kv_len = self.check_shapes(q.shape, k.shape, v.shape)
        ends, starts = self.check_bounds(kv_lens, kv_starts, batch, kv_len)
        if ends is None:
            ends, starts = np.full(batch, kv_len), np.zeros(batch, int)
        kv_idx = np.arange(kv_len)[None, None, :]
        env = {"batch": np.arange(batch)[:, None, None],
               "q_idx": kv_len - q_len + np.arange(q_len)[None, :, None], "kv_idx": kv_idx,
               "q_len": q_len, "kv_len": np.asarray(ends).reshape(-1, 1, 1)}
        out = np.zeros((batch, q_len, self.num_heads, self.head_dim))
        mask = self.full_mask
        for h in range(self.num_heads):
            g = h // self.group
            s = q[:, h] @ np.swapaxes(k[:, g], -1, -2) * self.scale
            if self.score_mod is not None:
                s = np.broadcast_to(ex.evaluate(self.score_mod, dict(env, head=h, score=s),
                                                NUMPY_OPS), s.shape)
            keep = (kv_idx >= np.asarray(starts).reshape(-1, 1, 1)) & (kv_idx < env["kv_len"])
            if mask is not None:
                keep = keep & ex.evaluate(mask, dict(env, head=h), NUMPY_OPS)
            s = np.where(np.broadcast_to(keep, s.shape), s, -np.inf)
            out[:, :, h] = softmax_rows(s) @ v[:, g]
        return out

    def _stored(self, name, a) -> np.ndarray:
        """q, k or v as the core's module holds it (rounded to a half core's dtype), in
        float64; torch tensors and lists read through the input policy."""
        a = argument(a, name, expects=f"[batch, heads, len, {self.head_dim}]")
        if self.dtype != "float32":
            a = to_storage(name, a, self.dtype)
        return np.asarray(a, dtype=np.float64)

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)
