"""`attn_implementation="mhagen"`: Hugging Face's attention interface on mhagen kernels.

    import mhagen.hf
    mhagen.hf.register()                  # once: "mhagen" joins AttentionInterface
    model = LlamaForCausalLM(config, attn_implementation="mhagen")   # or
    model.set_attn_implementation("mhagen")

A model that dispatches its attention through transformers' AttentionInterface (LLaMA,
Mistral, Qwen2, Gemma 2, GPT-2, BERT, ...) then hands each layer's core -- query, key and
value as it projected and rotated them, [batch, heads, len, head_dim] -- to `attention`
below, which runs it on an attention core module (mhagen.attention_core, compiled once per
configuration and shared by the layers: mhagen/core_module.py), reading the tensors in
place and answering [batch, q_len, heads, head_dim] as the interface expects.

What each call's options become:
  scaling          the core's scale (Gemma 2's query_pre_attn_scalar ** -0.5, GPT-2's
                   options included); None: 1/sqrt(head_dim)
  softcap          mhagen.softcap(softcap) (Gemma 2)
  sliding_window   the core's window: q_idx - kv_idx < sliding_window (Mistral, Qwen2,
                   Gemma 2's sliding layers)
  is_causal / module.is_causal   a causal core (bottom-right: the queries are the last
                   q_len positions of the keys, as with a K/V cache)
  grouped K/V      read in place (no repeat_kv)
  attention_mask   None: the layer's own pattern (as sdpa's is_causal); a 4-D boolean (or
                   0/-inf float) mask: read as causal, sliding or full attention with
                   per-row key bounds [kv_starts, kv_lens) (left and right padding), checked
                   to reproduce the mask exactly; any other mask is refused
Refused, with a MhagenError saying what to do: dropout in training, output_attentions,
position biases (T5-style `position_bias`), attention sinks (`s_aux`), head masks, value
heads of another width, dtypes other than float32/float16/bfloat16, masks that are not
causal/sliding/padding (bidirectional image-token blocks, packed sequences, biases).
A registered mask function ("mhagen" in AttentionMaskInterface: transformers' sdpa_mask)
gives each layer the mask sdpa would get, or None where sdpa would use is_causal.
"""
from __future__ import annotations

import math
import threading
import weakref

import numpy as np

import mhagen
from mhagen.errors import GraphError, InputError
from mhagen.target import resolve

NAME = "mhagen"
_STATE = {"target": "x86"}
_BUILDS: dict = {}          # (core key, target) -> CoreModule
_BY_CALL: dict = {}         # a call's raw options -> the CoreModule they make (no checks)
_BUILD_LOCK = threading.Lock()
_MASKS: list = []           # recent masks' readings: (weakref, version, layer, reading)
_MASK_LOCK = threading.Lock()
_DTYPES = ("float32", "float16", "bfloat16")
_REFUSED_KWARGS = {
    "position_bias": "a position bias added to the scores (T5-style relative attention)",
    "s_aux": "attention sinks (learned per-head logits joining the softmax)",
    "sinks": "attention sinks (learned per-head logits joining the softmax)",
}


