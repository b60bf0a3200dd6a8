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



def cross_store(cache, state) -> MhagenCache | None:
    """The MhagenCache holding this model's cross-attention K/V caches between calls: the
    cross part of the EncoderDecoderCache the decoder was given (an empty Hugging Face
    cache there, as generate() makes, is swapped for one); None without an
    EncoderDecoderCache (use_cache=False: each call projects the encoder output anew)."""
    if not isinstance(cache, EncoderDecoderCache):
        return None
    store = cache.cross_attention_cache
    if isinstance(store, MhagenCache) and store.owner is state:
        return store
    if isinstance(store, MhagenCache) or (isinstance(store, Cache)
                                          and store.get_seq_length() > 0):
        raise InputError("the cache's cross-attention part holds keys made elsewhere (by "
                         "torch layers or another optimized model): run the optimized model "
                         "with a new cache (or none)")
    store = MhagenCache(state.num_layers, state.max_seq_len, owner=state)
    cache.cross_attention_cache = store
    return store


def cross_attend(fused, hidden, encoder_states, mask, cache) -> torch.Tensor:
    """Cross-attention of hidden [B, S, D] over encoder_states [B, T, D] (module docstring):
    the encoder's K/V projected into a KVCache on the first call of a sequence, then one
    fused decoding call over it."""
    batch, columns = hidden.shape[:2]
    store = cross_store(cache, fused.state)
    module = fused.module(batch)
    kv = None
    if store is not None:
        kv = store.layers[fused.layer_idx].kv
        if kv is not None and kv.batch != batch:
            raise InputError(f"the cross-attention cache holds {kv.batch} rows and this call "
                             f"has {batch}: pass the cache of this batch, or none")
    if kv is None:
        if encoder_states is None:
            raise InputError(f"{fused.path}: cross-attention needs encoder_hidden_states")
        kv = _projected_context(fused, module, hidden, encoder_states, mask)
        if store is not None:
            store.layers[fused.layer_idx].kv = kv
    if int(kv.lens.max(initial=0)) + columns > kv.max_len:
        raise InputError(f"{columns} decoder tokens in one call over an encoder output of "
                         f"{int(kv.lens.max())}: the cross-attention cache holds "
                         f"{kv.max_len} rows; optimize with a larger max_seq_len")
    y = fused.run(hidden, cache=kv)
    kv.lens -= columns          # the call's own rows are not keys: the next call overwrites them
    return y


def _projected_context(fused, module, hidden, encoder_states, mask) -> KVCache:
    """A new KVCache holding the encoder output's keys and values, lens = its key lengths."""
    plan = fused.plan
    batch, columns = hidden.shape[:2]
    length = encoder_states.shape[1]
    if encoder_states.shape[0] != batch:
        raise InputError(f"encoder_hidden_states has {encoder_states.shape[0]} rows and the "
                         f"decoder input {batch}")
    rows = plan.max_kv_seq_len or fused.state.max_seq_len
    if length > rows:
        raise InputError(f"the encoder output has {length} positions; the model was "
                         f"optimized for {rows}: mhagen.hf.optimize(model, max_seq_len>="
                         f"{length})")
    lens = padding_lengths(mask, batch, columns, length, "cross")
    kv = KVCache.empty(module, batch)
    fill_cross_cache(kv, encoder_states, plan.modules["k_proj"], plan.modules["v_proj"],
                     plan.options["num_heads"], plan.options["head_dim"], lens)
    return kv


def encoder_attend(fused, hidden, mask) -> torch.Tensor:
    batch, columns = hidden.shape[:2]
    if columns > fused.state.max_seq_len:
        raise InputError(f"{fused.path}: {columns} positions; the model was optimized for "
                         f"{fused.state.max_seq_len}: mhagen.hf.optimize(model, "
                         f"max_seq_len>={columns})")
    return fused.run(hidden, kv_lens=padding_lengths(mask, batch, columns, columns,
                                                    "encoder"))


def decoder_attend(fused, hidden) -> torch.Tensor:
    plan = fused.state.plan
    if plan is not None and not plan.dense:
        raise InputError("the optimized decoder takes unpadded decoder rows (as generate() "
                         "makes them): drop the zeros of decoder_attention_mask")
    return fused.attend(hidden)


def _note(role: str, heads: int, extra: str = "") -> str:
    what = {"encoder": "encoder self-attention, key padding",
            "decoder": "decoder self-attention, K/V cache",
            "cross": "cross-attention over the encoder's cached K/V"}[role]
    return f"{what}, {heads} heads" + (f", {extra}" if extra else "")


