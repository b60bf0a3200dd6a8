"""Weights: random initialisation, checks, files, conversion from torch.nn.MultiheadAttention.

Layout (per head): a head projection's weight is stacked over heads, w[h] is [d_in, d_out],
so y_h = x @ w[h] + b[h]; the output projection's weight is [sum of head widths, d_model].
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError
from mhagen.tensor_file import read_safetensors, write_safetensors
from mhagen.inputs import argument


def init_weights(graph, seed: int = 0) -> dict:
    """Random weights (Glorot-uniform; biases uniform in +-0.1) in the graph's dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in graph.weight_specs():
        if spec.role == "weight":
            a = np.sqrt(6.0 / (spec.fan_in + spec.fan_out))
            w = rng.uniform(-a, a, spec.shape).astype(np.float32)
        else:
            w = rng.uniform(-0.1, 0.1, spec.shape).astype(np.float32)
        out[spec.name] = w.astype(numpy_dtype(graph.dtype))
    return out


def check_weights(graph, weights, dtype=None) -> dict:
    """Check names and shapes against the graph; return the arrays, each read by the input
    policy (mhagen/inputs.py: lists, float64 or integer arrays and torch CPU tensors
    converted, as x is; cast to dtype if given; a half-precision graph's weights are always
    rounded to its dtype first: that is what its kernels hold)."""
    if not isinstance(weights, dict):
        raise InputError(f"weights must be a dict of name -> array, got {type(weights).__name__}; "
                         "use layer.init_weights() or mhagen.weights_from_torch()")
    specs = graph.weight_specs()
    names = {s.name for s in specs}
    missing = sorted(names - set(weights))
    extra = sorted(set(weights) - names)
    if missing or extra:
        raise InputError(f"weights do not match graph {graph.name!r}: missing {missing}, "
                         f"unexpected {extra}; expected names {sorted(names)}")
    out = {}
    storage = None if graph.dtype == "float32" else numpy_dtype(graph.dtype)
    for s in specs:
        name = f"weights[{s.name!r}]"
        arr = argument(weights[s.name], name, dtype=storage or dtype,
                       expects=f"of shape {tuple(s.shape)}")
        if arr.shape != tuple(s.shape):
            raise InputError(f"{name} has shape {arr.shape}, expected {tuple(s.shape)} "
                             f"({'heads x ' if len(s.shape) == 3 else ''}in x out for a "
                             f"{s.role})")
        if not np.all(np.isfinite(arr)):
            raise InputError(f"{name} contains NaN or inf"
                             + ("" if graph.dtype == "float32" else
                                f" (as {graph.dtype}: its largest finite value is "
                                f"{float(np.finfo(numpy_dtype(graph.dtype)).max):.4g})"))
        out[s.name] = np.ascontiguousarray(arr, dtype=dtype) if dtype else arr
    return out


