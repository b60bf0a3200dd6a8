"""Hugging Face models on mhagen kernels; transformers is imported only when these are called.

- `register()`: `attn_implementation="mhagen"`, the attention core (query, key and value as
  the model projected and rotated them) on mhagen kernels (mhagen/hf/interface.py).
- `optimize(model, ...)`: every attention module replaced in place by the whole layer fused
  in mhagen's kernels, with mhagen's K/V cache behind Hugging Face's Cache API
  (mhagen/hf/optimizer.py).
"""
from mhagen.hf.interface import register  # transformers is imported when it is called

__all__ = ["register", "optimize"]


def optimize(model, *args, **kwargs):
    """Replace the model's attention modules by fused mhagen layers (mhagen/hf/optimizer.py;
    not optimize.py: importing a submodule of that name would replace this function)."""
    from mhagen.hf.optimizer import optimize as optimize_model
    return optimize_model(model, *args, **kwargs)
