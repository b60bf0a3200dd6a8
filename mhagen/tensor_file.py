"""The safetensors file format, read and written with numpy (no torch, no extra dependency).

A file is: 8 bytes, the header's length N (little-endian uint64); N bytes of JSON, one entry
per tensor {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]} (offsets relative
to the end of the header) and an optional "__metadata__" of string -> string; then the raw
little-endian tensor bytes. The same files are read by the `safetensors` package, torch and
Hugging Face tools, and by the artifact's C runtime (mhagen/artifact/runtime/).

Tensors are written in sorted name order, back to back (readers such as the `safetensors`
package refuse gaps between them); the header is padded with spaces, as the format allows,
so the data starts 64-byte aligned.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from mhagen.errors import InputError

ALIGN = 64
MAX_HEADER = 100 * 1024 * 1024     # the format's own limit on the JSON header

# safetensors dtype names <-> numpy dtype names (bfloat16 through ml_dtypes)
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}
NAMES = {v: k for k, v in DTYPES.items()}


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> dict:
    """Write `tensors` (name -> numpy array) to `path`; returns the header written.
    metadata: string -> string, kept in the header's "__metadata__"."""
    arrays, entries, offset = {}, {}, 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dtype = str(a.dtype)
        if dtype not in NAMES:
            raise InputError(f"tensor {name!r} has dtype {dtype}, which safetensors files "
                             f"hold as none of {', '.join(sorted(NAMES))}: convert it first")
        arrays[name] = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
        entries[name] = {"dtype": NAMES[dtype], "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    header = dict(entries)
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise InputError(f"safetensors metadata maps strings to strings; {bad} are not")
        header = {"__metadata__": dict(metadata), **entries}
    text = json.dumps(header, separators=(",", ":")).encode()
    length = -(-(8 + len(text)) // ALIGN) * ALIGN - 8      # the data starts 64-byte aligned
    text += b" " * (length - len(text))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.write(text)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
    return header


def read_header(path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data begins;
    InputError for a file that is not one."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path} is not a safetensors file: {size} bytes, shorter than "
                             "the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise InputError(f"{path} is not a safetensors file: its first 8 bytes give a "
                             f"header of {length} bytes, and the file has {size}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"{path} is not a safetensors file: its header is not JSON "
                             f"({err})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: a safetensors header is a JSON object, got "
                         f"{type(header).__name__}")
    return header, 8 + length


def read_safetensors(path) -> tuple[dict, dict]:
    """(name -> numpy array, metadata) of a safetensors file; InputError naming the tensor
    for a file whose header and data disagree."""
    path = Path(path)
    header, start = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    data = np.fromfile(path, dtype=np.uint8, offset=start)
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = _numpy_dtype(DTYPES[entry["dtype"]])
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: tensor {name!r} has a header entry mhagen cannot read "
                             f"({entry!r}); dtypes: {', '.join(DTYPES)}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= data.size or end - begin != count * dtype.itemsize:
            raise InputError(f"{path}: tensor {name!r} ({entry['dtype']} {list(shape)}) has "
                             f"data offsets [{begin}, {end}] that do not hold it in the "
                             f"file's {data.size} data bytes")
        tensors[name] = data[begin:end].view(dtype.newbyteorder("<")).astype(
            dtype, copy=False).reshape(shape)
    return tensors, metadata
