"""The TVM runtime without the compiler: threads, kernel libraries, tensors.

Only tvm-ffi and TVM's runtime library (libtvm_runtime.so, loaded with ctypes) are used here,
never `import tvm`: a saved artifact loads and runs without TVM's compiler stack, as the C API
does. The runtime library is found in the installed `tvm` package (found, not imported) or at
$MHAGEN_TVM_RUNTIME.

TVM sizes its thread pool once, from TVM_NUM_THREADS, else from half the logical CPUs
(it assumes hyper-threading: on a 2-core machine that is 1 thread). mhagen sets
TVM_NUM_THREADS to the usable cores before TVM starts, unless the user set it.
"""
from __future__ import annotations

import ctypes
import functools
import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np

from mhagen.checks import positive_int
from mhagen.dtypes import numpy_dtype
from mhagen.errors import ArtifactError
from mhagen.host import host_cores


def prepare_tvm_threads() -> None:
    """Call before TVM's thread pool starts (mhagen does, on its first use of TVM)."""
    if "TVM_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(host_cores())


def runtime_library() -> Path:
    """The path of libtvm_runtime.so: $MHAGEN_TVM_RUNTIME, else the one the apache-tvm
    distribution installed (found from its metadata: the tvm package is not imported)."""
    if os.environ.get("MHAGEN_TVM_RUNTIME"):
        return Path(os.environ["MHAGEN_TVM_RUNTIME"])
    try:
        path = Path(distribution("apache-tvm").locate_file("tvm/lib/libtvm_runtime.so"))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ArtifactError("TVM's runtime library is not installed: pip install apache-tvm, "
                            "or set MHAGEN_TVM_RUNTIME to a libtvm_runtime.so")
    return path


@functools.lru_cache(maxsize=None)
def ffi():
    """tvm_ffi, with TVM's runtime library loaded (its functions registered)."""
    prepare_tvm_threads()
    import tvm_ffi
    lib = runtime_library()
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise ArtifactError(f"cannot load TVM's runtime {lib}: {err}") from None
    return tvm_ffi


_LOADED: dict = {}      # real path -> (device, inode) of the file first opened there
_ALIASES: list = []     # the temporary directory of aliases, once made


def fresh_path(path) -> Path:
    """A path under which dlopen opens the file now at `path`.

    dlopen hands back the library already loaded under the same name: a module saved
    again to a directory (a new kernel.so) and loaded again in the same process ran the
    old kernels (another layer's: max error 3.56, silently). A file that is not the one
    first opened from its path gets an alias of its own (a symlink in a temporary
    directory), which dlopen tells apart by its inode."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if _LOADED.setdefault(real, (st.st_dev, st.st_ino)) == (st.st_dev, st.st_ino):
        return Path(path)
    if not _ALIASES:
        import tempfile
        _ALIASES.append(tempfile.TemporaryDirectory(prefix="mhagen-libraries-"))
    alias = Path(_ALIASES[0].name) / f"{st.st_dev}-{st.st_ino}-{Path(real).name}"
    if not alias.is_symlink():
        alias.symlink_to(real)
    return alias


def load_library(path):
    """A compiled kernel library (kernel.so) as a tvm-ffi Module (fresh_path: the file on
    disk now, not one loaded from that path before)."""
    return ffi().load_module(str(fresh_path(path)))


def tensor(array):
    """A TVM tensor sharing a numpy array's memory (DLPack; no copy)."""
    if array.dtype == _BFLOAT16:
        return ffi().from_dlpack(_bfloat16_capsule(array))
    return ffi().from_dlpack(array)


_BFLOAT16 = numpy_dtype("bfloat16")
_DL_BFLOAT = 4          # DLPack's kDLBfloat type code
_DTYPE_OFFSET = 20      # DLTensor: data (8), device (8), ndim (4), then dtype {code, bits, lanes}


def _bfloat16_capsule(array):
    """numpy cannot export ml_dtypes.bfloat16 through DLPack: export the same memory as
    uint16 and relabel the DLTensor's type code bfloat16 (same bits, same size)."""
    capsule = array.view(np.uint16).__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = get(capsule, b"dltensor")
    code = ctypes.c_uint8.from_address(managed + _DTYPE_OFFSET)
    if code.value != 1:    # kDLUInt, as numpy exports uint16
        raise RuntimeError(f"unexpected DLPack type code {code.value} for a uint16 view")
    code.value = _DL_BFLOAT
    return capsule


def set_num_threads(n: int) -> None:
    """Use n worker threads (1 <= n <= TVM_NUM_THREADS) for the following calls."""
    positive_int("threads", n, ValueError)
    ffi().get_global_func("runtime.config_threadpool")(0, n)


def num_threads() -> int:
    return int(ffi().get_global_func("runtime.NumThreads")())
