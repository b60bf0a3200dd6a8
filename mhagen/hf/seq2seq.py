"""Encoder and encoder-decoder families on fused mhagen layers: BERT/RoBERTa, T5, BART, Whisper.

Each Hugging Face attention module plays one of three roles, each a mhagen layer (projections,
attention and output projection fused):

- "encoder": bidirectional self-attention over a right-padded batch,
  `mhagen.mha(..., key_padding=True)`; the key lengths are read from the mask the model
  hands its attention modules (a padding mask, refused otherwise).
- "decoder": causal self-attention on mhagen's K/V cache, `mhagen.mha(..., causal=True,
  kv_cache=N)` (positions absolute: T5's causal relative bias sees true distances).
- "cross": the decoder's queries over the encoder's keys and values. Those are projected once
  per sequence (one torch GEMM per layer, as Hugging Face does) into a mhagen K/V cache whose
  row b holds the encoder's keys 0..lens[b]-1; each call then runs a fused decoding layer
  over that cache with the mask `kv_idx < kv_len - q_len` (the cached keys only: the call's
  own K/V rows, written after them, stay hidden and are overwritten by the next call, whose
  cache.lens is set back to the encoder's lengths). A plain `cross=True` layer would project
  the whole encoder output again at every generated token (2 x enc_len x d_model x
  2 inner_dim flops a layer and a step); this costs one token's K and V projection a step.

T5 has no 1/sqrt(head_dim) score scale (`mha(scale=1.0)`); its relative position bias is
`mhagen.relative_bias` (bidirectional in the encoder, causal buckets in the decoder; the
table is the first layer's, shared by every layer as in T5Stack). Whisper's and BART's query
scaling is mhagen's own 1/sqrt(head_dim); Whisper's k_proj has no bias (a zero b_k).

torch and transformers are imported inside the functions that need them only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhagen.errors import GraphError, InputError

ROLES = ("encoder", "decoder", "cross")


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention module computes, enough to build its mhagen layer.

    role: "encoder", "decoder" or "cross" (module docstring); bias: the projections have
    biases (a module missing some gets zeros); scale: the factor on Q K^T (None:
    1/sqrt(head_dim); T5: 1.0); score_mod: T5's relative bias, else None; family: the
    Hugging Face class it was read from (for messages)."""
    role: str
    d_model: int
    num_heads: int
    head_dim: int
    bias: bool
    scale: float | None = None
    score_mod: object = None
    family: str = ""

    def graph(self, *, cache_len: int | None = None, dtype: str = "float32"):
        """The mhagen layer of this role: cache_len is the K/V cache's rows of a decoder or
        cross layer (for cross: the longest encoder output plus the most new tokens a call
        takes)."""
        import mhagen
        common = dict(head_dim=self.head_dim, bias=self.bias, scale=self.scale, dtype=dtype,
                      name=f"{self.role}_attention")
        if self.role == "encoder":
            return mhagen.mha(self.d_model, self.num_heads, key_padding=True,
                              score_mod=self.score_mod, **common)
        if cache_len is None:
            raise GraphError(f"a {self.role} layer keeps a K/V cache: give cache_len")
        if self.role == "decoder":
            return mhagen.mha(self.d_model, self.num_heads, causal=True, kv_cache=cache_len,
                              score_mod=self.score_mod, **common)
        if self.role == "cross":
            return mhagen.mha(self.d_model, self.num_heads, kv_cache=cache_len,
                              mask=cross_cache_mask(), **common)
        raise GraphError(f"unknown attention role {self.role!r}; one of {ROLES}")


def cross_cache_mask():
    """The cached keys only: a call's own K/V rows (written at lens[b] .. lens[b]+S-1, so
    kv_idx >= kv_len - q_len) are hidden."""
    import mhagen
    return mhagen.kv_idx < mhagen.kv_len - mhagen.q_len


# -- weights: Hugging Face's nn.Linear [out, in] -> mhagen's per-head [H, D, d] ------------

def _array(tensor) -> np.ndarray:
    return tensor.detach().to("cpu").float().numpy()


def head_weights(linear, num_heads: int, head_dim: int):
    """(w [H, D, d], b [H, d] or None) of a projection nn.Linear(D, H*d): head h's output
    columns are rows h*d .. (h+1)*d-1 of linear.weight (as the models' .view(..., H, d))."""
    w = _array(linear.weight)
    if w.shape[0] != num_heads * head_dim:
        raise GraphError(f"{type(linear).__name__} has {w.shape[0]} outputs, expected "
                         f"{num_heads} heads x {head_dim}")
    heads = w.reshape(num_heads, head_dim, w.shape[1]).transpose(0, 2, 1)
    bias = None if linear.bias is None else _array(linear.bias).reshape(num_heads, head_dim)
    return np.ascontiguousarray(heads), bias