def weights_from_torch(module) -> dict:
    """Convert a torch.nn.MultiheadAttention (or a torch.nn.TransformerEncoderLayer: its
    self_attn) into mhagen weights for `mhagen.mha(d_model=module.embed_dim,
    num_heads=module.num_heads, bias=<has in_proj_bias>)`, or, where kdim == vdim differ
    from embed_dim, for `mhagen.mha(..., cross=True, kv_dim=kdim)` (keys and values from one
    context of width kdim). `mhagen.from_torch(module)` builds the layer with them.

    torch computes q = x @ W_q^T + b_q with W_q the first embed_dim rows of in_proj_weight
    (q_proj_weight where kdim/vdim differ); head h owns rows h*d:(h+1)*d. So
    w_q[h] = W_q[h*d:(h+1)*d].T, and w_o = out_proj.weight.T.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional peer
        raise ImportError("weights_from_torch needs PyTorch: pip install torch") from None
    module = torch_attention(module, "weights_from_torch")
    e, h = module.embed_dim, module.num_heads
    d = e // h

    def np32(t):
        return t.detach().to(torch.float32).cpu().numpy()

    if module._qkv_same_embed_dim:
        w_in = np32(module.in_proj_weight)           # [3E, E]
        projections = [w_in[i * e:(i + 1) * e] for i in range(3)]
    else:                                            # [E, E], [E, kdim], [E, vdim]
        projections = [np32(getattr(module, f"{role}_proj_weight")) for role in "qkv"]
    out = {}
    for i, (role, w) in enumerate(zip("qkv", projections)):   # w: [E_out, E_in]
        out[f"w_{role}"] = np.ascontiguousarray(w.reshape(h, d, -1).transpose(0, 2, 1))
        if module.in_proj_bias is not None:
            out[f"b_{role}"] = np32(module.in_proj_bias)[i * e:(i + 1) * e].reshape(h, d).copy()
    out["w_o"] = np.ascontiguousarray(np32(module.out_proj.weight).T)
    if module.out_proj.bias is not None:
        out["b_o"] = np32(module.out_proj.bias).copy()
    if (module.in_proj_bias is None) != (module.out_proj.bias is None):
        raise InputError("the module has bias on only some projections; mhagen.mha(bias=...) "
                         "adds or drops all of them together")
    return out


def torch_attention(module, caller: str):
    """The torch.nn.MultiheadAttention of `module` (itself, or a TransformerEncoderLayer's
    self_attn), checked to be one mhagen can hold; InputError naming `caller` otherwise.
    torch is imported already (the caller did)."""
    import torch
    nn = torch.nn
    if isinstance(module, nn.TransformerEncoderLayer):
        module = module.self_attn
    elif isinstance(module, nn.TransformerDecoderLayer):
        raise InputError(f"{caller} takes one attention: pass the decoder layer's self_attn "
                         "or its multihead_attn (cross-attention), not the whole "
                         "TransformerDecoderLayer")
    if not isinstance(module, nn.MultiheadAttention):
        raise InputError(f"{caller} takes a torch.nn.MultiheadAttention (or a "
                         f"TransformerEncoderLayer), got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise InputError("add_bias_kv / add_zero_attn are not supported: mhagen layers have no "
                         "learned extra key; build the module without them")
    if module.kdim != module.vdim:
        raise InputError(f"kdim={module.kdim} and vdim={module.vdim} differ: mhagen's "
                         "cross-attention reads keys and values from one context input of "
                         "one width (mhagen.mha(cross=True, kv_dim=...)); use a module with "
                         "kdim == vdim")
    return module


def save_weights(path, weights: dict, metadata: dict | None = None):
    """Write a layer's weights (name -> array) to `path`: safetensors (the format torch and
    Hugging Face tools read; mhagen/tensor_file.py), or numpy's .npz where the path ends in
    .npz. metadata (string -> string) goes in a safetensors header. Nothing is written when
    the weights are refused."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a directory: give save_weights a file path, e.g. "
                         f"{path / 'weights.safetensors'}")
    if not isinstance(weights, dict) or not all(isinstance(k, str) for k in weights):
        raise InputError(f"weights must be a dict of name -> array, got "
                         f"{type(weights).__name__}")
    arrays = {name: np.asarray(w) for name, w in weights.items()}
    if path.suffix == ".npz":
        if metadata:
            raise InputError(".npz files keep no metadata: save to a .safetensors path")
        np.savez(path, **arrays)
    else:
        write_safetensors(path, arrays, metadata)
    return path


def load_weights(path, graph=None) -> dict:
    """The weights in a safetensors or .npz file (told apart by their first bytes), as a
    dict of name -> numpy array; with `graph`, checked against it (missing, extra and
    wrong-shaped names are an InputError that names them)."""
    path = Path(path)
    if not path.is_file():
        where = " (a directory)" if path.is_dir() else ""
        raise InputError(f"cannot read weights: no weights file at {path}{where}")
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if zipped:
        try:
            with np.load(path, allow_pickle=False) as npz:
                weights = {name: npz[name] for name in npz.files}
        except ValueError as err:
            raise InputError(f"{path}: an .npz mhagen cannot read ({err})") from None
    else:
        weights, _ = read_safetensors(path)
    if graph is not None:
        check_weights(graph, weights)
    return weights
