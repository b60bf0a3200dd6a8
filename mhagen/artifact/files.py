"""Artifact file helpers (numpy and hashlib; mhagen.tensor_file): checksums and the tensor files.

Format 3 (written): weights.safetensors, the kernels' params in the safetensors format (see
write_params_file below for why the params and not the weights). Format 2 (read):
weights.bin and params.bin, arrays back to back, little-endian, no header; the table of name,
shape, dtype, offset, nbytes, sha256 lives in the manifest."""
from __future__ import annotations

import hashlib

import numpy as np

from mhagen.dtypes import name_of, numpy_dtype
from mhagen.errors import ArtifactError, InputError
from mhagen.tensor_file import read_header, read_safetensors, write_safetensors

LITTLE_ENDIAN = {"float32": "<f4", "int32": "<i4", "float16": "<f2", "bfloat16": "<u2"}
# the file holding an artifact's kernels, by target device: a TVM library for CPUs, the
# fatbin compiled at build time for GPUs (launched by the C API through the CUDA driver)
KERNEL_FILES = {"cpu": "kernel.so", "cuda": "kernels.fatbin"}
# the inspection texts an artifact stores beside its kernels, as <what>.txt (inspect(what)
# reads them back from a loaded module)
TEXT_FILES = ("te", "tir", "source")


def source_text(module) -> str:
    """The kernels' assembly: from the build, the saved source.txt, or the library."""
    texts = module.info.texts
    if not texts.get("source") and module.info.executable is not None:
        texts["source"] = module.info.executable.mod.inspect_source("asm")
    return texts.get("source", "")


