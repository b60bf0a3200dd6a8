"""Generate and compile the plain C API of one saved module: DIR/mha.h, DIR/libmha.so (+ TVM's
runtime libraries in DIR/lib).

The C API's code is C++17 source in this package, mhagen/artifact/runtime/ (mha_runtime.h,
mha_runtime.cc, mha_cpu.h: the CPU feature check), copied unchanged into the artifact. What
is specific to one artifact is data, generated here from the manifest into two headers:
  mha.h         the public header: shape macros, the status codes (from STATUS below), the API
  mha_config.h  the tables mha_runtime.cc reads: format version, content hash, shape, the
                buffer and kernel tables, param offsets, the files to check (size, sha256),
                the CPU features the kernels need, the device
so the C library needs no JSON parser. The generator is target-neutral: the compiler and the
TVM runtime to link against come in a Toolchain (a cross build passes e.g.
cxx="aarch64-linux-gnu-g++" and that architecture's runtime libraries).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from mhagen.artifact import build_cache
from mhagen.artifact.files import KERNEL_FILES, TENSOR_FILE, sha256_file
from mhagen.artifact.toolchain import Toolchain
from mhagen.artifact.tvm_runtime import RUNTIME_LIBS, find_tvm_runtime
from mhagen.errors import ArtifactError
from mhagen.host import FEATURES_OF_ARCH

HEADER = "mha.h"
CONFIG = "mha_config.h"
RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
RUNTIME_SOURCES = ("mha_runtime.h", "mha_runtime.cc",   # copied from RUNTIME_DIR
                   "mha_cpu.h", "mha_cuda_driver.h")
SOURCE = "mha_runtime.cc"                                # the one translation unit
LIBRARY = "libmha.so"
LIB_DIR = "lib"
# CPU artifacts: libmha.so is a loader that links no TVM; it checks lib/ against
# LIBRARIES_HEADER (generated after the runtime library is compiled) and opens the runtime
# proper, RUNTIME_LIBRARY (mha_runtime.cc's top says why).
RUNTIME_LIBRARY = f"{LIB_DIR}/libmha_impl.so"
LIBRARIES_HEADER = "mha_libraries.h"
# Everything write_c_api writes but lib/ (and mha_api.cc, the generated source of mhagen
# before the runtime became source files: removed when such a directory is saved again).
GENERATED = (HEADER, CONFIG, LIBRARIES_HEADER, *RUNTIME_SOURCES, LIBRARY, "mha_api.cc")

# Status codes: (name, value, meaning) -- the one table mha.h's enum and mha_config.h's
# MHA_STATUS_LIST (mha_status_name) are written from; mha_runtime.cc uses the names only.
STATUS = (
    ("MHA_OK", 0, "success"),
    ("MHA_ERR_NULL_ARGUMENT", 1, "a NULL artifact_dir, handle, x or y"),
    ("MHA_ERR_SHAPE", 2, "batch/seq_len differ from the shape the artifact was built for"),
    ("MHA_ERR_NOT_FOUND", 3, "the directory or one of its files is missing or unreadable"),
    ("MHA_ERR_CORRUPT", 4, "a file is truncated or corrupted (size or sha256 mismatch), "
                           "or manifest.json is unreadable"),
    ("MHA_ERR_VERSION", 5, "manifest.json has another artifact format version than "
                           "MHA_FORMAT_VERSION"),
    ("MHA_ERR_MISMATCH", 6, "the directory holds another artifact than the one this "
                            "libmha.so was generated for (content hash differs)"),
    ("MHA_ERR_TARGET", 7, "this CPU lacks an instruction set extension the kernels use"),
    ("MHA_ERR_NO_MEMORY", 8, "out of memory"),
    ("MHA_ERR_RUNTIME", 9, "TVM failed to load kernel.so or a kernel failed"),
    ("MHA_ERR_ARGUMENT", 10, "a length out of range, an unaligned cache, or the wrong "
                             "mha_run* function for this artifact"),
    ("MHA_ERR_DEVICE", 11, "CUDA artifacts: no CUDA driver or GPU, or a GPU older than the "
                           "kernels' architecture"),
)

# The files mha_create checks: (name, how). "sha256": size, then the sha256 of its bytes read
# in chunks (kernel.so: TVM loads it; weights.safetensors: the kernels' parameters, copied
# from their byte offsets into their buffers while hashed, so the header needs no parsing:
# the checksum vouches for the offsets mhagen baked in).
CHECKED_FILES = (("kernel.so", "sha256"), (TENSOR_FILE, "sha256"))

# The C API asks the CPU for each feature the kernels need the way the feature table of the
# artifact's architecture says (mhagen.host.FEATURES_OF_ARCH; x86: CPUID and XGETBV, no
# compiler builtin: gcc's __builtin_cpu_supports names AVX-512 BF16 only from gcc 12 on);
# features not in it are not checked at run time (the manifest still lists them).

# The manifest's target device -> the DLPack device type mha_runtime.cc allocates on (its
# device section).
_DEVICES = {"cpu": "kDLCPU", "cuda": "kDLCUDA"}

_DLPACK = {"float32": ("kDLFloat", 32), "float16": ("kDLFloat", 16),
           "bfloat16": ("kDLBfloat", 16), "int32": ("kDLInt", 32)}
# mha.h's mha_value: what x, y and a context hold, by the layer's dtype (mhagen/dtypes.py)
_VALUE_TYPES = {"float32": ("float", "float32"),
                "float16": ("uint16_t", "IEEE 754 binary16 bit patterns (_Float16 / __fp16)"),
                "bfloat16": ("uint16_t", "bfloat16 bit patterns: a float32's upper 16 bits, "
                                         "rounded to nearest even")}
_ROLES = {"input": "kInput", "param": "kParam", "temp": "kTemp", "output": "kOutput",
          "state": "kState"}
_MAX_DIMS = 8     # mha_runtime.h kMaxDims
_MAX_LAUNCH_ARGS = 16   # mha_runtime.h kMaxLaunchArgs
_SYMBOLIC_DIMS = {"fixed": "kFixed", "batch": "kDimBatch", "rows": "kDimRows",
                  "padded_rows": "kDimPaddedRows", "kv_rows": "kDimKvRows",
                  "kv_padded_rows": "kDimKvPaddedRows",
                  "tiles": "kDimTiles",
                  "pool_blocks": "kDimPoolBlocks"}   # mha_runtime.h SymbolicDim
# The int32 inputs of packed / paged decoding layers (mhagen/lower/fused.py): the rows'
# offsets of mha_run_cached_varlen and mha_run_paged, and the sequences' block tables.
_DECODE_INPUTS = ("cu_seqlens", "block_tables")

__all__ = ["CONFIG", "HEADER", "LIBRARY", "RUNTIME_LIBS", "STATUS", "Toolchain",
           "compile_commands", "find_tvm_runtime", "generate_config", "generate_header",
           "remove_c_api", "write_c_api"]


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _layer_summary(manifest) -> str:
    g = manifest.get("graph") or {}
    opts = ", ".join(f"{k}={v}" for k, v in (g.get("options") or {}).items())
    return f"{g.get('name', '?')}({opts}) {g.get('dtype', 'float32')}"


def _layout(manifest):
    """Check the program against what the C API assumes; returns the baked numbers."""
    prog, shapes = manifest["program"], manifest["shapes"]
    batch, seq = shapes["batch"], shapes["seq_len"]
    d_in, d_out = shapes["input"][2], shapes["output"][2]
    bufs = prog["buffers"]
    index = {b["name"]: i for i, b in enumerate(bufs)}
    ins = [i for i, b in enumerate(bufs) if b["role"] == "input"]
    outs = [i for i, b in enumerate(bufs) if b["role"] == "output"]
    states = {b["name"]: i for i, b in enumerate(bufs) if b["role"] == "state"}
    # a packed or paged decoding layer's per-call offsets and block tables (decode entries)
    decode = {bufs[i]["name"]: i for i in ins if bufs[i]["name"] in _DECODE_INPUTS}
    lengths = [i for i in ins if bufs[i]["dtype"] == "int32" and i not in decode.values()]
    ins = [i for i in ins if i not in lengths and i not in decode.values()]
    context = shapes.get("kv_seq_len") is not None   # cross-attention: x, then the context
    if len(ins) != 1 + context or len(outs) != 1 or len(lengths) > 1:
        raise ArtifactError("the C API needs one input (two for cross-attention), one output "
                            f"and at most one lengths buffer; this program has {len(ins)}, "
                            f"{len(outs)} and {len(lengths)}")
    kv_seq = shapes.get("kv_seq_len") or 0
    kv_dim = bufs[ins[1]]["shape"][1] if context else 0
    if states and (sorted(states) != ["k_cache", "v_cache"] or not lengths):
        raise ArtifactError(f"the C API knows the K/V caches of decoding layers only; this "
                            f"program has state buffers {sorted(states)}")
    if context and list(bufs[ins[1]]["shape"]) != [batch * kv_seq, kv_dim]:
        raise ArtifactError(f"context buffer {bufs[ins[1]]['shape']} is not "
                            "[batch*kv_seq, kv_dim]")
    if lengths and list(bufs[lengths[0]]["shape"]) != [batch]:
        raise ArtifactError(f"lengths buffer {bufs[lengths[0]]['shape']} is not [batch]")
    rows = batch * seq

    def numel(b):
        n = 1
        for s in b["shape"]:
            n *= s
        return n
    for b in bufs:
        if b["dtype"] not in _DLPACK:
            raise ArtifactError(f"the C API does not handle buffer {b['name']} of dtype "
                                f"{b['dtype']}")
    dtype = bufs[ins[0]]["dtype"]
    if dtype not in _VALUE_TYPES or numel(bufs[ins[0]]) != rows * d_in:
        raise ArtifactError(f"input buffer {bufs[ins[0]]['shape']} is not [batch*seq, d_model]")
    out_cols, rem = divmod(numel(bufs[outs[0]]), rows)
    if bufs[outs[0]]["dtype"] != dtype or rem or out_cols < d_out:
        raise ArtifactError(f"output buffer {bufs[outs[0]]['shape']} is not [batch*seq, >= "
                            f"{d_out}]")
    if manifest["target"].get("device", "cpu") != "cpu" and (states or out_cols != d_out):
        raise ArtifactError("the CUDA C API runs layers without a K/V cache whose output "
                            "buffer is y itself")
    if decode and not states:
        raise ArtifactError(f"buffers {sorted(decode)} belong to decoding layers; this program "
                            "has no K/V cache")
    cache = bufs[states["k_cache"]]["shape"] if states else [0, 0, 0, 0]
    paged = "block_tables" in decode
    max_len = cache[2]
    if paged:    # a pool's blocks [num_blocks (the call's), kv_heads, block_size, head_dim]
        max_len = int(((manifest.get("graph") or {}).get("options") or {}).get("kv_cache", 0))
        if list(bufs[decode["block_tables"]]["shape"]) != [batch, -(-max_len // cache[2])]:
            raise ArtifactError(f"block_tables {bufs[decode['block_tables']]['shape']} is not "
                                f"[batch, max_len / block_size] for max_len {max_len}")
    if "cu_seqlens" in decode and list(bufs[decode["cu_seqlens"]]["shape"]) != [batch + 1]:
        raise ArtifactError(f"cu_seqlens {bufs[decode['cu_seqlens']]['shape']} is not "
                            "[batch + 1]")
    return dict(batch=batch, seq=seq, d_in=d_in, d_out=d_out, rows=rows, out_cols=out_cols,
                dtype=dtype,
                index=index, input=ins[0], output=outs[0],
                lengths=lengths[0] if lengths else -1,
                lengths_kind=(2 if states else 1) if lengths else 0,
                k_cache=states.get("k_cache", -1), v_cache=states.get("v_cache", -1),
                kv_heads=cache[1], max_len=max_len, head_dim=cache[3],
                cu_seqlens=decode.get("cu_seqlens", -1),
                block_tables=decode.get("block_tables", -1),
                block_size=cache[2] if paged else 0,
                max_blocks=-(-max_len // cache[2]) if paged else 0,
                cache_dtype=bufs[states["k_cache"]]["dtype"] if states else "float32",
                context=ins[1] if context else -1, kv_seq=kv_seq, kv_dim=kv_dim)


def generate_header(manifest) -> str:
    """The C header of one artifact: status codes, shape macros, the four functions."""
    lay = _layout(manifest)
    return (_header_comment(manifest, lay) + _header_macros(manifest, lay)
            + HEADER_API.format(status=_status_enum(),
                                device_api=_device_text(manifest)["device_api"]))


def _symbolic(manifest) -> dict:
    return manifest["program"].get("symbolic") or {}


def _packed(manifest) -> dict:
    """The program's packed calls ({"kernels", "q_tile"}), or {} (none)."""
    return manifest["program"].get("packed") or {}


