"""Artifact file helpers (leaf module: numpy and hashlib only): checksums and the tensor files
(weights.bin, params.bin: arrays back to back, little-endian, no header; the table of name,
shape, dtype, offset, nbytes, sha256 lives in the manifest)."""
from __future__ import annotations

import hashlib

import numpy as np

from mhagen.dtypes import name_of, numpy_dtype
from mhagen.errors import ArtifactError

LITTLE_ENDIAN = {"float32": "<f4", "int32": "<i4", "float16": "<f2", "bfloat16": "<u2"}
# the file holding an artifact's kernels, by target device: a TVM library for CPUs, the
# fatbin compiled at build time for GPUs (launched by the C API through the CUDA driver)
KERNEL_FILES = {"cpu": "kernel.so", "cuda": "kernels.fatbin"}


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
