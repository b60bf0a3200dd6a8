"""The pieces mhagen.hf.optimize is made of: the family registry, the layer plan a family
adapter returns, the builds shared by layers of one configuration, the per-model state
(cache and the call's padding plan), and `FusedAttention`, the module that takes each
replaced attention module's place.

A family adapter (mhagen/hf/decoders.py; the encoder and encoder-decoder families in
mhagen/hf/seq2seq.py) is a `Family` subclass registered with `@register_family`:

    @register_family
    class Llama(Family):
        name = "llama"
        classes = ("LlamaAttention",)             # the torch classes it replaces, by name
        def plan(self, module, config) -> LayerPlan:    # or raise Unsupported("why")
            ...                                         # mhagen.mha options + weights
        def forward(self, fused, *args, **kwargs):      # HF's forward signature
            hidden = ...; y = fused.attend(hidden); return y, None

torch and transformers are imported at this module's top: it is loaded only by
mhagen.hf.optimize (mhagen/hf/__init__.py imports that lazily).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import mhagen
from mhagen.errors import InputError, MhagenError
from mhagen.hf.cache import MhagenCache, StepPlan
from mhagen.module import Module

FAMILIES: dict = {}        # torch attention class name -> Family instance


class Unsupported(MhagenError):
    """A family adapter cannot map this module (a config variant it does not cover); the
    message says which option and what would be needed."""


def register_family(cls):
    """Class decorator: register a Family subclass for each class name in `cls.classes`."""
    family = cls()
    for name in cls.classes:
        if name in FAMILIES and type(FAMILIES[name]) is not cls:
            raise ValueError(f"{name} is already registered by {FAMILIES[name].name}")
        FAMILIES[name] = family
    return cls


@dataclass
class LayerPlan:
    """What a family adapter reads off one torch attention module.

    options: mhagen.mha keyword arguments (d_model, num_heads, head_dim, kv_heads, causal,
        mask, score_mod, rotary, bias, scale, cross, kv_dim, key_padding); optimize adds
        dtype, and kv_cache/cache_dtype for decoder layers.
    weights: per-head numpy float32 weights as mhagen.mha names them (w_q [H, D, d],
        w_k/w_v [KVH, D, d], w_o [H*d, D], and b_q, b_k, b_v, b_o with bias).
    decoder: a causal self-attention layer that keeps K/V between calls (kv_cache=
        max_seq_len, run through `fused.attend`); False: a layer called whole each time
        (`fused.run`: encoder self-attention, cross-attention).
    positions: the layer reads token positions (rotary): the call's position_ids must agree
        with the cache's (checked once per model call).
    note: one line for the report (what was mapped: "rotary 10000, GQA 4/2, window 4096").
    max_kv_seq_len: a cross-attention layer's longest context (default optimize's
        max_seq_len); builds take any context length up to it.
    context_cache: a cross-attention layer run as a decoding layer over a K/V cache its
        family fills from the context once per sequence (mhagen/hf/seq2seq.py): built with
        kv_cache = max_kv_seq_len (default max_seq_len) + max_seq_len rows.
    modules: torch modules the family's forward still runs (BERT's output LayerNorm, a
        cross layer's K/V projections), kept as the FusedAttention's children.
    """
    options: dict
    weights: dict
    decoder: bool = True
    positions: bool = False
    note: str = ""
    max_kv_seq_len: int | None = None
    context_cache: bool = False
    modules: dict = field(default_factory=dict)


class Family:
    """Base class of a family adapter (see the module docstring)."""
    name = "?"
    classes: tuple = ()

    def plan(self, module, config) -> LayerPlan:
        raise NotImplementedError

    def forward(self, fused: "FusedAttention", *args, **kwargs):
        raise NotImplementedError

    def hooked(self, model):
        """The module whose forward sees the token ids, the 2-D attention_mask, the cache and
        use_cache of a decoder call (optimize hooks it): the model's base module."""
        return getattr(model, "base_model", model)

    def bind(self, fused, args, kwargs) -> inspect.BoundArguments:
        """HF's call arguments by name, read against the replaced class's forward signature."""
        bound = fused.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        return bound


# Programs compiled in this process, shared by every optimized model (a layer configuration:
# graph, batch, target and lengths compiles once; each model's layers get Modules of their own)
SHARED_BUILDS: dict = {}