def _shape_rule(manifest) -> str:
    """The header's sentence on which shapes the library runs."""
    sym = _symbolic(manifest)
    sb, ss = sym.get("batch"), sym.get("seq")
    if sb or ss:
        return (f"The library runs batch {'1..' if sb else ''}MHA_BATCH and seq_len "
                f"{'1..' if ss else ''}MHA_SEQ_LEN (one build for\n * every length: "
                "x and y then hold batch * seq_len rows); anything else is refused with "
                "MHA_ERR_SHAPE.")
    return ("The library is compiled for exactly this shape: mha_run refuses any "
            "other batch or seq_len\n * with MHA_ERR_SHAPE (build another artifact: "
            "mhagen build --batch B --seq-len S ...).")


def _value_doc(dtype: str) -> tuple:
    """(the C type of mha_value, what it holds in words)."""
    ctype, cdoc = _VALUE_TYPES[dtype]
    return ctype, "IEEE 754 single precision" if dtype == "float32" else cdoc


def _status_enum() -> str:
    return "\n".join(f"  {n} = {v},{' ' * (24 - len(n))}/* {doc} */" for n, v, doc in STATUS)


def _device_text(manifest) -> dict:
    """The header's lines that differ by device: target, build, memory paragraph, extra API."""
    t = manifest["target"]
    if t.get("device", "cpu") == "cuda":
        arch = (manifest.get("device_code") or {}).get("arch", "?")
        return dict(
            target_line=(f"{t['name']} (NVIDIA GPUs, {arch}: compute capability "
                         f"{arch[3:-1]}.{arch[-1]} or newer)"),
            build_line=("cc app.c -I DIR -L DIR -lmha -Wl,-rpath,DIR   (DIR absolute; "
                        "libmha.so opens\n *         the CUDA driver, libcuda.so.1, at "
                        "mha_create: no CUDA toolkit and no TVM needed)"),
            memory_doc=CUDA_MEMORY_DOC, device_api=CUDA_API)
    return dict(
        target_line=(f"{t['name']} ({t['arch']}, {t.get('vector_bits', '?')}-bit vectors); "
                     "the kernels need\n *          "
                     f"{' '.join(t.get('features') or []) or 'no CPU extension'}"),
        build_line=("cc app.c -I DIR -L DIR -lmha -Wl,-rpath,DIR   (DIR absolute; libmha.so "
                    "checks and\n *         opens DIR/lib/libmha_impl.so and TVM's runtime "
                    "libraries beside it at mha_create)"),
        memory_doc=CPU_MEMORY_DOC, device_api="")


