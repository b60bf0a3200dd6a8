"""Rotary position embeddings (RoPE, Su et al. 2021; LLaMA): the spec and its numpy math.

RoPE rotates each query and key head vector by its position t (the token index, from 0) in
the "half-split" layout of LLaMA / Hugging Face's `rotate_half` (GPT-NeoX style): with
r = rotary_dim and i in [0, r/2), the pair (x[i], x[i + r/2]) turns by the angle
t * base^(-2i/r):
    y[i]       = x[i] cos - x[i + r/2] sin
    y[i + r/2] = x[i + r/2] cos + x[i] sin
Dims r..head_dim-1 pass unchanged (partial rotary, as GPT-NeoX / Phi). Values are never
rotated. numpy only: the reference, the lowering (constant tables) and the ONNX export use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhagen.errors import GraphError


@dataclass(frozen=True)
class Rotary:
    """RoPE options: `base` (10000.0 in LLaMA) and `rotary_dim` (the leading dims of each
    head that rotate, even; None: the whole head)."""
    base: float = 10000.0
    rotary_dim: int | None = None

    def attrs(self, head_dim: int) -> dict:
        """The node attributes for heads of width head_dim: {"base", "rotary_dim"}."""
        return {"base": float(self.base),
                "rotary_dim": head_dim if self.rotary_dim is None else self.rotary_dim}


def rotary(base: float = 10000.0, rotary_dim: int | None = None) -> Rotary:
    """RoPE for `mhagen.mha(..., rotary=mhagen.rotary(...))` (see this module's docstring)."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
        raise GraphError(f"rotary base must be a number > 1 (LLaMA: 10000.0), got {base!r}")
    if rotary_dim is not None:
        check_rotary_dim(rotary_dim, None, "rotary")
    return Rotary(float(base), rotary_dim)


def check_rotary_dim(rotary_dim, head_dim, where):
    if (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2
            or rotary_dim % 2):
        raise GraphError(f"{where}: rotary_dim must be an even int >= 2 (dims rotate in "
                         f"pairs), got {rotary_dim!r}")
    if head_dim is not None and rotary_dim > head_dim:
        raise GraphError(f"{where}: rotary_dim {rotary_dim} exceeds the head width "
                         f"{head_dim}; use rotary_dim <= {head_dim}")


def check_attrs(attrs: dict, head_dim: int, where: str):
    """Check a rotary node's (or fused attention's `rotary`) attributes for heads of head_dim."""
    if not isinstance(attrs, dict) or set(attrs) != {"base", "rotary_dim"}:
        raise GraphError(f"{where}: rotary takes {{base, rotary_dim}}, got {attrs!r}")
    base = attrs["base"]
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
        raise GraphError(f"{where}: rotary base must be a number > 1, got {base!r}")
    check_rotary_dim(attrs["rotary_dim"], head_dim, where)


def tables(seq: int, rotary_dim: int, base: float):
    """(cos, sin), each float64 [seq, rotary_dim / 2]: angle[t, i] = t * base^(-2i/r)."""
    half = rotary_dim // 2
    inv_freq = float(base) ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    angle = np.arange(seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle), np.sin(angle)


def apply(x: np.ndarray, rotary_dim: int, base: float, offsets=None) -> np.ndarray:
    """RoPE on x [batch, seq, head_dim] (positions along axis -2), in x's dtype; offsets
    ([batch], decoding layers): row t of batch b is at position offsets[b] + t."""
    half = rotary_dim // 2
    seq = x.shape[-2]
    if offsets is None:
        cos, sin = (t.astype(x.dtype) for t in tables(seq, rotary_dim, base))
    else:
        pos = np.asarray(offsets).reshape(-1, 1) + np.arange(seq)[None, :]     # [batch, seq]
        cos, sin = (t.astype(x.dtype)[pos] for t in tables(int(pos.max()) + 1, rotary_dim,
                                                           base))
    a, b = x[..., :half], x[..., half:rotary_dim]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., rotary_dim:]], axis=-1)
