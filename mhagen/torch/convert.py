"""torch.nn modules as mhagen layers: the layer and its weights of a torch.nn.MultiheadAttention
(or a TransformerEncoderLayer's self_attn), built (`from_torch`); torch's masks read as what
mhagen's kernels take (`kv_lens_from_mask`, `check_attn_mask`). torch is imported inside
the functions that take a torch module only (a mask may be numpy)."""
from __future__ import annotations

import inspect

import numpy as np

from mhagen.dsl import mha
from mhagen.errors import InputError
from mhagen.inputs import MASK, argument
from mhagen.weights import torch_attention, weights_from_torch

# mha() options that the torch module fixes
FROM_MODULE = ("d_model", "num_heads", "head_dim", "kv_heads", "bias", "kv_dim")
_HALF = {"float16", "bfloat16"}


def layer_options() -> tuple:
    """The mhagen.mha() options a caller may give next to a torch module."""
    return tuple(n for n in inspect.signature(mha).parameters if n not in FROM_MODULE)


def layer_from_torch(module, **options):
    """(the mhagen graph, its weights) of a torch.nn.MultiheadAttention or a
    TransformerEncoderLayer's self_attn: d_model = embed_dim, num_heads, bias (all
    projections or none); kdim == vdim != embed_dim makes a cross-attention layer
    (mhagen.mha(cross=True, kv_dim=kdim)); cross=True makes one of a module whose kdim is
    embed_dim. options: mhagen.mha's others (causal, key_padding, mask, dtype ...); dtype
    defaults to the module's parameters' where they are float16 or bfloat16, else float32.
    Refused (InputError): add_bias_kv, add_zero_attn, kdim != vdim, bias on only some
    projections, options the module fixes."""
    attention = torch_attention(module, "from_torch")
    fixed = sorted(set(options) & set(FROM_MODULE))
    if fixed:
        raise InputError(f"{', '.join(fixed)} come from the torch module "
                         f"(embed_dim={attention.embed_dim}, num_heads={attention.num_heads}, "
                         f"kdim={attention.kdim}, bias={attention.in_proj_bias is not None}): "
                         "drop them")
    unknown = sorted(set(options) - set(layer_options()))
    if unknown:
        raise InputError(f"unknown layer option(s) {unknown}; from_torch takes mhagen.mha's "
                         f"{sorted(layer_options())} and mhagen.build's")
    cross = options.pop("cross", None)
    if attention.kdim != attention.embed_dim:
        if cross is False:
            raise InputError(f"the module's kdim={attention.kdim} differs from embed_dim="
                             f"{attention.embed_dim}: it is a cross-attention layer; drop "
                             "cross=False")
        cross = True
    if options.get("dtype") is None:
        options["dtype"] = _module_dtype(attention)
    weights = weights_from_torch(attention)
    graph = mha(attention.embed_dim, attention.num_heads, bias="b_q" in weights,
                cross=bool(cross), kv_dim=attention.kdim if cross else None, **options)
    return graph, weights


def from_torch(module, target="x86", **options):
    """The compiled mhagen Module of a torch.nn.MultiheadAttention (or of a
    TransformerEncoderLayer's self_attn, its norms, feed-forward block and dropouts left
    out), its weights bound. options: mhagen.mha's layer options (causal, key_padding, mask,
    dtype, cross ...: see layer_from_torch) and mhagen.build's (batch, seq_len, max_seq_len,
    kv_seq_len, ...). The module takes mhagen's layout whatever the torch module's
    batch_first: x [batch, seq, embed_dim] (and a cross layer's context [batch, kv_seq,
    kdim]); mhagen.torch.MultiheadAttention is the drop-in torch module that honours it."""
    if "weights" in options:
        raise InputError("from_torch takes the weights from the module: drop weights=")
    layer = {k: options.pop(k) for k in list(options)
             if k in layer_options() or k in FROM_MODULE}
    from mhagen.compile import build
    builds = set(inspect.signature(build).parameters) - {"layer", "target", "weights"}
    unknown = sorted(set(options) - builds)
    if unknown:
        raise InputError(f"unknown option(s) {unknown}; from_torch takes mhagen.mha's "
                         f"{sorted(layer_options())} and mhagen.build's "
                         f"{sorted(builds)}")
    graph, weights = layer_from_torch(module, **layer)
    return build(graph, target, weights=weights, **options)


def kv_lens_from_mask(mask) -> np.ndarray:
    """The key lengths (int32 [batch]) of a right-padding key padding mask, as torch takes
    it (key_padding_mask: bool [batch, kv_seq], True where the key is ignored; or the float
    form, 0 seen and -inf ignored; numpy or torch): row b's keys 0..len-1 are seen and the
    rest ignored, which is what a layer built with key_padding=True does with
    kv_lens=len. A mask that ignores a key before one it sees (left padding, holes) is
    refused: pad the sequences on the right."""
    ignored = argument(mask, "key_padding_mask", need=MASK, expects="[batch, kv_seq]")
    if ignored.ndim != 2:
        raise InputError(f"key_padding_mask must be [batch, kv_seq] (True where a key is "
                         f"ignored), got shape {ignored.shape}")
    lens = (~ignored).sum(axis=1)
    right = np.arange(ignored.shape[1])[None, :] >= lens[:, None]
    if not np.array_equal(ignored, right):
        row = int(np.argmax((ignored != right).any(axis=1)))
        first_ignored = int(np.argmax(ignored[row]))
        last_seen = int(ignored.shape[1] - 1 - np.argmax(~ignored[row][::-1]))
        raise InputError(f"key_padding_mask row {row} is not right padding: it ignores key "
                         f"{first_ignored} but sees key {last_seen}; mhagen pads keys by "
                         "length (keys 0..len-1 seen, the rest ignored): pad the sequences "
                         "on the right")
    return lens.astype(np.int32)


def check_attn_mask(attn_mask, graph, q_len: int, kv_len: int) -> None:
    """Raise InputError unless torch's attn_mask ([q_len, kv_len], bool True = not allowed,
    or float 0 / -inf) is the mask `graph` compiled in: the causal one (query i sees keys
    0..i) for a causal layer, none hidden for another; a layer with its own mask= or a
    hand-built graph takes attn_mask=None only."""
    options = graph.options
    if "causal" not in options or "mask" in options:
        raise InputError("this layer's mask is compiled into it (mhagen.mha(mask=...) or its "
                         "graph's nodes): pass attn_mask=None")
    hidden = argument(attn_mask, "attn_mask", need=MASK, expects=f"[{q_len}, {kv_len}]")
    if hidden.shape != (q_len, kv_len):
        raise InputError(f"attn_mask must be [{q_len}, {kv_len}] (queries, keys), got shape "
                         f"{hidden.shape}; mhagen takes one mask for every batch row and head")
    causal = bool(options["causal"])
    expected = (np.triu(np.ones((q_len, kv_len), bool), 1) if causal
                else np.zeros((q_len, kv_len), bool))
    if not np.array_equal(hidden, expected):
        raise InputError(f"attn_mask is not the {'causal mask' if causal else 'empty mask'} "
                         f"this layer was built with (causal={causal}); mhagen compiles its "
                         "mask into the kernels: build the layer with it as an expression "
                         "(mask=..., e.g. mhagen.sliding_window(w)) and pass attn_mask=None")


def _module_dtype(attention) -> str:
    """The mhagen dtype of a torch module's parameters: float16 or bfloat16 as they are,
    anything else float32."""
    name = str(attention.out_proj.weight.dtype).removeprefix("torch.")
    return name if name in _HALF else "float32"