def _header_comment(manifest, lay) -> str:
    """mha.h's opening comment: layer, target, shapes, use, build, memory and threads."""
    b, s, d, do = lay["batch"], lay["seq"], lay["d_in"], lay["d_out"]
    dtype = lay["dtype"]
    ctype, cdoc = _value_doc(dtype)
    dev = _device_text(manifest)
    target_line, build_line, memory_doc = (dev["target_line"], dev["build_line"],
                                           dev["memory_doc"])
    shape_rule = _shape_rule(manifest)
    return f"""\
/* mha.h -- the C API of one compiled mhagen artifact (generated by mhagen; do not edit).
 *
 * Layer:   {_layer_summary(manifest)}
 * Target:  {target_line}
 * Built:   mhagen {manifest.get('mhagen_version')}, TVM {manifest.get('tvm_version')}
 * Format:  artifact format version {manifest['version']}, content hash
 *          {manifest['content_hash']}
 *
 * Shapes (mha_value = {ctype}: {dtype}, {cdoc}; row-major, contiguous):
 *   x  input   [MHA_BATCH, MHA_SEQ_LEN, MHA_D_MODEL]     = [{b}, {s}, {d}]  ({b * s * d} values)
 *   y  output  [MHA_BATCH, MHA_SEQ_LEN, MHA_OUT_D_MODEL] = [{b}, {s}, {do}]  ({b * s * do} values)
 * {shape_rule}
 *
 * Use (three calls; the weights are part of the artifact):
 *   mha_handle *h = mha_create("path/to/artifact");  // NULL on error: mha_last_error()
 *   int rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y); // MHA_OK (0) or an mha_status
 *   mha_destroy(h);
 * Build:  {build_line}. libmha.so itself is
 *         mha_runtime.cc compiled with this header and mha_config.h (manifest.json
 *         c_api.build_command).
 *
{memory_doc} */
"""


def _header_macros(manifest, lay) -> str:
    """mha.h's types and macros: the value types, the shapes, what the layer takes."""
    b, s, d, do = lay["batch"], lay["seq"], lay["d_in"], lay["d_out"]
    g, n, hd = lay["kv_heads"], lay["max_len"], lay["head_dim"]
    sym = _symbolic(manifest)
    sb, ss = int(bool(sym.get("batch"))), int(bool(sym.get("seq")))
    dtype = lay["dtype"]
    ctype, cdoc = _value_doc(dtype)
    cache_doc = "" if lay["cache_dtype"] == "float32" else \
        f" ({_VALUE_TYPES[lay['cache_dtype']][1]})"
    return f"""\
#ifndef MHA_H_
#define MHA_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

#if defined(_WIN32)
#define MHA_API __declspec(dllexport)
#else
#define MHA_API __attribute__((visibility("default")))
#endif

/* What x, y and a context hold: {dtype} ({cdoc}). The kernels compute in float32. */
typedef {ctype} mha_value;
#define MHA_DTYPE "{dtype}"
/* What a decoding layer's k_cache and v_cache hold: {lay['cache_dtype']}{cache_doc}. */
typedef {_VALUE_TYPES[lay['cache_dtype']][0]} mha_cache_value;
#define MHA_CACHE_DTYPE "{lay['cache_dtype']}"
#define MHA_FLOAT16 {int(dtype == "float16")}    /* 1: mha_value holds binary16 bits */
#define MHA_BFLOAT16 {int(dtype == "bfloat16")}   /* 1: mha_value holds bfloat16 bits */

#define MHA_FORMAT_VERSION {manifest['version']}
#define MHA_CONTENT_HASH "{manifest['content_hash']}"
#define MHA_BATCH {b}
#define MHA_SEQ_LEN {s}
#define MHA_D_MODEL {d}
#define MHA_OUT_D_MODEL {do}
#define MHA_SYMBOLIC_BATCH {sb}     /* 1: any batch 1..MHA_BATCH */
#define MHA_SYMBOLIC_SEQ_LEN {ss}   /* 1: any seq_len 1..MHA_SEQ_LEN */
#define MHA_INPUT_SIZE {b * s * d}   /* values in x */
#define MHA_OUTPUT_SIZE {b * s * do}  /* values in y */
#define MHA_KEY_PADDING {int(lay['lengths_kind'] == 1)}   /* 1: run with mha_run_padded (key lengths) */
#define MHA_KV_CACHE {n}   /* > 0: a decoding layer (mha_run_cached) caching this many tokens */
#define MHA_KV_HEADS {g}
#define MHA_HEAD_DIM {hd}
#define MHA_CACHE_SIZE {0 if lay['block_size'] else b * g * n * hd}   /* values in each of k_cache and v_cache */
#define MHA_VARLEN {int(lay['cu_seqlens'] >= 0)}   /* 1: a decoding layer's cache rows of their own new-token counts (mha_run_cached_varlen, mha_run_paged) */
#define MHA_KV_BLOCK_SIZE {lay['block_size']}   /* > 0: a paged cache of blocks of this many tokens (mha_run_paged) */
#define MHA_MAX_BLOCKS {lay['max_blocks']}   /* a block table's entries per sequence (MHA_KV_CACHE / MHA_KV_BLOCK_SIZE) */
#define MHA_BLOCK_SIZE_VALUES {g * lay['block_size'] * hd}   /* values in one block of a pool */
#define MHA_CROSS {int(lay['context'] >= 0)}   /* 1: a cross-attention layer (mha_run_cross) */
#define MHA_KV_SEQ_LEN {lay['kv_seq']}   /* its context's length (the most, when symbolic) */
#define MHA_SYMBOLIC_KV_SEQ_LEN {int(bool(sym.get('kv_seq')))}   /* 1: any kv_seq_len 1..MHA_KV_SEQ_LEN */
#define MHA_KV_DIM {lay['kv_dim']}   /* its context's width */
#define MHA_CONTEXT_SIZE {b * lay['kv_seq'] * lay['kv_dim']}   /* values in context */
#define MHA_PACKED {int(bool(_packed(manifest)))}   /* 1: packed calls of prefill sequences, each run alone (mha_run_varlen) */
#define MHA_MAX_TOKENS {b * s if _packed(manifest) else 0}   /* a packed call's tokens, at most */

"""


