"""Kernel parameters from the user's weights, by recipe (numpy only; no TVM, no lowering).

The lowering describes every param buffer with a JSON recipe (Buffer.pack) that the manifest
keeps, so a loaded artifact repacks new weights exactly as its build did:
  {"kind": "weight", "weight": "w_o"}                  the weight as it is
  {"kind": "panels", "depth": K, "width": N, "panel": nr,
   "columns": [{"weight": "w_q", "head": 0, "at": 0}, ...]}
                    the weights' columns placed side by side in a zero [K, N] matrix, then
                    split into column panels [N / nr, K, nr] (one GEMM panel contiguous);
                    with "pairs": true, [N / nr, K / 2, nr, 2] (see pack_panels; "amx":
                    true marks the GEMMs on AMX tiles, which read the same layout)
  {"kind": "vector", "length": N, "pieces": [{"weight": "b_q", "head": 0, "at": 0}, ...]}
                    biases placed in a zero vector
  {"kind": "constant"}  fixed at build time (block tables): kept in the artifact's weights.safetensors, not derived
"""
from __future__ import annotations

import numpy as np

from mhagen.errors import ArtifactError


def pack_panels(w: np.ndarray, nr: int, pairs: bool = False) -> np.ndarray:
    """[K, N] -> [N / nr, K, nr] (N a multiple of nr): each GEMM column panel contiguous.
    pairs: [N / nr, K / 2, nr, 2] (K even), rows 2 * k2 and 2 * k2 + 1 of a column side by
    side, for GEMMs that multiply pairs of the depth in one instruction."""
    k, n = w.shape
    if pairs:
        return np.ascontiguousarray(w.reshape(k // 2, 2, n // nr, nr).transpose(2, 0, 3, 1))
    return np.ascontiguousarray(w.reshape(k, n // nr, nr).transpose(1, 0, 2))


def _piece(weights, p) -> np.ndarray:
    w = np.asarray(weights[p["weight"]], np.float32)
    return w[p["head"]] if p.get("head") is not None else w


def pack_param(recipe: dict, weights: dict) -> np.ndarray:
    """The param a recipe describes, from weights (name -> array in the user's layout)."""
    kind = recipe["kind"]
    if kind == "weight":
        return np.ascontiguousarray(weights[recipe["weight"]], np.float32)
    if kind == "panels":
        cols = np.zeros((recipe["depth"], recipe["width"]), np.float32)
        for p in recipe["columns"]:
            w = _piece(weights, p)
            cols[:, p["at"]:p["at"] + w.shape[1]] = w
        return pack_panels(cols, recipe["panel"], bool(recipe.get("pairs")))
    if kind == "vector":
        v = np.zeros(recipe["length"], np.float32)
        for p in recipe["pieces"]:
            b = _piece(weights, p)
            v[p["at"]:p["at"] + b.shape[0]] = b
        return v
    raise ArtifactError(f"unknown param recipe {kind!r}; this artifact needs a newer mhagen")
