"""mhagen.hf.optimize: a Hugging Face model's attention modules replaced in place by whole
layers fused in mhagen's kernels (projections, rotary, attention, output projection), with
mhagen's K/V cache behind Hugging Face's Cache API.

    report = mhagen.hf.optimize(model, target="x86", max_seq_len=512)
    print(report)                          # what was replaced, the builds
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20)

How a call runs: hooks on the model's base module (`model.base_model`) see each forward's
arguments. The pre-hook picks the cache (a `MhagenCache` of this model; an empty
Hugging Face cache, as generate() makes, is swapped for one; use_cache=False gets a
scratch one for the call), reads the 2-D attention_mask's new columns into a `StepPlan`
(padding: each row's real tokens are moved to the front of the call, so left and right
padding run in one batched call per layer and the caches hold real tokens only), checks
room and, for rotary layers, that position_ids agree with the cached positions. Each
`FusedAttention` then runs its layer on the model's cache; the post-hook advances the
cache's column count. The families (which torch classes, how their weights map, what
each refuses) are in mhagen/hf/decoders.py; the registry, the layer plan and the fused
module in mhagen/hf/fused.py; the cache in mhagen/hf/cache.py.
"""
from __future__ import annotations

import inspect

import numpy as np
import torch

from mhagen.errors import InputError
from mhagen.hf import decoders  # noqa: F401  (registers the decoder-only families)
from mhagen.hf import seq2seq  # noqa: F401  (registers the encoder and encoder-decoder families)
from mhagen.hf.cache import MhagenCache, StepPlan
from mhagen.hf.fused import (FAMILIES, Builds, FusedAttention, ModelState, Report,
                             Unsupported)
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
          "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def optimize(model, target="x86", dtype=None, max_seq_len: int | None = None, *,
             batch=1, unsupported: str = "error") -> Report:
    """Replace every attention module of `model` (a transformers PreTrainedModel) by its
    layer fused in mhagen's kernels, in place, and return a Report of what was replaced.

    target: a mhagen target ("x86", "host", a preset or a Target). dtype: the layers'
    storage (torch.float32/float16/bfloat16 or its name); default the model's parameter
    dtype (a different one rounds the layers' inputs and answers in the model's dtype).
    max_seq_len: tokens per sequence the K/V caches hold (prompt + generated; default the
    config's max_position_embeddings, at most 4096). batch: the batch sizes to compile now
    (int, tuple, or None: none); other sizes compile on first use. unsupported: "error"
    (default) refuses a model with an attention module no family covers, naming it;
    "keep" leaves such modules on torch and lists them in the report.
    Nothing is changed when a call is refused."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"optimize() takes a torch model (a transformers PreTrainedModel), "
                         f"got {type(model).__name__}")
    if unsupported not in ("error", "keep"):
        raise InputError(f"unsupported= is 'error' or 'keep', got {unsupported!r}")
    if any(isinstance(m, FusedAttention) for m in model.modules()):
        raise InputError(f"{type(model).__name__} is already optimized (its attention modules "
                         "are mhagen's): optimize a fresh model")
    config = getattr(model, "config", None)
    layer_dtype = _dtype_name(model, dtype)
    max_seq_len = _max_seq_len(config, max_seq_len)
    batches = _batches(batch)

    found, kept = _attention_modules(model, config, unsupported)
    kept_lines = [(p, type(m).__name__, why) for p, m, why in kept]
    if not found:
        if kept:
            return Report(model, target, layer_dtype, max_seq_len, kept=kept_lines,
                          state=ModelState(Builds(target, max_seq_len, layer_dtype,
                                                  layer_dtype), 0, max_seq_len))
        raise InputError(f"found no attention module in {type(model).__name__}: optimize() "
                         "replaces the attention modules of Hugging Face models "
                         f"({', '.join(sorted({f.name for f in FAMILIES.values()}))})")

    num_layers = _num_layers(config, found, kept)
    builds = Builds(target, max_seq_len, layer_dtype, layer_dtype)
    state = ModelState(builds, num_layers, max_seq_len)
    state.torch_layers = {getattr(m, "layer_idx", None) for _, m, _ in kept} - {None}
    fused = [FusedAttention(family, plan, state, index, module, path)
             for index, (path, module, family, plan) in enumerate(found)]
    for f in fused:
        for b in batches:           # compile before anything changes: a failure leaves the model
            f.module(b)
    for f, (path, module, family, plan) in zip(fused, found):
        _replace(model, path, f)
    decoding = [f for f in fused if f.plan.decoder]
    base = (decoding or fused)[0].family.hooked(model)
    state.positions = any(f.plan.positions for f in fused)
    state.decoder = any(f.plan.decoder for f in fused)
    state.cross_cache = any(f.plan.context_cache for f in fused)
    state.hooks = (base.register_forward_pre_hook(_before_forward(base, state),
                                                  with_kwargs=True),
                   base.register_forward_hook(_after_forward(state), with_kwargs=True))
    report = Report(model, target, layer_dtype, max_seq_len,
                    replaced=[(f.path, f.replaced_class, f.family.name, f.plan.note)
                              for f in fused],
                    kept=kept_lines, state=state)
    model.mhagen_report = report
    return report


def _dtype_name(model, dtype) -> str:
    if dtype is None:
        param = next(iter(model.parameters()), None)
        dtype = torch.float32 if param is None else param.dtype
    name = DTYPES.get(dtype)
    if name is None:
        raise InputError(f"dtype= is torch.float32, torch.float16 or torch.bfloat16 (or the "
                         f"model's own when left out), got {dtype!r}")
    return name


def _max_seq_len(config, max_seq_len) -> int:
    if max_seq_len is None:
        known = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None) or 2048
        return int(min(known, 4096))
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise InputError(f"max_seq_len= is the tokens per sequence the K/V caches hold (a "
                         f"positive int: prompt + generated), got {max_seq_len!r}")
    return max_seq_len


def _batches(batch) -> tuple:
    if batch is None:
        return ()
    items = batch if isinstance(batch, (tuple, list)) else (batch,)
    for b in items:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InputError(f"batch= is the batch sizes to compile now (a positive int, a "
                             f"tuple of them, or None), got {batch!r}")
    return tuple(dict.fromkeys(items))


def _looks_like_attention(module) -> bool:
    name = type(module).__name__
    return "Attention" in name or name.endswith(("Attn", "SelfAttn"))


def _attention_modules(model, config, unsupported):
    """([(path, module, family, plan)] to replace, [(path, module, reason)] kept), walking
    the modules top-down: a registered class is planned (its children are its own); an
    attention-looking class no family covers is refused or kept."""
    found, kept, refused = [], [], []
    skip = ()

    for path, module in model.named_modules():
        if skip and any(path.startswith(p + ".") for p in skip):
            continue
        family = FAMILIES.get(type(module).__name__)
        if family is not None:
            skip += (path,)
            try:
                found.append((path, module, family, family.plan(module, config)))
            except Unsupported as err:
                refused.append((path, module, f"{family.name}: {err}"))
            continue
        if _looks_like_attention(module) and not any(
                _looks_like_attention(m) for n, m in module.named_modules() if n):
            skip += (path,)
            refused.append((path, module, "no mhagen family covers this class"))
    if refused and unsupported == "error":
        path, module, why = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise InputError(f"cannot optimize {path or type(model).__name__}: "
                         f"{type(module).__name__}: {why}{more}; families: "
                         f"{', '.join(_family_list())}; pass unsupported='keep' to leave "
                         "such modules on torch")
    kept = refused
    return found, kept


def _family_list():
    out = {}
    for cls, family in FAMILIES.items():
        out.setdefault(family.name, []).append(cls)
    return [f"{name} ({'/'.join(c)})" for name, c in sorted(out.items())]


def _num_layers(config, found, kept) -> int:
    indices = [getattr(m, "layer_idx", None) for _, m, *_ in found + kept]
    known = [i for i in indices if isinstance(i, int)]
    n = getattr(config, "num_hidden_layers", None) or 0
    return max([n, len(found) + len(kept)] + [i + 1 for i in known])


def _replace(model, path: str, new) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def _before_forward(base, state: ModelState):
    """The pre-hook on the base module: the call's cache and padding plan (module docstring)."""
    signature = inspect.signature(base.forward)

    def hook(module, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        kw = dict(bound.arguments)
        kw.update(kw.pop("kwargs", {}) if isinstance(kw.get("kwargs"), dict) else {})
        given = kw.pop("past_key_values", None)
        given = kw.get("cache", None) if given is None else given
        ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
        x = ids if ids is not None else embeds
        if x is None:
            return None              # HF raises its own error for the missing input
        rows, columns = int(x.shape[0]), int(x.shape[1])
        use_cache = kw.get("use_cache")
        if use_cache is None:
            use_cache = getattr(getattr(module, "config", None), "use_cache", True)

        cache, passed = _the_cache(given, state)
        if getattr(state, "cross_cache", False) and not isinstance(passed, EncoderDecoderCache):
            # an encoder-decoder's cross-attention layers keep their K/V in the second part
            passed = EncoderDecoderCache(cache, DynamicCache())
        mask = kw.get("attention_mask")
        new_mask = None
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                raise InputError("the optimized model takes a 2-D attention_mask [batch, "
                                 "cached + new tokens] (1 real, 0 padding), got "
                                 f"{getattr(mask, 'shape', type(mask).__name__)}")
            if mask.shape[1] != cache.columns + columns:
                raise InputError(f"attention_mask has {mask.shape[1]} columns; the cache holds "
                                 f"{cache.columns} and the call adds {columns}: pass the mask "
                                 "of every token so far")
            new_mask = mask[:, -columns:] if columns else mask[:, :0]
        plan = StepPlan.of(new_mask, columns)
        lens = cache.lens()
        held = np.zeros(rows, np.int32) if lens is None else lens
        if len(held) != rows:
            raise InputError(f"the cache holds {len(held)} rows and this call has {rows}: pass "
                             "the cache made for this batch, or none")
        width = columns if plan.dense else plan.width
        if rows and int(held.max()) + width > state.max_seq_len:
            raise InputError(f"a row would hold {int(held.max()) + width} tokens; the model was "
                             f"optimized for max_seq_len={state.max_seq_len}: "
                             "mhagen.hf.optimize(model, max_seq_len=...) with room for the "
                             "prompt and every generated token")
        if state.positions and columns:
            _check_positions(kw.get("position_ids"), cache, plan, held, rows, columns)
        state.cache, state.plan = cache, plan
        if use_cache:
            kw["cache" if "cache" in signature.parameters else "past_key_values"] = passed
        return (), kw

    return hook


def _the_cache(given, state: ModelState):
    """(the MhagenCache the fused layers use, what the model's forward is given): the cache
    passed (this model's), or a new one in place of none or of an empty Hugging Face cache;
    an EncoderDecoderCache keeps its cross-attention part and gets the MhagenCache as its
    self-attention part."""
    if isinstance(given, EncoderDecoderCache):
        inner, _ = _the_cache(given.self_attention_cache, state)
        given.self_attention_cache = inner
        return inner, given
    if isinstance(given, MhagenCache):
        if given.owner is not state:
            raise InputError("this MhagenCache belongs to another optimized model: pass "
                             "report.new_cache() of this one (or none)")
        return given, given
    if given is not None:
        if not isinstance(given, Cache):
            raise InputError(f"the optimized model keeps K/V in mhagen's cache; got a "
                             f"{type(given).__name__} as the cache: pass none (a new one is "
                             "made) or report.new_cache()")
        if given.get_seq_length() > 0:
            raise InputError(f"the optimized model cannot continue from a "
                             f"{type(given).__name__} holding {given.get_seq_length()} tokens "
                             "(its keys were made by torch layers): run the prompt on the "
                             "optimized model with a new cache")
    cache = state.new_cache()
    for index in getattr(state, "torch_layers", ()):
        if index < len(cache.layers):
            cache.layers[index] = DynamicLayer()
    return cache, cache


def _check_positions(position_ids, cache: MhagenCache, plan: StepPlan, held, rows, columns):
    """Rotary layers place new token t of row b at held[b] + t (its real tokens counted);
    refuse position_ids that place them elsewhere than by one constant offset per row
    (a left-padded prompt numbered from its first column keeps its offset; right padding
    continued without position_ids does not)."""
    if position_ids is None:
        pos = torch.arange(columns)[None, :].expand(rows, -1) + cache.columns
    else:
        if position_ids.dim() != 2:
            raise InputError(f"position_ids must be [batch, tokens], got "
                             f"{tuple(position_ids.shape)}")
        pos = position_ids.expand(rows, -1)
    pos = pos.to(torch.int64)
    if plan.dense:
        real, counts = pos, np.full(rows, columns)
    else:
        real, counts = torch.gather(pos, 1, plan.gather), plan.counts
    real = real.numpy()
    expected = held[:, None].astype(np.int64) + np.arange(real.shape[1])[None, :]
    offsets = real - expected
    first = offsets[:, 0] if real.shape[1] else np.zeros(rows, np.int64)
    width_ok = np.arange(real.shape[1])[None, :] < counts[:, None]
    if np.any((offsets != first[:, None]) & width_ok):
        raise InputError("position_ids do not number each row's real tokens consecutively "
                         "after its cached ones (mhagen's caches hold real tokens only): pass "
                         "position_ids = attention_mask.cumsum(-1) - 1, as generate() does")
    if cache.offsets is None:
        cache.offsets = np.where(held == 0, first, 0).astype(np.int64)
    started = (held > 0) & (counts > 0)
    if np.any(started & (first != cache.offsets)):
        b = int(np.flatnonzero(started & (first != cache.offsets))[0])
        raise InputError(f"position_ids put row {b}'s next token at {int(real[b, 0])}, where "
                         f"its cached real tokens say {int(held[b] + cache.offsets[b])} "
                         "(mhagen's caches hold real tokens only; generate() numbers a "
                         "right-padded row's new tokens from its last padding column): pad "
                         "decoder-only prompts on the left (tokenizer.padding_side='left'), "
                         "or pass position_ids = attention_mask.cumsum(-1) - 1")
    fresh = (held == 0) & (counts > 0)
    cache.offsets = np.where(fresh, first, cache.offsets)


def _after_forward(state: ModelState):
    def hook(module, args, kwargs, output):
        if state.cache is not None and state.plan is not None:
            state.cache.columns += state.plan.columns
        state.cache = state.plan = None
        return None
    return hook