def role_plan(role, q, k, v, o, num_heads, head_dim, d_model, *, scale=None,
              score_mod=None, note="", max_kv_seq_len=None, modules=None) -> LayerPlan:
    """The LayerPlan of one attention module of `role` from its four nn.Linear."""
    bias = has_bias(q, k, v, o)
    options = role_options(role, d_model, num_heads, head_dim, bias, scale, score_mod)
    modules = dict(modules or {})
    if role == "cross":
        modules.update(k_proj=k, v_proj=v)
    return LayerPlan(options, layer_weights(q, k, v, o, num_heads, head_dim, bias),
                     decoder=role == "decoder", note=_note(role, num_heads, note),
                     max_kv_seq_len=max_kv_seq_len, context_cache=role == "cross",
                     modules=modules)


@register_family
class Bert(Family):
    """BERT and RoBERTa encoders: BertAttention = self-attention + output dense, then the
    output LayerNorm(y + x) (kept in torch)."""
    name = "bert"
    classes = ("BertAttention", "RobertaAttention")

    def plan(self, module, config) -> LayerPlan:
        attention = module.self
        if getattr(module, "is_cross_attention", False) or getattr(attention, "is_causal",
                                                                    False):
            raise Unsupported("BERT as a decoder (config.is_decoder / add_cross_attention) is "
                              "not covered: the fused BERT layers are encoder self-attention")
        heads, head_dim = attention.num_attention_heads, attention.attention_head_size
        return role_plan("encoder", attention.query, attention.key, attention.value,
                         module.output.dense, heads, head_dim,
                         attention.query.in_features, note="output LayerNorm in torch",
                         modules={"norm": module.output.LayerNorm})

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs).arguments
        hidden = bound["hidden_states"]
        y = encoder_attend(fused, hidden, bound["attention_mask"])
        return fused.norm(y + hidden), None


def _role(module) -> str:
    """encoder / decoder / cross of a T5, BART or Whisper attention module (its flags as
    the models set them: decoder self-attention is causal, cross-attention is not)."""
    if not module.is_decoder:
        return "encoder"
    return "decoder" if module.is_causal else "cross"


def plan_role(plan: LayerPlan) -> str:
    return "decoder" if plan.decoder else "cross" if plan.context_cache else "encoder"


def attend_in_role(fused, bound, mask):
    """The fused layer's answer to a T5/BART/Whisper attention call (its bound arguments),
    by the role its plan holds: encoder, decoder or cross-attention."""
    hidden = bound["hidden_states"]
    role = plan_role(fused.plan)
    if role == "encoder":
        return encoder_attend(fused, hidden, mask)
    if role == "decoder":
        return decoder_attend(fused, hidden)
    return cross_attend(fused, hidden, bound["key_value_states"], mask, bound["cache"])


@register_family
class T5(Family):
    """T5: no biases, no score scale, the relative position bias of the stack's first
    layer in every self-attention layer."""
    name = "t5"
    classes = ("T5Attention",)

    def __init__(self):
        # the relative bias of each stack (keyed by its config, which every layer of the
        # stack shares), read off its first layer: the walk meets it first
        self._bias = {}

    def plan(self, module, config) -> LayerPlan:
        role = _role(module)
        score_mod, note = None, "no score scale"
        if role != "cross":
            if module.has_relative_attention_bias:
                bias = t5_relative_bias(module, bidirectional=role == "encoder")
                self._bias[id(module.config)] = (module.config, bias)
            held = self._bias.get(id(module.config))
            if held is None:
                raise Unsupported("its stack's relative attention bias (kept by the first "
                                  "layer) was not found before this layer")
            score_mod = held[1]
            note += (f", relative bias {module.relative_attention_num_buckets} buckets "
                     f"to {module.relative_attention_max_distance}")
        return role_plan(role, module.q, module.k, module.v, module.o, module.n_heads,
                         module.key_value_proj_dim, module.d_model, scale=1.0,
                         score_mod=score_mod, note=note)

    def hooked(self, model):
        return model.get_decoder()

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs).arguments
        # position_bias None: the fused layers hold the relative bias themselves
        return attend_in_role(fused, bound, bound["mask"]), None, None


@register_family
class Bart(Family):
    """BART and Whisper attention (Whisper's k_proj has no bias)."""
    name = "bart"
    classes = ("BartAttention", "WhisperAttention")

    def plan(self, module, config) -> LayerPlan:
        role = _role(module)
        config = module.config if getattr(module, "config", None) is not None else config
        context = getattr(config, "max_source_positions", None)   # Whisper's encoder frames
        return role_plan(role, module.q_proj, module.k_proj, module.v_proj, module.out_proj,
                         module.num_heads, module.head_dim, module.embed_dim,
                         max_kv_seq_len=context if role == "cross" else None)

    def hooked(self, model):
        return model.get_decoder()

    def forward(self, fused, *args, **kwargs):
        bound = self.bind(fused, args, kwargs).arguments
        return attend_in_role(fused, bound, bound["attention_mask"]), None
