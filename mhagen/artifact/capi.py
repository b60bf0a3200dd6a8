"""Generate and compile the plain C API of one saved module: DIR/mha.h, DIR/mha_api.cc,
DIR/libmha.so (+ TVM's runtime libraries in DIR/lib).

The generated source bakes in everything the C side needs from the manifest (format version,
content hash, shape, the buffer and kernel tables, param offsets, file sizes and sha256, the
CPU features the kernels need), so the C library needs no JSON parser. The generator is
target-neutral: the compiler and the TVM runtime to link against are parameters (a cross
build passes e.g. cxx="aarch64-linux-gnu-g++" and that architecture's runtime libraries).
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mhagen.artifact.cxx_runtime import BODY, INCLUDES
from mhagen.errors import ArtifactError
from mhagen.artifact.files import sha256_file as _sha256

HEADER = "mha.h"
SOURCE = "mha_api.cc"
LIBRARY = "libmha.so"
LIB_DIR = "lib"
RUNTIME_LIBS = ("libtvm_ffi.so", "libtvm_runtime.so")
GENERATED = (HEADER, SOURCE, LIBRARY)

# Status codes: (name, value, meaning) -- the one table the header's enum is written from.
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
)

# CPU features gcc/clang's __builtin_cpu_supports() knows (x86); others are not checked at run
# time (the manifest still lists them).
_X86_BUILTIN_FEATURES = frozenset(
    "cmov mmx popcnt sse sse2 sse3 ssse3 sse4.1 sse4.2 avx avx2 sse4a fma4 xop fma bmi bmi2 aes "
    "pclmul avx512f avx512vl avx512bw avx512dq avx512cd avx512vbmi avx512ifma avx512vpopcntdq "
    "avx512vbmi2 gfni vpclmulqdq avx512vnni avx512bitalg".split())

_DLPACK = {"float32": ("kDLFloat", 32), "int32": ("kDLInt", 32)}


@dataclass(frozen=True)
class Toolchain:
    """What compiles and links libmha.so: a C++17 compiler, the tvm-ffi headers and TVM's
    runtime libraries for the artifact's architecture."""
    cxx: str
    include_dir: Path
    runtime_libs: tuple          # paths of libtvm_ffi.so, libtvm_runtime.so

    @staticmethod
    def host(cxx: str | None = None) -> "Toolchain | str":
        """This machine's toolchain, or a string saying why there is none."""
        cxx = cxx or os.environ.get("CXX") or "g++"
        if _which(shlex.split(cxx)[0]) is None:
            return f"no C++ compiler ({cxx!r} not found; set CXX)"
        found = find_tvm_runtime()
        if isinstance(found, str):
            return found
        include, libs = found
        return Toolchain(cxx, include, libs)


    @staticmethod
    def cross(arch: str, cxx: str | None = None) -> "Toolchain | str":
        """The cross toolchain for `arch` (e.g. aarch64-linux-gnu-g++ and the aarch64 TVM
        runtime from mhagen's cache, see mhagen.cross), or a string saying why there is none."""
        from mhagen.cross import toolchain
        from mhagen.errors import TargetError
        try:
            return toolchain(arch, cxx)
        except TargetError as err:
            return str(err)


def _which(program):
    return shutil.which(program)