# mha.h from the status enum on: the same for every artifact but the device's extra API.
HEADER_API = """\
typedef enum mha_status {{
{status}
}} mha_status;

/* An opaque handle: the loaded kernels, the parameters and the scratch buffers. */
typedef struct mha_handle mha_handle;

/* Load the artifact in directory artifact_dir (the one this header came from).
 * Returns NULL on error; then mha_last_error_code() says why and mha_last_error() how to fix. */
MHA_API mha_handle *mha_create(const char *artifact_dir);

/* y = layer(x). x: [batch, seq_len, MHA_D_MODEL] values, y: [batch, seq_len, MHA_OUT_D_MODEL]
 * values (written; must not overlap x). batch and seq_len: MHA_BATCH and MHA_SEQ_LEN (at most
 * those, when MHA_SYMBOLIC_BATCH / MHA_SYMBOLIC_SEQ_LEN).
 * Returns MHA_OK or MHA_ERR_NULL_ARGUMENT, MHA_ERR_SHAPE, MHA_ERR_RUNTIME, MHA_ERR_NO_MEMORY;
 * on error y is unspecified. Layers with key padding or a K/V cache take their lengths through
 * mha_run_padded / mha_run_cached (mha_run returns MHA_ERR_ARGUMENT for them). */
MHA_API int mha_run(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                    mha_value *y);

/* Layers built with key_padding=True (MHA_KEY_PADDING 1): mha_run with kv_lens [batch] int32,
 * each in 0..seq_len: query rows of batch row b see keys 0..kv_lens[b]-1 only (a row that sees
 * no key gives the output bias). A length out of range: MHA_ERR_ARGUMENT. */
MHA_API int mha_run_padded(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           const int32_t *kv_lens, mha_value *y);

/* Decoding layers (MHA_KV_CACHE > 0): x holds seq_len new tokens per batch row, which sit at
 * positions cache_lens[b] + t. k_cache and v_cache are the caller's
 * [batch, MHA_KV_HEADS, MHA_KV_CACHE, MHA_HEAD_DIM] mha_cache_value arrays (MHA_CACHE_SIZE
 * each, 64-byte aligned, e.g. aligned_alloc(64, ...)), written in place at rows cache_lens[b] ..
 * cache_lens[b] + seq_len - 1; rows past that are never read, so they need no clearing.
 * cache_lens [batch] int32, each in 0..MHA_KV_CACHE - seq_len, is advanced by seq_len on
 * success. A length out of range or an unaligned cache: MHA_ERR_ARGUMENT, nothing written.
 * A prefill artifact (seq_len = prompt length) and a step artifact (seq_len 1) of the same
 * layer share one cache. */
MHA_API int mha_run_cached(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           mha_cache_value *k_cache, mha_cache_value *v_cache,
                           int32_t *cache_lens, mha_value *y);

/* Decoding layers built for any number of new tokens (MHA_VARLEN 1): each of the
 * MHA_BATCH cache rows adds its own number of tokens, cu_seqlens[b+1] - cu_seqlens[b] (0
 * allowed): cu_seqlens [MHA_BATCH + 1] int32, 0 first, never decreasing, total last. x holds
 * the rows' tokens packed, [total, MHA_D_MODEL] values (row b's at cu_seqlens[b]..), y
 * likewise [total, MHA_OUT_D_MODEL]; total 1..MHA_BATCH * MHA_SEQ_LEN. Token t of row b
 * sits at position cache_lens[b] + t; cache_lens[b] advances by its own count. The caches
 * as mha_run_cached's. Offsets or lengths out of range: MHA_ERR_ARGUMENT, nothing written. */
MHA_API int mha_run_cached_varlen(mha_handle *handle, const mha_value *x, int total,
                                  const int32_t *cu_seqlens, mha_cache_value *k_cache,
                                  mha_cache_value *v_cache, int32_t *cache_lens, mha_value *y);

/* Decoding layers built for a paged cache (MHA_KV_BLOCK_SIZE > 0): num_seqs sequences
 * (1..MHA_BATCH when MHA_VARLEN, else MHA_BATCH) whose keys and values lie in pools k_pool,
 * v_pool [num_blocks, MHA_KV_HEADS, MHA_KV_BLOCK_SIZE, MHA_HEAD_DIM] mha_cache_value
 * (64-byte aligned; MHA_BLOCK_SIZE_VALUES a block): token p of sequence s in block
 * block_tables[s * MHA_MAX_BLOCKS + p / MHA_KV_BLOCK_SIZE] at row p % MHA_KV_BLOCK_SIZE.
 * cu_seqlens [num_seqs + 1] as mha_run_cached_varlen's (total new tokens, MHA_VARLEN 1),
 * or NULL: every sequence MHA_SEQ_LEN tokens (total num_seqs * MHA_SEQ_LEN). cache_lens
 * [num_seqs] int32, each advanced by its count. The caller owns the blocks (allocation,
 * sharing, copy-on-write): every block a sequence's tokens and new tokens lie in must be
 * in the table, each new token's block its own (not shared). An entry outside
 * 0..num_blocks-1, a length out of range: MHA_ERR_ARGUMENT, nothing written. */
MHA_API int mha_run_paged(mha_handle *handle, const mha_value *x, int num_seqs, int total,
                          const int32_t *cu_seqlens, mha_cache_value *k_pool,
                          mha_cache_value *v_pool, int num_blocks,
                          const int32_t *block_tables, int32_t *cache_lens, mha_value *y);

/* Cross-attention layers (MHA_CROSS 1): queries from x, keys and values from context
 * [batch, kv_seq_len, MHA_KV_DIM] values (kv_seq_len: MHA_KV_SEQ_LEN, or at most that when
 * MHA_SYMBOLIC_KV_SEQ_LEN). kv_lens
 * [batch] int32 (each in 0..kv_seq_len: context rows past it are padding) when the layer has
 * key padding (MHA_KEY_PADDING 1), else NULL. */
MHA_API int mha_run_cross(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                          const mha_value *context, int kv_seq_len, const int32_t *kv_lens,
                          mha_value *y);

/* Packed calls (MHA_PACKED 1: artifacts built for any length, seq_len=None, of prefill
 * layers): the tokens of n_seqs sequences one after the other, no padding. x holds
 * cu_seqlens[n_seqs] rows of MHA_D_MODEL values; sequence i is rows cu_seqlens[i] ..
 * cu_seqlens[i+1] - 1 and attends as if run alone (its positions count from its first
 * token). cu_seqlens: n_seqs + 1 int32 offsets, 0 first, never decreasing (an empty
 * sequence is allowed), each sequence at most MHA_SEQ_LEN tokens, at most MHA_MAX_TOKENS in
 * all. Cross-attention (MHA_CROSS 1): context holds each sequence's context rows one after
 * the other ([cu_seqlens_k[n_seqs], MHA_KV_DIM] values; each at most MHA_KV_SEQ_LEN, and at
 * least 1 where the sequence has tokens), cu_seqlens_k their offsets; otherwise both NULL.
 * y: cu_seqlens[n_seqs] rows of MHA_OUT_D_MODEL values, in the same order. Bad offsets:
 * MHA_ERR_ARGUMENT; too many tokens: MHA_ERR_SHAPE; nothing is written then. */
MHA_API int mha_run_varlen(mha_handle *handle, const mha_value *x, const int32_t *cu_seqlens,
                           int n_seqs, const mha_value *context, const int32_t *cu_seqlens_k,
                           mha_value *y);

/* Free the handle (NULL is allowed). */
MHA_API void mha_destroy(mha_handle *handle);

/* This thread's last mha_create/mha_run: a message saying what went wrong and how to fix it
 * ("" after a success; valid until this thread's next call), and its status code. */
MHA_API const char *mha_last_error(void);
MHA_API int mha_last_error_code(void);

/* "MHA_OK", "MHA_ERR_SHAPE", ... for a status code. */
MHA_API const char *mha_status_name(int status);

/* The kernels a run launches, in order: how many, and each one's name ("qkv_projection",
 * "attention", "output_projection", ...; NULL out of range). */
MHA_API int mha_num_kernels(void);
MHA_API const char *mha_kernel_name(int kernel);
{device_api}
#ifdef __cplusplus
}}
#endif

#endif  /* MHA_H_ */
"""