def sha256_file(path) -> str:
    """sha256 of a file's bytes as hex, read in 1 MiB chunks (the manifest's checksums)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_tensors(path, arrays: dict) -> list:
    """Write arrays back to back; returns the manifest's table of them."""
    table, offset = [], 0
    with open(path, "wb") as f:
        for name, arr in arrays.items():
            dtype_name = name_of(arr.dtype)
            if dtype_name == "bfloat16":   # its bits, as uint16 (numpy would convert)
                arr = np.ascontiguousarray(arr).view(np.uint16)
            data = np.ascontiguousarray(arr, dtype=LITTLE_ENDIAN[dtype_name]).tobytes()
            f.write(data)
            table.append({"name": name, "shape": list(arr.shape), "dtype": dtype_name,
                          "offset": offset, "nbytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            offset += len(data)
    return table


def read_tensors(path, table: list) -> dict:
    """The arrays a table describes, each checked against its size and sha256."""
    raw = open(path, "rb").read()
    out = {}
    for e in table:
        chunk = raw[e["offset"]:e["offset"] + e["nbytes"]]
        if len(chunk) != e["nbytes"] or hashlib.sha256(chunk).hexdigest() != e["sha256"]:
            raise ArtifactError(f"{path}: tensor {e['name']!r} is truncated or corrupted; "
                                "rebuild the module or copy it again")
        dtype = LITTLE_ENDIAN.get(e["dtype"])
        if dtype is None:
            raise ArtifactError(f"{path}: tensor {e['name']!r} has unknown dtype {e['dtype']!r}")
        arr = np.frombuffer(chunk, dtype=dtype).reshape(e["shape"]).copy()
        out[e["name"]] = arr.view(numpy_dtype("bfloat16")) if e["dtype"] == "bfloat16" else arr
    return out


# -- format 3: one safetensors file -------------------------------------------------------
# The kernel-ready params are what both loaders run (libmha.so reads them at fixed offsets;
# mhagen.load binds them as they are), so they are what an artifact stores. The user-layout
# weights (Module.weights: ONNX export, attention maps, rebinding) are recovered from them by
# inverting the params' recipes (unpack_weights); a weight that cannot be recovered bit for bit
# (one no recipe places whole) is stored as well, under WEIGHT_PREFIX + its name.
TENSOR_FILE = "weights.safetensors"
OLD_TENSOR_FILES = ("weights.bin", "params.bin")     # format 2 (read_tensors)
WEIGHT_PREFIX = "weight:"


def unpack_panels(p: np.ndarray, pairs: bool = False) -> np.ndarray:
    """The inverse of mhagen.params.pack_panels: [N / nr, K, nr] (pairs: [N / nr, K / 2, nr,
    2]) -> [K, N]."""
    if pairs:
        n_panels, half, nr, two = p.shape
        return p.transpose(1, 3, 0, 2).reshape(half * two, n_panels * nr)
    n_panels, k, nr = p.shape
    return p.transpose(1, 0, 2).reshape(k, n_panels * nr)


def unpack_weights(buffers: list, params: dict, shapes: dict) -> dict:
    """The user-layout weights that the params' recipes place whole (name -> float32 array of
    shapes[name]), from the program's param buffers (their "pack" recipes) and the params.
    Weights a recipe does not cover entirely are left out."""
    found = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    covered = {n: np.zeros(s, bool) for n, s in shapes.items()}

    def place(piece, block):
        name, head = piece["weight"], piece.get("head")
        if name not in found:
            return
        dest = (found[name], covered[name]) if head is None else \
            (found[name][head], covered[name][head])
        width = dest[0].shape[-1]
        dest[0][...] = block[..., piece["at"]:piece["at"] + width]
        dest[1][...] = True
    for b in buffers:
        recipe, p = b.get("pack") or {}, params.get(b["name"])
        if p is None:
            continue
        p = np.asarray(p, np.float32)
        kind = recipe.get("kind")
        if kind == "weight" and recipe.get("weight") in found:
            found[recipe["weight"]][...] = p
            covered[recipe["weight"]][...] = True
        elif kind == "panels":
            cols = unpack_panels(p, bool(recipe.get("pairs")))
            for piece in recipe["columns"]:
                place(piece, cols)
        elif kind == "vector":
            for piece in recipe["pieces"]:
                place(piece, p)
    return {n: w for n, w in found.items() if covered[n].all()}


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def write_params_file(path, buffers: list, params: dict, weights: dict | None) -> tuple:
    """Write TENSOR_FILE: the params, plus each weight unpack_weights cannot give back bit for
    bit. Returns (params table, weights table) for the manifest: the params' absolute byte
    offsets (libmha.so reads them there), the weights' names, shapes, dtypes and where each
    comes from ("params" or its tensor in the file)."""
    weights = weights or {}
    recovered = unpack_weights(buffers, params,
                               {n: np.shape(w) for n, w in weights.items()})
    tensors, wtable = dict(params), []
    for name in sorted(weights):
        w = np.asarray(weights[name])
        back = recovered.get(name)
        exact = back is not None and _bits(back.astype(w.dtype)) == _bits(w)
        if not exact:
            tensors[WEIGHT_PREFIX + name] = w
        wtable.append({"name": name, "shape": list(w.shape), "dtype": name_of(w.dtype),
                       "from": "params" if exact else WEIGHT_PREFIX + name})
    write_safetensors(path, tensors, {"format": "mhagen.params",
                                      "layout": "the kernels' params (mhagen.load(dir).weights "
                                                "gives the weights in the layer's layout)"})
    header, start = read_header(path)
    ptable = []
    for name in params:
        e = header[name]
        begin, end = e["data_offsets"]
        ptable.append({"name": name, "shape": e["shape"], "dtype": name_of(params[name].dtype),
                       "offset": start + begin, "nbytes": end - begin})
    return ptable, wtable


def read_params_file(path, buffers: list, ptable: list, wtable: list) -> tuple:
    """(weights, params) of a TENSOR_FILE: the params the manifest's table lists (shape,
    dtype and byte offsets checked against the file's header: libmha.so reads them there),
    the weights unpacked from them or read where stored."""
    try:
        tensors, _ = read_safetensors(path)
        header, start = read_header(path)
    except InputError as err:
        raise ArtifactError(f"{err}; rebuild the module or copy it again") from None
    params = {}
    for e in ptable:
        p, entry = tensors.get(e["name"]), header.get(e["name"]) or {}
        offsets = entry.get("data_offsets") or [0, 0]
        if p is None or list(p.shape) != list(e["shape"]) or name_of(p.dtype) != e["dtype"] \
                or [e["offset"], e["nbytes"]] != [start + offsets[0], offsets[1] - offsets[0]]:
            raise ArtifactError(f"{path} does not hold param {e['name']!r} as the manifest "
                                f"lists it ({e['dtype']} {e['shape']} at byte {e['offset']}); "
                                "rebuild the module")
        params[e["name"]] = p
    try:
        need = {e["name"]: tuple(e["shape"]) for e in wtable if e["from"] == "params"}
        recovered = unpack_weights(buffers, params, need)
    except (ValueError, TypeError, IndexError, KeyError) as err:
        raise ArtifactError(f"{path}: the manifest's weights cannot be unpacked from the "
                            f"params ({type(err).__name__}: {err}); rebuild the module"
                            ) from None
    weights = {}
    for e in wtable:
        w = recovered.get(e["name"]) if e["from"] == "params" else tensors.get(e["from"])
        if w is None or list(w.shape) != list(e["shape"]):
            raise ArtifactError(f"{path} does not give weight {e['name']!r} back ({e['dtype']} "
                                f"{e['shape']}); rebuild the module")
        weights[e["name"]] = w.astype(numpy_dtype(e["dtype"]), copy=False)
    return weights, params