def register(name: str = NAME, target="x86") -> str:
    """Register `name` ("mhagen") with transformers' AttentionInterface (the attention
    function below) and AttentionMaskInterface (the masks sdpa gets); models built or
    switched to `attn_implementation=name` then run their attention cores on mhagen
    kernels for `target` (a preset name or Target; "x86": this machine's x86 class).
    Idempotent; returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    if not isinstance(name, str) or not name:
        raise GraphError(f"register() takes a name for attn_implementation, got {name!r}")
    _STATE["target"] = resolve(target)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention(module, query, key, value, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, is_causal: bool | None = None,
              sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """The attention function transformers calls with `attn_implementation="mhagen"`:
    (attn_output [batch, q_len, heads, head_dim], None)."""
    import torch
    _refuse_unsupported(module, dropout, kwargs)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise InputError(f"attn_implementation='mhagen' takes query, key and value as "
                         f"[batch, heads, len, head_dim]; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise InputError(f"attn_implementation='mhagen' takes one head_dim for query, key and "
                         f"value; got {query.shape[-1]}, {key.shape[-1]}, "
                         f"{value.shape[-1]}: use attn_implementation='sdpa' for this model")
    dtype = str(query.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise InputError(f"attn_implementation='mhagen' runs float32, float16 and bfloat16 "
                         f"models; this one is {dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise InputError("attn_implementation='mhagen' is inference-only: run the model "
                         "under torch.no_grad() or torch.inference_mode() (generate() does), "
                         "or use attn_implementation='sdpa' to train")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _window(sliding_window)
    q_len, kv_len = query.shape[2], key.shape[2]
    starts = ends = None
    if attention_mask is None:
        if causal and 1 < q_len < kv_len:
            # sdpa's case too: a static cache's prefill, keys past the prompt not written
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    else:
        causal, window, starts, ends, keys = read_mask(attention_mask, query.shape[0], q_len,
                                                       kv_len, causal, window)
        if keys < kv_len:     # keys no query sees: a static cache's unwritten slots
            key, value = key[:, :, :keys], value[:, :, :keys]
    core_module = core_for(query.shape[1], key.shape[1], query.shape[3], dtype, causal,
                           window, scaling, softcap)
    return core_module(query, key, value, kv_lens=ends, kv_starts=starts), None


def _refuse_unsupported(module, dropout, kwargs) -> None:
    if dropout:
        raise InputError(f"attn_implementation='mhagen' runs inference only, and this call "
                         f"asks for attention dropout {dropout} (a model in training mode): "
                         "call model.eval(), or train with attn_implementation='sdpa'")
    if kwargs.get("output_attentions"):
        raise InputError("attn_implementation='mhagen' does not return attention "
                         "probabilities (its kernels never hold them): call with "
                         "output_attentions=False, or use attn_implementation='eager'")
    if kwargs.get("head_mask") is not None:
        raise InputError("attn_implementation='mhagen' takes no head_mask: drop it, or use "
                         "attn_implementation='eager'")
    for name, what in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise InputError(f"{type(module).__name__} passes {name}= ({what}), which "
                             "attn_implementation='mhagen' does not run: use "
                             "attn_implementation='sdpa' or 'eager' for this model")


def _window(sliding_window):
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) \
            or sliding_window < 1:
        raise InputError(f"sliding_window={sliding_window!r} must be a positive integer")
    return int(sliding_window)


def core_for(heads: int, kv_heads: int, head_dim: int, dtype: str, causal: bool,
             window: int | None, scaling: float | None, softcap: float | None):
    """The compiled core of one configuration (built on first use, its kernels compiled as
    calls need them, then shared by every layer and model that asks for the same one)."""
    target = _STATE["target"]
    call = (heads, kv_heads, head_dim, dtype, causal, window, scaling, softcap, id(target))
    built = _BY_CALL.get(call)
    if built is not None:
        return built
    scale = 1.0 / math.sqrt(head_dim) if scaling is None else float(scaling)
    core = mhagen.attention_core(
        heads, head_dim, kv_heads=kv_heads, causal=causal,
        window=window if causal else None, scale=scale,
        score_mod=None if softcap is None else mhagen.softcap(float(softcap)),
        key_padding=True, dtype=dtype, name="hf_attention")
    key = (core.key(), getattr(target, "name", target))
    with _BUILD_LOCK:
        built = _BUILDS.get(key)
        if built is None:
            built = _BUILDS[key] = mhagen.build(core, target, lazy=True)
        _BY_CALL[call] = built
    return built


def builds() -> dict:
    """The cores compiled so far: {(core key, target name): CoreModule}."""
    return dict(_BUILDS)


# -- reading Hugging Face's masks -----------------------------------------------------------

def read_mask(mask, batch: int, q_len: int, kv_len: int, causal: bool, window):
    """(causal, window, kv_starts, kv_lens, keys) that reproduce a 4-D attention mask [batch
    or 1, heads or 1, q_len, kv_len] exactly over the first `keys` keys (the rest hidden
    from every query): the layer's own pattern (causal with its window, bottom-right: the
    queries are the last q_len of the `keys` positions) first, then plain causal, then full
    attention, each with per-row key bounds [kv_starts[b], kv_lens[b]) read from the keys
    any query sees; over all kv_len keys first, then up to the last key any query sees (a
    static cache holds slots not written yet, past the queries). InputError for a mask no
    such reading reproduces. The layers of one forward share their mask: its reading is
    kept (and checked unchanged by its version counter)."""
    import torch
    if not isinstance(mask, torch.Tensor):
        raise InputError(f"attn_implementation='mhagen' reads boolean or 0/-inf mask "
                         f"tensors; this model passed {type(mask).__name__} (register the "
                         "interface with mhagen.hf.register(), which also registers its "
                         "mask function)")
    layer = (bool(causal), window)
    with _MASK_LOCK:
        for held, version, held_layer, reading in _MASKS:
            if held() is mask and version == mask._version and held_layer == layer:
                return reading
    reading = _read(mask, batch, q_len, kv_len, causal, window)
    with _MASK_LOCK:     # weakly: a forward's masks are freed with it
        _MASKS.insert(0, (weakref.ref(mask), mask._version, layer, reading))
        del _MASKS[4:]
    return reading


def _read(mask, batch, q_len, kv_len, causal, window):
    import torch
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[2] != q_len \
            or mask.shape[3] != kv_len:
        raise InputError(f"attention_mask has shape {tuple(mask.shape)}; "
                         f"attn_implementation='mhagen' reads 4-D masks [{batch} or 1, heads "
                         f"or 1, {q_len}, {kv_len}] (batch, heads, q_len, kv_len)")
    visible = _visible(mask)
    if visible.shape[1] > 1:
        if not bool((visible == visible[:, :1]).all()):
            raise InputError("attention_mask differs between heads; "
                             "attn_implementation='mhagen' reads one mask for every head: "
                             "use attn_implementation='sdpa' for this model")
    visible = visible[:, 0].expand(batch, q_len, kv_len)
    seen = visible.any(dim=1)                                    # [batch, kv_len]
    has = seen.any(dim=1)
    first = seen.to(torch.int32).argmax(dim=1)
    last = kv_len - seen.flip(1).to(torch.int32).argmax(dim=1)
    starts = torch.where(has, first, 0).to(torch.int32)
    ends = torch.where(has, last, 0).to(torch.int32)
    kv_idx = torch.arange(kv_len)
    bounds = (kv_idx >= starts[:, None]) & (kv_idx < ends[:, None])      # [batch, kv_len]
    candidates = list(dict.fromkeys([(causal, window), (True, None), (False, None)]))
    seen_keys = int(ends.max()) if bool(has.any()) else kv_len
    for keys in dict.fromkeys([kv_len, max(seen_keys, q_len)]):
        q_pos = (keys - q_len + torch.arange(q_len))[:, None]
        for is_causal, win in candidates:
            pattern = torch.ones(q_len, kv_len, dtype=torch.bool)
            if is_causal:
                pattern = kv_idx[None, :] <= q_pos
                if win is not None:
                    pattern = pattern & (q_pos - kv_idx[None, :] < win)
            if torch.equal(pattern[None] & bounds[:, None, :], visible):
                return is_causal, win, starts.numpy(), ends.numpy(), keys
    raise InputError(
        "attention_mask is neither causal, sliding-window nor full attention with padding "
        "(each batch row seeing one contiguous range of keys), so "
        "attn_implementation='mhagen' cannot read it (a model with bidirectional "
        "image-token blocks, packed sequences or its own mask): use "
        "attn_implementation='sdpa' for this model")


def _visible(mask):
    """A boolean [b, h, q, k] view of which scores a mask keeps: boolean masks as they are,
    float masks whose values are 0 (kept) or at most half the dtype's lowest (hidden)."""
    import torch
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise InputError(f"attention_mask is a {mask.dtype} tensor; "
                         "attn_implementation='mhagen' reads boolean or 0/-inf float masks")
    kept = mask == 0
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    if not bool((kept | hidden).all()):
        raise InputError("attention_mask adds values other than 0 and -inf to the scores (a "
                         "bias such as ALiBi or relative positions), which "
                         "attn_implementation='mhagen' does not run: use "
                         "attn_implementation='sdpa' or 'eager' for this model")
    return kept