# mha.h's paragraphs on where the data lives, per device.
CPU_MEMORY_DOC = """\
 * mha_create checks the directory before it loads anything: manifest.json's format version
 * and content hash against the ones baked into this library, the CPU's features, the size and
 * sha256 of kernel.so and weights.safetensors (the kernels' parameters, safetensors format). It
 * never crashes on a missing, truncated or corrupted file: it returns NULL with a status and a
 * message.
 *
 * Alignment: x and y may have any alignment; buffers that are not 64-byte aligned are copied
 * through aligned scratch buffers (pass 64-byte aligned ones, e.g. from aligned_alloc(64, n),
 * to save the copies).
 *
 * Threads: a handle owns scratch buffers shared by its runs, so mha_run locks a mutex per
 * handle: calls on one handle from several threads are safe but run one after another; use one
 * handle per thread to run in parallel. mha_create and mha_destroy must not race with other
 * calls on the same handle. mha_last_error() and mha_last_error_code() are per thread. Each run
 * uses TVM's thread pool: TVM_NUM_THREADS threads (mha_create sets it, if unset, to the number
 * of CPUs this process may use; read once, when TVM starts its pool).
"""
CUDA_MEMORY_DOC = """\
 * mha_create opens the GPU (MHA_CUDA_DEVICE, default 0: its primary context, which the CUDA
 * runtime shares, so cudaMalloc'ed and PyTorch tensors' pointers work) and checks the directory
 * before it loads anything: manifest.json's format version and content hash against the ones
 * baked into this library, the size and sha256 of kernels.fatbin and weights.safetensors (the
 * parameters, copied to device memory), the GPU's compute capability and shared memory. A
 * machine without the driver or a GPU gets MHA_ERR_DEVICE, never a crash.
 *
 * Memory: mha_run (and mha_run_padded / mha_run_cross) take host arrays: x is copied to the
 * device, the kernels run on the legacy default stream, y is copied back (the call waits).
 * mha_run_device takes device arrays and a stream (cudaStream_t / CUstream, NULL: the legacy
 * default stream) and only launches: no copy, no wait. Errors of a kernel itself show at the
 * next synchronisation (cudaStreamSynchronize).
 *
 * Threads: a handle owns device buffers shared by its runs (weights, the temporaries), so
 * calls on one handle are serialised by a mutex (for mha_run_device: while launching; two
 * streams sharing a handle would still share its temporaries: use a handle per stream).
 * mha_last_error() and mha_last_error_code() are per thread.
"""
CUDA_API = """
/* CUDA: y = layer(x) with x, y device pointers ([batch, seq_len, MHA_D_MODEL] and
 * [batch, seq_len, MHA_OUT_D_MODEL] values, MHA_BATCH x MHA_SEQ_LEN), launched on `stream`
 * (a cudaStream_t / CUstream; NULL: the legacy default stream); returns once launched.
 * Layers with key padding or a context run through their host entry points. */
#define MHA_CUDA 1
MHA_API int mha_run_device(mha_handle *handle, const mha_value *x, mha_value *y, void *stream);

/* CUDA, for profiling: launch only kernel `kernel` (0..mha_num_kernels()-1) of a run with
 * the same arguments as mha_run_device (its inputs are what the earlier kernels of the last
 * run left in the handle's buffers). */
MHA_API int mha_run_kernel_device(mha_handle *handle, int kernel, const mha_value *x,
                                  mha_value *y, void *stream);
"""