def _rebound(built: Module, weights) -> Module:
    """A Module over built's compiled program and library, bound to other weights."""
    return Module(built.graph, built.target, built.batch, built.seq_len, built.program,
                  built.library, info=built.info, kv_seq_len=built.kv_seq_len,
                  weights=weights)


class Builds:
    """Compiled modules shared by every layer of one configuration: one build per distinct
    (graph, batch); each layer gets its own Module over the same program and library,
    bound to its own weights (no recompile, temporaries of its own)."""

    def __init__(self, target, max_seq_len: int, dtype: str, cache_dtype: str | None):
        self.target, self.max_seq_len = target, max_seq_len
        self.dtype, self.cache_dtype = dtype, cache_dtype
        self.compiled = {}           # (graph json, batch) -> (Module, the weights it holds)
        self.graphs = {}             # id(plan) -> graph
        self.log = []                # (graph name, batch, seconds)

    def graph(self, plan: LayerPlan):
        key = id(plan)
        if key not in self.graphs:
            options = dict(plan.options, dtype=self.dtype)
            if plan.decoder:
                options.update(kv_cache=self.max_seq_len, cache_dtype=self.cache_dtype)
            elif plan.context_cache:
                options.update(kv_cache=(plan.max_kv_seq_len or self.max_seq_len)
                               + self.max_seq_len)
            self.graphs[key] = (plan, mhagen.mha(**options))
        return self.graphs[key][1]

    def module(self, plan: LayerPlan, batch: int, weights) -> Module:
        """A Module of plan's layer for `batch` rows (decoder layers: exactly; others:
        up to the largest batch built so far), bound to `weights`."""
        graph = self.graph(plan)
        key = (graph.to_json(), batch)
        if key not in self.compiled:
            cross = {}
            if plan.options.get("cross"):
                cross = dict(kv_seq_len=None,
                             max_kv_seq_len=plan.max_kv_seq_len or self.max_seq_len)
            shared_key = key + (str(self.target), self.max_seq_len, tuple(cross.items()))
            built = SHARED_BUILDS.get(shared_key)
            if built is not None:       # another optimized model compiled this layer
                built = _rebound(built, weights)
            else:
                start = time.perf_counter()
                built = mhagen.build(graph, self.target, batch=batch, seq_len=None,
                                     max_seq_len=self.max_seq_len, weights=weights, **cross)
                self.log.append((graph.name, batch, time.perf_counter() - start))
                SHARED_BUILDS[shared_key] = built
            self.compiled[key] = (built, weights)
            return built
        built, held = self.compiled[key]
        if held is weights:
            return built
        return _rebound(built, weights)

    @property
    def count(self) -> int:
        return len(self.compiled)


class ModelState:
    """Shared by every FusedAttention of one optimized model: the builds, the cache of the
    forward under way and its padding plan. Set by the hooks on the model's base module
    (mhagen/hf/optimizer.py) for the length of one forward."""

    def __init__(self, builds: Builds, num_layers: int, max_seq_len: int):
        self.builds, self.num_layers, self.max_seq_len = builds, num_layers, max_seq_len
        self.cache: MhagenCache | None = None
        self.plan: StepPlan | None = None
        self.positions = False       # a replaced layer reads positions (rotary)
        self.decoder = False         # a replaced layer keeps K/V (a decoder layer)
        self.torch_layers = set()    # layer indices left on torch (unsupported="keep")
        self.hooks = ()              # the base module's pre- and post-forward hooks

    def new_cache(self) -> MhagenCache:
        return MhagenCache(self.num_layers, self.max_seq_len, owner=self)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as numpy without a copy where it is contiguous (bfloat16 through
    ml_dtypes); mhagen's kernels are inference-only, so the tensor is detached."""
    t = t.detach()
    if t.device.type != "cpu":
        raise InputError(f"mhagen's CPU modules take CPU tensors; the model runs on "
                         f"{t.device}: model.to('cpu')")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """numpy (float32, float16, ml_dtypes.bfloat16) -> torch of `dtype` (no copy when the
    dtypes agree)."""
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if t.dtype == dtype else t.to(dtype)


