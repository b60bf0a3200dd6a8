"""mhagen.torch.MultiheadAttention: a torch.nn.Module with torch.nn.MultiheadAttention's forward,
computed by a compiled mhagen module (inference only), and the custom op it calls,
`torch.ops.mhagen.multihead_attention`, which torch.compile(fullgraph=True) and torch.export
keep as one node (its fake implementation gives the answer's shape and dtype).

The op takes the compiled module by a handle (an int: custom ops take tensors and plain
values only), looked up in this process's registry; a module's handle lives as long as the
torch module holding it. torch's masks are read in the op's real implementation (data-
dependent checks stay out of the traced graph): key_padding_mask into key lengths (right
padding), attn_mask checked to be the mask the layer was built with.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import numpy as np
import torch

from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError
from mhagen.module import Module
from mhagen.torch.convert import check_attn_mask, from_torch, kv_lens_from_mask
from mhagen.weights import torch_attention

_MODULES: dict = {}                  # handle -> compiled mhagen Module
_HANDLES = itertools.count(1)
_TORCH_DTYPES = {numpy_dtype(name): getattr(torch, name)
                 for name in ("float32", "float16", "bfloat16")}


def register(module: Module, owner) -> int:
    """A handle for `module` in the op's registry, dropped when `owner` is collected."""
    handle = next(_HANDLES)
    _MODULES[handle] = module
    weakref.finalize(owner, _MODULES.pop, handle, None)
    return handle


def registered(handle: int) -> Module:
    module = _MODULES.get(handle)
    if module is None:
        raise InputError(f"no mhagen module has handle {handle} in this process: the "
                         "mhagen.torch.MultiheadAttention a traced or exported graph calls "
                         "must be alive (graphs hold its handle, not the module)")
    return module