def _cpu_features(manifest):
    """(x86 (feature, leaf, subleaf, register, bit, XCR0 state), aarch64 (feature, AT_HWCAP
    bit), SVE vector bits or 0, features not checkable) of the features the kernels need:
    what mha_create checks."""
    t = manifest["target"]
    feats = sorted(t.get("features") or [])
    table = FEATURES_OF_ARCH.get(t["arch"], {})
    probed = [(f, *table[f].probe) for f in feats if f in table]
    x86 = probed if t["arch"] == "x86_64" else []
    arm = probed if t["arch"] == "aarch64" else []
    sve_bits = int(t.get("vector_bits") or 0) if any(p[0] == "sve" for p in arm) else 0
    checked = {p[0] for p in probed}
    return x86, arm, sve_bits, [f for f in feats if f not in checked]


def _macro_list(name, args, entries) -> str:
    """#define NAME(X) X(a) X(b) ..., one entry a line."""
    lines = [f"#define {name}({args})"] + [f"  {e}" for e in entries]
    return " \\\n".join(lines) + "\n"


def _cpu_check(manifest) -> str:
    """mha_config.h's lists of the CPU features mha_create checks (x86: CPUID bits and the
    XCR0 state; aarch64: AT_HWCAP bits and the SVE vector length)."""
    x86, arm, sve_bits, unchecked = _cpu_features(manifest)
    out = "// The CPU features the kernels need (checked at mha_create)"
    out += f"; not checkable here: {' '.join(unchecked)}.\n" if unchecked else ".\n"
    out += _macro_list("MHA_X86_FEATURES", "X", [
        f"X({_c_string(f)}, {leaf:#x}, {sub}, {reg}, {bit}, {state:#x})"
        for f, leaf, sub, reg, bit, state in x86])
    out += _macro_list("MHA_AARCH64_HWCAPS", "X",
                       [f"X({_c_string(f)}, {bit})" for f, bit in arm])
    return out + f"#define MHA_SVE_VECTOR_BITS {sve_bits}\n"


def _checked(manifest) -> list:
    """(name, how) of the files mha_create checks (CHECKED_FILES, for the artifact's device)."""
    device = manifest["target"].get("device", "cpu")
    return [(KERNEL_FILES.get(device, name) if name == "kernel.so" else name, how)
            for name, how in CHECKED_FILES]


def _file_table(directory: Path, manifest) -> list:
    """(name, size, sha256 or None) of the files mha_create checks."""
    table = []
    for name, how in _checked(manifest):
        if name not in manifest.get("files", {}):
            raise ArtifactError(f"the C API needs {name}, which the manifest does not list")
        digest = manifest["files"][name] if how == "sha256" else None
        table.append((name, (directory / name).stat().st_size, digest))
    return table


def generate_config(manifest, files: list) -> str:
    """mha_config.h: the tables of one artifact that mha_runtime.cc reads (data only).
    `files`: (name, size, sha256 or None) of the files mha_create checks, the params file
    among them."""
    lay = _layout(manifest)
    prog = manifest["program"]
    device = manifest["target"].get("device", "cpu")
    if device not in _DEVICES:
        raise ArtifactError(f"the C API runs kernels on {', '.join(_DEVICES)} only; this "
                            f"artifact's target device is {device!r}")
    params = {p["name"]: p for p in manifest.get("params") or []}
    sizes = {name: size for name, size, _ in files}
    buffers = []
    for b in prog["buffers"]:
        code, bits = _DLPACK[b["dtype"]]
        nbytes = bits // 8
        for dim in b["shape"]:
            nbytes *= dim
        offset = -1
        if b["role"] == "param":
            p = params.get(b["name"])
            if p is None or p["nbytes"] != nbytes:
                raise ArtifactError(f"param {b['name']!r} is missing from {TENSOR_FILE} or "
                                    "has another size; save the module with weights bound")
            offset = p["offset"]
            if offset < 0 or offset + nbytes > sizes[TENSOR_FILE]:
                raise ArtifactError(f"param {b['name']!r} lies outside {TENSOR_FILE}; rebuild "
                                    "the module")
        if len(b["shape"]) > _MAX_DIMS:
            raise ArtifactError(f"buffer {b['name']} has more than {_MAX_DIMS} dimensions")
        shape = ", ".join(str(int(v)) for v in b["shape"])
        [(axis, kind)] = (b.get("symbolic") or {"-1": "fixed"}).items()
        buffers.append(f"    {{{_c_string(b['name'])}, {_ROLES[b['role']]}, {code}, {bits}, "
                       f"{len(b['shape'])}, {{{shape}}}, {nbytes}, {offset}, {int(axis)}, "
                       f"{_SYMBOLIC_DIMS[kind]}}},")
    kernels, args = [], []
    index = {**lay["index"], "batch": "kArgBatch", "seq": "kArgSeq", "kv_seq": "kArgKvSeq"}
    packed = _packed(manifest)
    listed = prog["kernels"] + packed.get("kernels", [])
    for k, kern in enumerate(listed):
        args.append(f"constexpr int kArgs{k}[] = "
                    f"{{{', '.join(str(index[a]) for a in kern['args'])}}};")
    kernels = [f"    {{{_c_string(kern['name'])}, {len(kern['args'])}, kArgs{k}}},"
               for k, kern in enumerate(listed)]
    packed_kernels = kernels[len(prog["kernels"]):] or ["    {nullptr, 0, nullptr},"]
    kernels = kernels[:len(prog["kernels"])]
    file_rows = [f"    {{{_c_string(name)}, {size}, "
                 f"{_c_string(digest) if digest else 'nullptr'}}},"
                 for name, size, digest in files]
    names = [name for name, _, _ in files]
    t = manifest["target"]
    device_tables = _launch_tables(manifest, lay["index"], names) if device == "cuda" else [
        "constexpr int kNumLaunches = 0;", "constexpr LaunchSpec kLaunches[1] = {};"]
    out = [f"// {CONFIG} -- the tables of one artifact for {SOURCE} (generated by mhagen "
           f"{manifest.get('mhagen_version')} from manifest.json; data only, do not edit).",
           f"// Layer: {_layer_summary(manifest)}; target {t['name']} ({t['arch']}, device "
           f"{device}).",
           "#ifndef MHA_CONFIG_H_", "#define MHA_CONFIG_H_", "",
           f"#define MHA_DEVICE_CUDA {int(device == 'cuda')}", "",
           "#include <dlpack/dlpack.h>", "", "#include <cstdint>", "",
           '#include "mha.h"', '#include "mha_runtime.h"', "",
           "// mha.h's status codes (mhagen.artifact.capi.STATUS), for mha_status_name.",
           _macro_list("MHA_STATUS_LIST", "X", [f"X({name})" for name, _, _ in STATUS]),
           _cpu_check(manifest),
           "namespace mha {", "namespace config {", "",
           f"constexpr long kFormatVersion = {int(manifest['version'])};",
           f"constexpr const char *kFormat = {_c_string(manifest['format'])};",
           f"constexpr const char *kContentHash = {_c_string(manifest['content_hash'])};"]
    for name, value in (("kBatch", lay["batch"]), ("kSeqLen", lay["seq"]),
                        ("kDModel", lay["d_in"]), ("kOutDModel", lay["d_out"]),
                        ("kRows", lay["rows"]), ("kOutCols", lay["out_cols"])):
        out.append(f"constexpr int64_t {name} = {value};")
    sym = prog.get("symbolic") or {}
    out += ["// symbolic lengths: calls may pass any batch / seq_len up to kBatch / kSeqLen",
            f"constexpr bool kSymbolicBatch = {'true' if sym.get('batch') else 'false'};",
            f"constexpr bool kSymbolicSeq = {'true' if sym.get('seq') else 'false'};",
            f"constexpr bool kSymbolicKvSeq = {'true' if sym.get('kv_seq') else 'false'};",
            f"constexpr int64_t kRowTile = {int(sym.get('row_tile', 1))};"]
    out += [f"constexpr int kInputIndex = {lay['input']};",
            f"constexpr int kOutputIndex = {lay['output']};",
            "// per-call lengths: kLengthsKind 0 none, 1 key lengths (mha_run_padded), 2 cached",
            "// tokens (mha_run_cached, with the K/V cache buffers of role kState)",
            f"constexpr int kLengthsIndex = {lay['lengths']};",
            f"constexpr int kLengthsKind = {lay['lengths_kind']};",
            f"constexpr int kKCacheIndex = {lay['k_cache']};",
            f"constexpr int kVCacheIndex = {lay['v_cache']};",
            f"constexpr int64_t kMaxLen = {lay['max_len']};",
            "// packed decoding (rows of their own token counts: the offsets' buffer, -1:",
            "// none) and a paged cache (the block tables' buffer; tokens a block; a table's",
            "// entries per sequence)",
            f"constexpr int kCuSeqlensIndex = {lay['cu_seqlens']};",
            f"constexpr int kBlockTablesIndex = {lay['block_tables']};",
            f"constexpr int64_t kBlockSize = {lay['block_size']};",
            f"constexpr int64_t kMaxBlocks = {lay['max_blocks']};",
            "// cross-attention: the context input [batch * kKvSeqLen, kKvDim] (-1: none)",
            f"constexpr int kContextIndex = {lay['context']};",
            f"constexpr int64_t kKvSeqLen = {lay['kv_seq']};",
            f"constexpr int64_t kKvDim = {lay['kv_dim']};",
            f"constexpr DLDeviceType kDeviceType = {_DEVICES[device]};",
            "constexpr int kSveVectorBits = MHA_SVE_VECTOR_BITS;", "",
            f"constexpr int kNumBuffers = {len(buffers)};",
            "constexpr BufferSpec kBuffers[kNumBuffers] = {", *buffers, "};", "", *args,
            f"constexpr int kNumKernels = {len(kernels)};",
            "constexpr KernelSpec kKernels[kNumKernels] = {", *kernels, "};", "",
            "// packed calls (mha_run_varlen; 0 kernels: none): their kernels in order, the",
            "// query tiles of their tile table, its buffer and the tokens' positions' (-1:",
            "// none)",
            f"constexpr int kNumPackedKernels = {len(packed.get('kernels', []))};",
            f"constexpr KernelSpec kPackedKernels[{len(packed_kernels)}] = {{",
            *packed_kernels, "};",
            f"constexpr int64_t kPackedQTile = {int(packed.get('q_tile', 1))};",
            f"constexpr int kTilesIndex = {lay['index'].get('tiles', -1) if packed else -1};",
            "constexpr int kPositionsIndex = "
            f"{lay['index'].get('positions', -1) if packed else -1};", "",
            "// The files mha_create checks: size, and sha256 unless nullptr (never read).",
            f"constexpr int kNumFiles = {len(file_rows)};",
            "constexpr FileSpec kFiles[kNumFiles] = {", *file_rows, "};",
            f"constexpr int kParamsFile = {names.index(TENSOR_FILE)};", "",
            *device_tables, "",
            "}  // namespace config", "}  // namespace mha", "", "#endif  // MHA_CONFIG_H_", ""]
    return "\n".join(out)