class FusedAttention(torch.nn.Module):
    """Takes one torch attention module's place: HF calls it as it called the original
    (the family's `forward` reads those arguments), and it runs the whole layer
    (projections, rotary, attention, output projection) in one mhagen module."""

    def __init__(self, family: Family, plan: LayerPlan, state: ModelState, index: int,
                 replaced: torch.nn.Module, path: str):
        super().__init__()
        self.family, self.plan, self.state, self.index = family, plan, state, index
        self.path = path
        self.replaced_class = type(replaced).__name__
        self.signature = inspect.signature(type(replaced).forward)
        self.layer_idx = getattr(replaced, "layer_idx", index)
        for name in ("is_causal", "config", "head_dim", "num_heads"):
            if hasattr(replaced, name):
                setattr(self, name, getattr(replaced, name))
        self._modules_by_batch = {}
        for name, kept in plan.modules.items():
            self.add_module(name, kept)
        self.train(replaced.training)

    def extra_repr(self) -> str:
        return f"{self.family.name}: replaces {self.replaced_class} ({self.plan.note})"

    def forward(self, *args, **kwargs):
        if self.training:
            raise InputError(f"{self.path} runs on mhagen's kernels, which are inference-only: "
                             "call model.eval() (no gradients flow through them)")
        return self.family.forward(self, *args, **kwargs)

    def module(self, batch: int) -> Module:
        """The mhagen module of this layer for `batch` rows (built on first use)."""
        m = self._modules_by_batch.get(batch)
        if m is None:
            m = self.state.builds.module(self.plan, batch, self.plan.weights)
            self._modules_by_batch[batch] = m
        return m

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder self-attention of hidden [B, S, D] (the new tokens) on the model's cache,
        with the forward's padding plan; returns [B, S, D] in hidden's dtype."""
        state = self.state
        cache, plan = state.cache, state.plan
        if cache is None:            # called outside the model's forward: a cache of its own
            cache, plan = state.new_cache(), StepPlan.of(None, hidden.shape[1])
        x = hidden if plan.dense else plan.pack(hidden)
        batch = x.shape[0]
        module = self.module(batch)
        kv = cache.kv_for(self.layer_idx, module, batch)
        if x.shape[1]:
            before = kv.lens.copy() if not plan.dense else None
            y = to_torch(module(to_numpy(x), cache=kv), hidden.dtype)
            if before is not None:
                kv.lens[...] = before + plan.counts
        else:
            y = x.new_zeros(x.shape)
        return y if plan.dense else plan.unpack(y)

    def run(self, hidden: torch.Tensor, **call) -> torch.Tensor:
        """A whole call without a cache (encoder self-attention, cross-attention): hidden
        [B, S, D]; call: mhagen call arguments (kv_lens=, context= as torch or numpy)."""
        args = {k: (to_numpy(v) if isinstance(v, torch.Tensor) else v)
                for k, v in call.items() if v is not None}
        module = self.module(hidden.shape[0])
        return to_torch(module(to_numpy(hidden), **args), hidden.dtype)


@dataclass
class Report:
    """What mhagen.hf.optimize did to a model: `replaced` (path, torch class, family,
    note), `kept` (path, torch class, reason: only with unsupported="keep"), the distinct
    layer configurations, and the builds so far (batch sizes are built on first use)."""
    model: object
    target: object
    dtype: str
    max_seq_len: int
    replaced: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    state: ModelState | None = None

    @property
    def configurations(self) -> int:
        return len({self.state.builds.graph(f.plan).to_json()
                    for f in self.fused_modules()})

    def fused_modules(self) -> list:
        return [m for m in self.model.modules() if isinstance(m, FusedAttention)]

    def new_cache(self) -> MhagenCache:
        """An empty cache for this model (to pass as `cache=` / `past_key_values=`)."""
        return self.state.new_cache()

    def __str__(self):
        lines = [f"mhagen.hf.optimize: {len(self.replaced)} attention modules replaced "
                 f"({self.configurations} configurations, {self.dtype}, max_seq_len "
                 f"{self.max_seq_len}, target {self.target})"]
        lines += [f"  {path}: {cls} -> {family} ({note})"
                  for path, cls, family, note in self.replaced]
        lines += [f"  kept on torch: {path}: {cls} ({why})" for path, cls, why in self.kept]
        lines += [f"  built {name} for batch {batch} in {secs:.1f} s"
                  for name, batch, secs in self.state.builds.log]
        return "\n".join(lines)