def layer_weights(spec: AttentionSpec, q, k, v, o) -> dict:
    """mhagen's weights of `spec`'s layer from the four nn.Linear of a Hugging Face module
    (a missing bias is zeros when spec.bias)."""
    w = {}
    for role, linear in (("q", q), ("k", k), ("v", v)):
        w[f"w_{role}"], b = head_weights(linear, spec.num_heads, spec.head_dim)
        if spec.bias:
            w[f"b_{role}"] = b if b is not None else np.zeros(
                (spec.num_heads, spec.head_dim), np.float32)
    w["w_o"] = np.ascontiguousarray(_array(o.weight).T)
    if spec.bias:
        w["b_o"] = (_array(o.bias) if o.bias is not None
                    else np.zeros(spec.d_model, np.float32))
    return w


def t5_relative_bias(attention, bidirectional: bool):
    """T5's relative position bias of `attention` (a T5Attention with
    has_relative_attention_bias) as a mhagen score modifier."""
    import mhagen
    table = _array(attention.relative_attention_bias.weight).T      # [heads, buckets]
    try:
        return mhagen.relative_bias(table.astype(np.float64),
                                    max_distance=attention.relative_attention_max_distance,
                                    bidirectional=bidirectional)
    except ValueError as err:
        raise GraphError(f"T5's relative attention bias cannot be read: {err}") from None


# -- masks: what the model hands its attention modules -> key lengths ----------------------

def visible_keys(mask, batch: int, q_len: int, kv_len: int):
    """The boolean [batch, q_len, kv_len] torch tensor of the keys each query sees, from the
    mask Hugging Face hands an attention module (None: all; bool: True sees; float: 0 sees,
    very negative hides; [batch or 1, 1, q or 1, kv])."""
    import torch
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"mhagen's fused layers read padding masks as tensors, got "
                         f"{type(mask).__name__} (flex attention's BlockMask?): load the model "
                         "with attn_implementation='sdpa' or 'eager' before optimizing")
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise InputError(f"expected an attention mask [batch, 1, q_len, kv_len], got "
                         f"{tuple(mask.shape)}: per-head masks are not padding masks")
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    seen = seen[:, 0, :, :kv_len]
    if seen.shape[-1] < kv_len:
        raise InputError(f"the attention mask covers {seen.shape[-1]} keys, the layer has "
                         f"{kv_len}")
    return seen.expand(batch, q_len, kv_len)


def padding_lengths(mask, batch: int, q_len: int, kv_len: int, what: str) -> np.ndarray:
    """The int32 [batch] key lengths of a right-padding mask (every query of row b sees keys
    0 .. lens[b]-1); any other mask is refused: mhagen's encoder layers take key lengths,
    not S x S masks. what: the sequence's name for the message."""
    import torch
    seen = visible_keys(mask, batch, q_len, kv_len)
    if seen is None:
        return np.full(batch, kv_len, np.int32)
    lens = seen[:, 0, :].sum(-1)
    padded = torch.arange(kv_len)[None, None, :] < lens[:, None, None]
    if not torch.equal(seen, padded.expand_as(seen)):
        bad = int((seen != padded.expand_as(seen)).any(-1).any(-1).nonzero()[0, 0])
        row = seen[bad, 0].int().tolist()
        raise InputError(f"mhagen's fused {what} attention takes right-padded batches (an "
                         f"attention_mask row of ones, then zeros); row {bad} sees keys "
                         f"{row[:32]}{'...' if len(row) > 32 else ''}: pad on the right "
                         "(tokenizer.padding_side = 'right')")
    return lens.to(torch.int32).numpy()


def check_causal(mask, batch: int, past: int, q_len: int) -> None:
    """Refuse a decoder self-attention mask that is not plain causal after `past` cached
    tokens (query t sees keys 0 .. past+t): a padded decoder input would need key padding,
    which mhagen's decoding layers do not combine with their cache yet."""
    import torch
    kv_len = past + q_len
    if mask is None:
        return
    seen = visible_keys(mask, batch, q_len, kv_len)
    causal = (torch.arange(kv_len)[None, :] <= past + torch.arange(q_len)[:, None])
    if not torch.equal(seen, causal.expand_as(seen)):
        raise InputError("mhagen's fused decoder self-attention takes a causal mask without "
                         "padding (decoding layers keep no key lengths besides their cache): "
                         "drop decoder_attention_mask, or run unpadded rows")


# -- cross-attention: the encoder's keys and values, projected once per sequence ----------

def fill_cross_cache(cache, encoder_states, k, v, num_heads: int, head_dim: int,
                     lens: np.ndarray) -> None:
    """Write the encoder output's keys and values (nn.Linear k, v; encoder_states [B, T, D])
    into the mhagen KVCache rows 0..T-1 and set cache.lens to `lens` (the key lengths)."""
    import torch
    batch, t = encoder_states.shape[:2]
    with torch.no_grad():
        for linear, target in ((k, cache.k), (v, cache.v)):
            projected = linear(encoder_states.to(linear.weight.dtype))
            heads = projected.view(batch, t, num_heads, head_dim).transpose(1, 2)
            torch.from_numpy(target)[:, :, :t].copy_(heads)
    cache.lens[:] = lens