def _launch_tables(manifest, index: dict, file_names: list) -> list:
    """mha_config.h's CUDA tables: the architecture, the fatbin's file index, and the GPU
    kernels to launch in order (manifest device_code.launches)."""
    code = manifest.get("device_code") or {}
    arch = str(code.get("arch", ""))
    launches = code.get("launches") or []
    if not arch.startswith("sm_") or not launches:
        raise ArtifactError("the manifest has no device_code (arch, launches); rebuild the "
                            "module")
    rows, args = [], []
    for k, la in enumerate(launches):
        if len(la["args"]) > _MAX_LAUNCH_ARGS:
            raise ArtifactError(f"GPU kernel {la['entry']} takes more than {_MAX_LAUNCH_ARGS} "
                                "buffers")
        args.append(f"constexpr int kLaunchArgs{k}[] = "
                    f"{{{', '.join(str(index[a]) for a in la['args'])}}};")
        grid, block = (", ".join(str(int(v)) for v in la[w]) for w in ("grid", "block"))
        rows.append(f"    {{{_c_string(la['entry'])}, {{{grid}}}, {{{block}}}, "
                    f"{int(la['dynamic_shared'])}, {int(la.get('static_shared', 0))}, "
                    f"{len(la['args'])}, kLaunchArgs{k}}},")
    device_file = KERNEL_FILES["cuda"]
    return [f"// CUDA: kernels for {arch} (runs on compute capability >= "
            f"{arch[3:-1]}.{arch[-1]}), launched in this order",
            f"constexpr int kComputeCapability = {int(arch[3:])};",
            f"constexpr int kDeviceFileIndex = {file_names.index(device_file)};   "
            f"// {device_file}",
            *args, f"constexpr int kNumLaunches = {len(rows)};",
            "constexpr LaunchSpec kLaunches[kNumLaunches] = {", *rows, "};"]


def compile_commands(toolchain: Toolchain, device: str = "cpu") -> list:
    """The compiler commands that build the C API from mha_runtime.cc and the generated headers
    (run in the artifact directory, in order). CPU: the runtime library (MHA_IMPL, linked with
    TVM's runtime in lib/), then libmha.so, the loader (MHA_LOADER, no TVM; it reads
    mha_libraries.h, written between the two). CUDA artifacts link no TVM: libmha.so opens
    the CUDA driver at run time (dlopen)."""
    common = [*shlex.split(toolchain.cxx), "-std=c++17", "-O2", "-fPIC", "-shared",
              "-fvisibility=hidden", "-I.", f"-I{toolchain.include_dir}", SOURCE]
    if device == "cuda":
        return [[*common, "-o", LIBRARY, "-ldl", "-Wl,-soname," + LIBRARY]]
    runtime = Path(RUNTIME_LIBRARY).name
    return [[*common, "-DMHA_IMPL=1", "-o", RUNTIME_LIBRARY, f"-L{LIB_DIR}",
             "-Wl,--no-as-needed", "-ltvm_ffi", "-ltvm_runtime", "-Wl,-rpath,$ORIGIN",
             "-Wl,-soname," + runtime],
            [*common, "-DMHA_LOADER=1", "-o", LIBRARY, "-ldl", "-Wl,-soname," + LIBRARY]]


