"""The encoder and encoder-decoder families of mhagen.hf.optimize: BERT/RoBERTa, T5, BART,
Whisper. Each Hugging Face attention module of these plays one of three roles, each one
fused mhagen layer (projections, attention and output projection in mhagen's kernels):

- "encoder": bidirectional self-attention over a right-padded batch,
  `mhagen.mha(..., key_padding=True)`; the key lengths are read from the mask the model
  hands its attention modules (a right-padding mask; any other is refused).
- "decoder": causal self-attention on the model's MhagenCache (`fused.attend`, the
  decoder-only families' path), positions absolute (T5's causal relative bias sees the
  true distances).
- "cross": the decoder's queries over the encoder output's keys and values. Those are
  projected once per sequence (one torch GEMM per layer, as Hugging Face does) into a
  mhagen K/V cache whose row b holds the encoder's keys 0..lens[b]-1; every call then runs
  a fused decoding layer over that cache with the mask `kv_idx < kv_len - q_len` (the
  cached keys only: the call's own K/V rows, written after them, stay hidden, and the
  lengths are set back after the call, so the next call overwrites them). The caches live
  in the EncoderDecoderCache's cross-attention part (a MhagenCache of their own), so
  generate() and beam search reorder them as they do the self-attention ones; a forward
  without a cache projects them for that call only. A plain `mhagen.mha(cross=True)` layer
  would project the whole encoder output again at every generated token (2 x enc_len x
  d_model x 2 inner_dim flops a layer and a step); this costs one token's K and V
  projection a step (computed by the fused QKV GEMM and not read).

Families:
- bert (BertAttention, RobertaAttention): the self-attention and its output dense fused,
  the output LayerNorm(y + x) kept in torch; encoder only (a BERT decoder, is_decoder or
  cross-attention, is refused).
- t5 (T5Attention): no bias, no 1/sqrt(d) (`scale=1.0`), the relative position bias as
  `mhagen.relative_bias` (bidirectional buckets in the encoder, causal ones in the
  decoder; the table is the stack's first layer's, shared by every layer as T5Stack
  passes position_bias along); encoder, decoder and cross roles.
- bart (BartAttention, WhisperAttention): BART's and Whisper's attention (Whisper's
  k_proj has no bias: zeros); encoder, decoder and cross roles. Whisper's encoder runs
  max_source_positions frames: optimize's max_seq_len must hold them.

torch and transformers are imported at this module's top: mhagen.hf.optimize loads it,
never `import mhagen`.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, EncoderDecoderCache

import mhagen
from mhagen.errors import InputError
from mhagen.hf.cache import MhagenCache
from mhagen.hf.fused import Family, LayerPlan, Unsupported, register_family
from mhagen.kvcache import KVCache

ROLES = ("encoder", "decoder", "cross")


def role_options(role: str, d_model: int, num_heads: int, head_dim: int, bias: bool,
                 scale: float | None = None, score_mod=None) -> dict:
    """mhagen.mha options of a layer of `role` (the module docstring); optimize adds the
    dtype and a decoder's kv_cache, and a cross layer's kv_cache (LayerPlan.context_cache)."""
    options = dict(d_model=d_model, num_heads=num_heads, head_dim=head_dim, bias=bias,
                   scale=scale)
    if role == "encoder":
        options.update(key_padding=True, score_mod=score_mod)
    elif role == "decoder":
        options.update(causal=True, score_mod=score_mod)
    elif role == "cross":
        options.update(mask=cross_cache_mask())
    else:
        raise ValueError(f"unknown attention role {role!r}; one of {ROLES}")
    return options


def cross_cache_mask():
    """The cached keys only: a call's own K/V rows (written at lens[b] .. lens[b]+S-1, so
    kv_idx >= kv_len - q_len) are hidden."""
    return mhagen.kv_idx < mhagen.kv_len - mhagen.q_len


# -- weights: Hugging Face's nn.Linear [out, in] -> mhagen's per-head [H, D, d] ------------

def _array(tensor) -> np.ndarray:
    return tensor.detach().to("cpu").float().numpy()


def head_weights(linear, num_heads: int, head_dim: int):
    """(w [H, D, d], b [H, d] or None) of a projection nn.Linear(D, H*d): head h's output
    columns are rows h*d .. (h+1)*d-1 of linear.weight (as the models' .view(..., H, d))."""
    w = _array(linear.weight)
    if w.shape[0] != num_heads * head_dim:
        raise Unsupported(f"a projection with {w.shape[0]} outputs; expected {num_heads} "
                          f"heads x {head_dim}")
    heads = w.reshape(num_heads, head_dim, w.shape[1]).transpose(0, 2, 1)
    bias = None if linear.bias is None else _array(linear.bias).reshape(num_heads, head_dim)
    return np.ascontiguousarray(heads), bias


def layer_weights(q, k, v, o, num_heads: int, head_dim: int, bias: bool) -> dict:
    """mhagen's weights from the four nn.Linear of a Hugging Face attention module (a
    missing bias is zeros when `bias`)."""
    w = {}
    for role, linear in (("q", q), ("k", k), ("v", v)):
        w[f"w_{role}"], b = head_weights(linear, num_heads, head_dim)
        if bias:
            w[f"b_{role}"] = b if b is not None else np.zeros((num_heads, head_dim),
                                                               np.float32)
    w["w_o"] = np.ascontiguousarray(_array(o.weight).T)
    if bias:
        w["b_o"] = (_array(o.bias) if o.bias is not None
                    else np.zeros(o.weight.shape[0], np.float32))
    return w


def has_bias(*linears) -> bool:
    return any(linear.bias is not None for linear in linears)


def t5_relative_bias(attention, bidirectional: bool):
    """T5's relative position bias of `attention` (a T5Attention with
    has_relative_attention_bias) as a mhagen score modifier."""
    table = _array(attention.relative_attention_bias.weight).T      # [heads, buckets]
    try:
        return mhagen.relative_bias(table.astype(np.float64),
                                    max_distance=attention.relative_attention_max_distance,
                                    bidirectional=bidirectional)
    except ValueError as err:
        raise Unsupported(f"its relative attention bias: {err}") from None


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