def find_tvm_runtime():
    """(include_dir, (libtvm_ffi.so, libtvm_runtime.so)) of the installed wheels, without
    importing TVM; or a string saying what is missing."""
    paths = {}
    for pkg in ("tvm_ffi", "tvm"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            return f"the {pkg} package is not installed"
        paths[pkg] = Path(list(spec.submodule_search_locations)[0])
    include = paths["tvm_ffi"] / "include"
    libs = (paths["tvm_ffi"] / "lib" / "libtvm_ffi.so", paths["tvm"] / "lib" / "libtvm_runtime.so")
    for p in (include / "tvm" / "ffi" / "extra" / "module.h", *libs):
        if not p.exists():
            return f"TVM runtime file {p} is missing"
    return include, libs


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
    if len(ins) != 1 or len(outs) != 1:
        raise ArtifactError("the C API needs one input and one output buffer; this program has "
                            f"{len(ins)} and {len(outs)}")
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
    if bufs[ins[0]]["dtype"] != "float32" or numel(bufs[ins[0]]) != rows * d_in:
        raise ArtifactError(f"input buffer {bufs[ins[0]]['shape']} is not [batch*seq, d_model]")
    out_cols, rem = divmod(numel(bufs[outs[0]]), rows)
    if bufs[outs[0]]["dtype"] != "float32" or rem or out_cols < d_out:
        raise ArtifactError(f"output buffer {bufs[outs[0]]['shape']} is not [batch*seq, >= "
                            f"{d_out}]")
    return dict(batch=batch, seq=seq, d_in=d_in, d_out=d_out, rows=rows, out_cols=out_cols,
                index=index, input=ins[0], output=outs[0])


def generate_header(manifest) -> str:
    """The C header of one artifact: status codes, shape macros, the four functions."""
    lay = _layout(manifest)
    t = manifest["target"]
    b, s, d, do = lay["batch"], lay["seq"], lay["d_in"], lay["d_out"]
    status = "\n".join(f"  {n} = {v},{' ' * (24 - len(n))}/* {doc} */" for n, v, doc in STATUS)
    return f"""\
/* mha.h -- the C API of one compiled mhagen artifact (generated by mhagen; do not edit).
 *
 * Layer:   {_layer_summary(manifest)}
 * Target:  {t['name']} ({t['arch']}, {t.get('vector_bits', '?')}-bit vectors); the kernels need
 *          {' '.join(t.get('features') or []) or 'no CPU extension'}
 * Built:   mhagen {manifest.get('mhagen_version')}, TVM {manifest.get('tvm_version')}
 * Format:  artifact format version {manifest['version']}, content hash
 *          {manifest['content_hash']}
 *
 * Shapes (float32, row-major, contiguous):
 *   x  input   [MHA_BATCH, MHA_SEQ_LEN, MHA_D_MODEL]     = [{b}, {s}, {d}]  ({b * s * d} floats)
 *   y  output  [MHA_BATCH, MHA_SEQ_LEN, MHA_OUT_D_MODEL] = [{b}, {s}, {do}]  ({b * s * do} floats)
 * The library is compiled for exactly this shape: mha_run refuses any other batch or seq_len
 * with MHA_ERR_SHAPE (build another artifact: mhagen build --batch B --seq-len S ...).
 *
 * Use (three calls; the weights are part of the artifact):
 *   mha_handle *h = mha_create("path/to/artifact");  // NULL on error: mha_last_error()
 *   int rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y); // MHA_OK (0) or an mha_status
 *   mha_destroy(h);
 * Build:  cc app.c -I DIR -L DIR -lmha -Wl,-rpath,DIR   (DIR absolute; libmha.so finds TVM's
 *         runtime libraries in DIR/lib through its own rpath $ORIGIN/lib)
 *
 * mha_create checks the directory before it loads anything: manifest.json's format version
 * and content hash against the ones baked into this library, the CPU's features, and the size
 * and sha256 of kernel.so, params.bin and weights.bin. It never crashes on a missing,
 * truncated or corrupted file: it returns NULL with a status and a message.
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
 */
#ifndef MHA_H_
#define MHA_H_

#ifdef __cplusplus
extern "C" {{
#endif

#if defined(_WIN32)
#define MHA_API __declspec(dllexport)
#else
#define MHA_API __attribute__((visibility("default")))
#endif

#define MHA_FORMAT_VERSION {manifest['version']}
#define MHA_CONTENT_HASH "{manifest['content_hash']}"
#define MHA_BATCH {b}
#define MHA_SEQ_LEN {s}
#define MHA_D_MODEL {d}
#define MHA_OUT_D_MODEL {do}
#define MHA_INPUT_SIZE {b * s * d}   /* floats in x */
#define MHA_OUTPUT_SIZE {b * s * do}  /* floats in y */

typedef enum mha_status {{
{status}
}} mha_status;

/* An opaque handle: the loaded kernels, the parameters and the scratch buffers. */
typedef struct mha_handle mha_handle;

/* Load the artifact in directory artifact_dir (the one this header came from).
 * Returns NULL on error; then mha_last_error_code() says why and mha_last_error() how to fix. */
MHA_API mha_handle *mha_create(const char *artifact_dir);

/* y = layer(x). x: [batch, seq_len, MHA_D_MODEL] floats, y: [batch, seq_len, MHA_OUT_D_MODEL]
 * floats (written; must not overlap x). batch and seq_len must equal MHA_BATCH and MHA_SEQ_LEN.
 * Returns MHA_OK or MHA_ERR_NULL_ARGUMENT, MHA_ERR_SHAPE, MHA_ERR_RUNTIME, MHA_ERR_NO_MEMORY;
 * on error y is unspecified. */
MHA_API int mha_run(mha_handle *handle, const float *x, int batch, int seq_len, float *y);

/* Free the handle (NULL is allowed). */
MHA_API void mha_destroy(mha_handle *handle);

/* This thread's last mha_create/mha_run: a message saying what went wrong and how to fix it
 * ("" after a success; valid until this thread's next call), and its status code. */
MHA_API const char *mha_last_error(void);
MHA_API int mha_last_error_code(void);

/* "MHA_OK", "MHA_ERR_SHAPE", ... for a status code. */
MHA_API const char *mha_status_name(int status);

#ifdef __cplusplus
}}
#endif

#endif  /* MHA_H_ */
"""


# aarch64: Linux's HWCAP bits (asm/hwcap.h) of the features the kernels may need; SVE code
# compiled for fixed-length vectors also needs the SVE vector length (prctl PR_SVE_GET_VL).
_AARCH64_HWCAPS = {"neon": 1 << 1, "sve": 1 << 22}


def _aarch64_checks(t, feats) -> list:
    lines = ["#if defined(__aarch64__) && defined(__linux__)",
             "  unsigned long hwcap = getauxval(AT_HWCAP);"]
    for f in feats:
        lines.append(f'  if (!(hwcap & {_AARCH64_HWCAPS[f]}UL)) missing += " {f}";')
    if "sve" in feats and t.get("vector_bits"):
        vl = int(t["vector_bits"]) // 8
        lines += ["  if (hwcap & (1UL << 22)) {",
                  "    int vl = prctl(51 /* PR_SVE_GET_VL */, 0, 0, 0, 0);",
                  f"    if (vl >= 0 && (vl & 0xffff) < {vl})",
                  f'      missing += " sve with {vl * 8}-bit vectors (this CPU\'s are " + '
                  'std::to_string((vl & 0xffff) * 8) + "-bit)";',
                  "  }"]
    lines.append("#endif")
    return lines


def _cpu_check(manifest) -> str:
    t = manifest["target"]
    feats = sorted(t.get("features") or [])
    if t["arch"] == "x86_64":
        checked = [f for f in feats if f in _X86_BUILTIN_FEATURES]
    elif t["arch"] == "aarch64":
        checked = [f for f in feats if f in _AARCH64_HWCAPS]
    else:
        checked = []
    unchecked = [f for f in feats if f not in checked]
    lines = ["// The CPU features the kernels need (checked at mha_create)."]
    if unchecked:
        lines.append(f"// Not checkable here: {' '.join(unchecked)}.")
    if checked and t["arch"] == "aarch64":
        lines += ["#if defined(__aarch64__) && defined(__linux__)", "#include <sys/auxv.h>",
                  "#include <sys/prctl.h>", "#endif"]
    lines.append("std::string missing_cpu_features() {")
    lines.append("  std::string missing;")
    if checked and t["arch"] == "aarch64":
        lines += _aarch64_checks(t, checked)
    elif checked:
        lines.append("#if defined(__x86_64__) && defined(__GNUC__)")
        lines.append("  __builtin_cpu_init();")
        for f in checked:
            lines.append(f'  if (!__builtin_cpu_supports("{f}")) missing += " {f}";')
        lines.append("#endif")
    lines.append("  return missing;")
    lines.append("}")
    return "\n".join(lines)


def generate_source(manifest, files: dict) -> str:
    """The C++ source of libmha.so. `files`: name -> (size, sha256) of the files mha_create
    verifies (kernel.so, params.bin, weights.bin)."""
    lay = _layout(manifest)
    prog = manifest["program"]
    params = {p["name"]: p for p in manifest.get("params") or []}
    out = [f"// {SOURCE} -- generated by mhagen {manifest.get('mhagen_version')} for "
           f"{_layer_summary(manifest)}",
           f"// on {manifest['target']['name']}; do not edit (mhagen regenerates it on save).",
           f'#include "{HEADER}"', INCLUDES]
    out.append(f"constexpr long kFormatVersion = {int(manifest['version'])};")
    out.append(f"constexpr const char *kFormat = {_c_string(manifest['format'])};")
    out.append(f"constexpr const char *kContentHash = {_c_string(manifest['content_hash'])};")
    for name, value in (("kBatch", lay["batch"]), ("kSeqLen", lay["seq"]),
                        ("kDModel", lay["d_in"]), ("kOutDModel", lay["d_out"]),
                        ("kRows", lay["rows"]), ("kOutCols", lay["out_cols"]),
                        ("kInputIndex", lay["input"]), ("kOutputIndex", lay["output"])):
        out.append(f"constexpr int64_t {name} = {value};")
    out.append(f"constexpr int kNumBuffers = {len(prog['buffers'])};")
    out.append("const BufferSpec kBuffers[kNumBuffers] = {")
    roles = {"input": "kInput", "param": "kParam", "temp": "kTemp", "output": "kOutput"}
    for b in prog["buffers"]:
        code, bits = _DLPACK[b["dtype"]]
        nbytes = bits // 8
        for dim in b["shape"]:
            nbytes *= dim
        offset = -1
        if b["role"] == "param":
            p = params.get(b["name"])
            if p is None or p["nbytes"] != nbytes:
                raise ArtifactError(f"param {b['name']!r} is missing from params.bin or has "
                                    "another size; save the module with weights bound")
            offset = p["offset"]
        if len(b["shape"]) > 8:
            raise ArtifactError(f"buffer {b['name']} has more than 8 dimensions")
        shape = ", ".join(str(int(v)) for v in b["shape"])
        out.append(f"    {{{_c_string(b['name'])}, {roles[b['role']]}, {code}, {bits}, "
                   f"{len(b['shape'])}, {{{shape}}}, {nbytes}, {offset}}},")
    out.append("};")
    for k, kern in enumerate(prog["kernels"]):
        args = ", ".join(str(lay["index"][a]) for a in kern["args"])
        out.append(f"const int kArgs{k}[] = {{{args}}};")
    out.append(f"constexpr int kNumKernels = {len(prog['kernels'])};")
    out.append("const KernelSpec kKernels[kNumKernels] = {")
    for k, kern in enumerate(prog["kernels"]):
        out.append(f"    {{{_c_string(kern['name'])}, {len(kern['args'])}, kArgs{k}}},")
    out.append("};")
    out.append(f"constexpr int kNumFiles = {len(files)};")
    out.append("const FileSpec kFiles[kNumFiles] = {")
    for name, (size, digest) in files.items():
        out.append(f"    {{{_c_string(name)}, {size}, {_c_string(digest)}}},")
    out.append("};")
    names = list(files)
    out.append(f"constexpr int kParamsFile = {names.index('params.bin')};")
    out.append(_cpu_check(manifest))
    out.append(BODY)
    return "\n".join(out)


def compile_command(toolchain: Toolchain, directory: Path) -> list:
    """The compiler command that builds DIR/libmha.so from DIR/mha_api.cc (run in DIR)."""
    return [*shlex.split(toolchain.cxx), "-std=c++17", "-O2", "-fPIC", "-shared",
            "-fvisibility=hidden", "-I.", f"-I{toolchain.include_dir}",
            SOURCE, "-o", LIBRARY, f"-L{LIB_DIR}", "-Wl,--no-as-needed", "-ltvm_ffi",
            "-ltvm_runtime", "-Wl,-rpath,$ORIGIN/" + LIB_DIR, "-Wl,-soname," + LIBRARY]


def write_c_api(directory, manifest, toolchain: Toolchain, *, copy_runtime: bool = True) -> dict:
    """Write mha.h and mha_api.cc into `directory`, copy TVM's runtime libraries into
    directory/lib and compile libmha.so. The manifest must carry its content_hash and file
    table. Returns the manifest's "c_api" section; raises ArtifactError if the compiler fails."""
    directory = Path(directory)
    if not manifest.get("params"):
        raise ArtifactError("the C API needs the kernels' parameters: bind weights before saving")
    files = {}
    for name in ("kernel.so", "params.bin", "weights.bin"):
        if name in manifest.get("files", {}):
            files[name] = ((directory / name).stat().st_size, manifest["files"][name])
    (directory / HEADER).write_text(generate_header(manifest))
    (directory / SOURCE).write_text(generate_source(manifest, files))
    libdir = directory / LIB_DIR
    libdir.mkdir(exist_ok=True)
    if copy_runtime:
        for src in toolchain.runtime_libs:
            dst = libdir / Path(src).name
            if not (dst.exists() and dst.stat().st_size == Path(src).stat().st_size
                    and _sha256(dst) == _sha256(src)):
                shutil.copy(src, dst)
    cmd = compile_command(toolchain, directory)
    try:
        r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ArtifactError(f"compiling the C API failed: {err}") from None
    if r.returncode != 0:
        raise ArtifactError(f"compiling the C API ({' '.join(cmd)}) failed:\n{r.stderr[-4000:]}")
    version = subprocess.run([*shlex.split(toolchain.cxx), "--version"], capture_output=True,
                             text=True).stdout.splitlines()
    names = [HEADER, SOURCE, LIBRARY] + [f"{LIB_DIR}/{n}" for n in RUNTIME_LIBS
                                         if (libdir / n).exists()]
    return {"header": HEADER, "library": LIBRARY, "source": SOURCE,
            "runtime_libs": [f"{LIB_DIR}/{n}" for n in RUNTIME_LIBS],
            "compiler": version[0] if version else toolchain.cxx,
            "build_command": " ".join(shlex.quote(c) for c in cmd),
            "checks": sorted(files), "files": {n: _sha256(directory / n) for n in names}}


def remove_c_api(directory) -> None:
    """Remove generated C API files left by an earlier save (the runtime in lib/ stays)."""
    for name in GENERATED:
        p = Path(directory) / name
        if p.exists():
            p.unlink()
