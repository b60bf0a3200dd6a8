"""PyTorch on mhagen kernels; torch is imported only when a torch module or tensor is given.

- `from_torch(module, target, **options)`: the compiled mhagen Module of a
  torch.nn.MultiheadAttention (or a TransformerEncoderLayer's self_attn), its weights bound
  (mhagen/torch/convert.py; `layer_from_torch` gives the graph and weights unbuilt).
- `kv_lens_from_mask(mask)`: torch's right-padding key_padding_mask as key lengths.
- `MultiheadAttention(module, ...)`: a torch.nn.Module with torch.nn.MultiheadAttention's
  forward on a compiled module, through the custom op `torch.ops.mhagen.multihead_attention`
  that torch.compile and torch.export keep as one node (mhagen/torch/nn.py; importing it
  imports torch).
Module calls themselves take and give torch tensors (mhagen/inputs.py).
"""
from mhagen.torch.convert import from_torch, kv_lens_from_mask, layer_from_torch


def __getattr__(name):
    if name == "MultiheadAttention":    # a torch.nn.Module subclass: needs torch itself
        from mhagen.torch.nn import MultiheadAttention
        return MultiheadAttention
    raise AttributeError(f"module 'mhagen.torch' has no attribute {name!r}")


__all__ = ["MultiheadAttention", "from_torch", "kv_lens_from_mask", "layer_from_torch"]