def generate_libraries_header(directory: Path) -> str:
    """mha_libraries.h: what libmha.so (the loader) checks before it opens the runtime: TVM's
    libraries and the runtime library in lib/, each with its size and sha256."""
    names = [*(f"{LIB_DIR}/{n}" for n in RUNTIME_LIBS), RUNTIME_LIBRARY]
    rows = [f"    {{{_c_string(n)}, {(directory / n).stat().st_size}, "
            f"{_c_string(sha256_file(directory / n))}}}," for n in names]
    return "\n".join([
        f"// {LIBRARIES_HEADER} -- the libraries libmha.so checks (size, sha256) before it opens "
        f"{RUNTIME_LIBRARY}", "// (generated by mhagen; data only, do not edit).",
        "#ifndef MHA_LIBRARIES_H_", "#define MHA_LIBRARIES_H_", "",
        '#include "mha_runtime.h"', "", "namespace mha {", "namespace config {", "",
        f"constexpr const char *kRuntimeLibrary = {_c_string(RUNTIME_LIBRARY)};",
        f"constexpr int kNumLibraries = {len(rows)};",
        "constexpr FileSpec kLibraries[kNumLibraries] = {", *rows, "};", "",
        "}  // namespace config", "}  // namespace mha", "", "#endif  // MHA_LIBRARIES_H_", ""])


def write_sources(directory, manifest) -> list:
    """Write the C API's sources into `directory`: mha.h, mha_config.h (generated) and the
    runtime (copied); returns their names. Raises ArtifactError if the C API cannot run this
    artifact."""
    directory = Path(directory)
    if not manifest.get("params"):
        raise ArtifactError("the C API needs the kernels' parameters: bind weights before saving")
    config = generate_config(manifest, _file_table(directory, manifest))
    (directory / HEADER).write_text(generate_header(manifest))
    (directory / CONFIG).write_text(config)
    for name in RUNTIME_SOURCES:
        shutil.copyfile(RUNTIME_DIR / name, directory / name)
    return [HEADER, CONFIG, *RUNTIME_SOURCES]


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_symlink():
        dst.unlink()
    if not (dst.exists() and dst.stat().st_size == src.stat().st_size
            and sha256_file(dst) == sha256_file(src)):
        shutil.copy(src, dst)


def _link(src: Path, dst: Path) -> None:
    """dst becomes a symbolic link to src (absolute), replacing a file or link."""
    if dst.is_symlink() and Path(os.readlink(dst)) == src:
        return
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    os.symlink(src, dst)


def place_runtime_libs(libdir: Path, libs, self_contained: bool) -> bool:
    """TVM's runtime libraries in `libdir`: links to the shared copy in mhagen's cache
    (build_cache.shared_runtime_libs), or copies when `self_contained` or the cache cannot be
    written. Returns True when they are links."""
    shared = None if self_contained else build_cache.shared_runtime_libs(libs)
    if shared is None or None in shared:
        for src in libs:
            _copy_if_changed(Path(src), libdir / Path(src).name)
        return False
    for src, target in zip(libs, shared):
        _link(target, libdir / Path(src).name)
    return True


def write_c_api(directory, manifest, toolchain: Toolchain, *,
                self_contained: bool = False) -> dict:
    """Write mha.h, mha_config.h and the runtime sources into `directory`, put TVM's runtime
    libraries into directory/lib (links to mhagen's cache, or copies when `self_contained`)
    and compile libmha.so -- or copy it from mhagen's cache when these very sources were
    compiled before (build_cache). The manifest must carry its content_hash and file table.
    Returns the manifest's "c_api" section; raises ArtifactError if the C API cannot run this
    artifact or the compiler fails."""
    directory = Path(directory)
    sources = write_sources(directory, manifest)
    device = manifest["target"].get("device", "cpu")
    libdir = directory / LIB_DIR
    shared = False
    if device == "cpu":
        libdir.mkdir(exist_ok=True)
        shared = place_runtime_libs(libdir, toolchain.runtime_libs, self_contained)
    cmds = compile_commands(toolchain, device)

    def build():
        for i, cmd in enumerate(cmds):
            if i == 1:   # the loader checks what the first command built
                (directory / LIBRARIES_HEADER).write_text(generate_libraries_header(directory))
            try:
                r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True,
                                   timeout=300)
            except (OSError, subprocess.TimeoutExpired) as err:
                raise ArtifactError(f"compiling the C API failed: {err}") from None
            if r.returncode != 0:
                raise ArtifactError(f"compiling the C API ({' '.join(cmd)}) failed:\n"
                                    f"{r.stderr[-4000:]}")
    outputs = [LIBRARY] if device == "cuda" else [RUNTIME_LIBRARY, LIBRARIES_HEADER, LIBRARY]
    key = build_cache.build_key(directory, sources, cmds, toolchain)
    cached = build_cache.cached_build(directory, outputs, key, build)
    if device != "cuda":
        sources.append(LIBRARIES_HEADER)
    version = build_cache.compiler_identity(toolchain.cxx).split("\n")[1:2]
    runtime_libs = [f"{LIB_DIR}/{n}" for n in RUNTIME_LIBS] + [RUNTIME_LIBRARY] \
        if device == "cpu" else []
    names = [*sources, LIBRARY] + [n for n in runtime_libs if (directory / n).exists()]
    section = {"header": HEADER, "library": LIBRARY, "source": SOURCE, "config": CONFIG,
               "runtime_libs": runtime_libs,
               "compiler": version[0] if version and version[0] else toolchain.cxx,
               "build_command": " && ".join(" ".join(shlex.quote(c) for c in cmd)
                                            for cmd in cmds),
               "checks": {name: how for name, how in _checked(manifest)
                          if name in manifest.get("files", {})},
               "files": {n: build_cache.file_digest(directory / n) for n in names},
               "cache_key": key, "cached": cached}
    if shared:   # where lib/'s links point (a self-contained artifact has copies)
        section["shared_runtime"] = {f"{LIB_DIR}/{n}": os.readlink(libdir / n)
                                     for n in RUNTIME_LIBS}
    return section


def remove_c_api(directory) -> None:
    """Remove the C API files left by an earlier save (the runtime in lib/ stays)."""
    for name in GENERATED:
        p = Path(directory) / name
        if p.exists():
            p.unlink()