@torch.library.custom_op("mhagen::multihead_attention", mutates_args=())
def multihead_attention(x: torch.Tensor, context: Optional[torch.Tensor],
                        key_padding_mask: Optional[torch.Tensor],
                        attn_mask: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """The compiled module `handle` on x [batch, seq, d_model] (and a cross layer's context
    [batch, kv_seq, kv_dim]); torch's key_padding_mask ([batch, kv_seq], right padding) as
    key lengths; attn_mask checked against the layer's own. A new tensor over the answer's
    memory (no copy out)."""
    module = registered(handle)
    kv_len = x.shape[1] if context is None else context.shape[1]
    if attn_mask is not None:
        check_attn_mask(attn_mask, module.graph, x.shape[1], kv_len)
    kv_lens = None
    if key_padding_mask is not None:
        kv_lens = kv_lens_from_mask(key_padding_mask)
    elif module.graph.lengths_input is not None:     # no mask: every key seen
        kv_lens = np.full(x.shape[0], kv_len, np.int32)
    return module(x, context=context, kv_lens=kv_lens)


@multihead_attention.register_fake
def _(x, context, key_padding_mask, attn_mask, handle):
    module = registered(handle)
    return x.new_empty((x.shape[0], x.shape[1], module.out_shape[2]),
                       dtype=answer_dtype(module, x.dtype))


def answer_dtype(module: Module, x_dtype):
    """The torch dtype a module answers a tensor of x_dtype in: its storage dtype where x is
    stored so, else float32 (mhagen/module.py)."""
    storage = _TORCH_DTYPES[module.dtype]
    return storage if x_dtype == storage else torch.float32


def _refuse_decoding():
    raise InputError("a decoding layer (kv_cache=) takes a mhagen.KVCache, which torch's "
                     "forward has no argument for: call the mhagen module itself, "
                     "module(x, cache=cache)")


class MultiheadAttention(torch.nn.Module):
    """torch.nn.MultiheadAttention's forward on a compiled mhagen module (inference only).

    MultiheadAttention(module, target="x86", batch_first=None, **options): `module` is a
    torch.nn.MultiheadAttention or TransformerEncoderLayer (compiled by mhagen.from_torch
    with `options`: layer options such as causal=, key_padding=, and build options such as
    seq_len=None, max_seq_len=N; batch_first defaults to the torch module's), or a compiled
    mhagen Module of a mhagen.mha() layer (batch_first defaults to True).

    forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (output, None), as torch's: [batch, seq,
    embed_dim] where batch_first, else [seq, batch, embed_dim] (a transposed view over the
    answer), or [seq, embed_dim] unbatched. Self-attention layers take key and value as the
    query tensor itself; cross-attention layers (kdim, cross=True) one tensor as key and
    value. The mask is the layer's: a causal layer needs is_causal=True or its causal
    attn_mask, another takes neither; key_padding_mask (right padding) needs a layer built
    with key_padding=True. Refused (InputError): need_weights=True, inputs requiring grad
    while grad is enabled, other masks.
    """

    def __init__(self, module, target="x86", *, batch_first: bool | None = None, **options):
        super().__init__()
        if isinstance(module, Module):
            if options:
                raise InputError(f"a compiled mhagen module is wrapped as it is: drop "
                                 f"{sorted(options)}")
            compiled, first = module, True
        else:
            attention = torch_attention(module, "mhagen.torch.MultiheadAttention")
            if options.get("kv_cache") is not None:     # refused before a build
                _refuse_decoding()
            compiled, first = from_torch(attention, target, **options), attention.batch_first
        graph = compiled.graph
        if graph.cache_lens_input is not None:
            _refuse_decoding()
        self.module = compiled
        self.batch_first = first if batch_first is None else bool(batch_first)
        self.embed_dim = compiled.d_model
        self.num_heads = graph.options.get("num_heads")
        context = graph.context_input
        self.kdim = self.vdim = (self.embed_dim if context is None
                                 else context.attrs["shape"][2])
        # static facts the forward branches on (plain values: torch.compile guards them)
        self.cross = context is not None
        self.causal = graph.options.get("causal") if "mask" not in graph.options else None
        self.key_padding = graph.lengths_input is not None
        # torch's TransformerEncoderLayer reads these to choose its fused fast path, which
        # would bypass this module: say there is no packed in-projection
        self.in_proj_bias = None
        self._qkv_same_embed_dim = False
        self.handle = register(compiled, self)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = False,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        if need_weights:
            raise InputError("need_weights=True: mhagen's fused kernels never form the "
                             "attention probabilities; pass need_weights=False "
                             "(module.attention_maps(x) computes them apart)")
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (query, key, value)):
            raise InputError("the query requires grad; mhagen is inference-only: call under "
                             "torch.no_grad()/torch.inference_mode() or pass detached tensors")
        if self.cross:
            if value is not key:
                raise InputError("mhagen's cross-attention reads keys and values from one "
                                 "context: pass the same tensor as key and value")
        elif key is not query or value is not query:
            raise InputError("this is a self-attention layer: pass the query tensor itself as "
                             "key and value (for keys from another tensor build with "
                             "cross=True)")
        self._check_mask_flags(key_padding_mask, attn_mask, is_causal)
        batched = query.dim() == 3
        x, context = query, (key if self.cross else None)
        if not batched:                      # [seq, embed_dim]: a batch of one
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:           # [seq, batch, embed_dim]
            x = x.transpose(0, 1)
            context = None if context is None else context.transpose(0, 1)
        y = torch.ops.mhagen.multihead_attention(x, context, key_padding_mask, attn_mask,
                                                 self.handle)
        if not batched:
            y = y.squeeze(0)
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, None

    def _check_mask_flags(self, key_padding_mask, attn_mask, is_causal):
        """The call's masks against the layer's (what the traced graph can know: flags and
        presence; the masks' values are checked by the op)."""
        if key_padding_mask is not None and not self.key_padding:
            raise InputError("key_padding_mask needs a layer built with key padding: "
                             "mhagen.torch.MultiheadAttention(module, key_padding=True, ...)")
        if self.causal is None:
            if is_causal or attn_mask is not None:
                raise InputError("this layer's mask is compiled into it (mask=... or its "
                                 "graph's nodes): pass attn_mask=None and is_causal=False")
        elif is_causal and not self.causal:
            raise InputError("is_causal=True, but this layer was built without causal=True: "
                             "build it with causal=True")
        elif self.causal and not is_causal and attn_mask is None:
            raise InputError("this layer was built causal=True: pass is_causal=True or the "
                             "causal attn_mask (a torch module would attend to every key "
                             "without one)")

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"batch_first={self.batch_first}, module={self.module!r}")
