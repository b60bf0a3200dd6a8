"""A saved CUDA artifact called from Python: its own C API (libmha.so) through ctypes.

mhagen.load returns this for GPU artifacts. No TVM is involved (the pip TVM has no CUDA
runtime): libmha.so opens the CUDA driver and launches kernels.fatbin, as it does for a C
application. `module(x)` takes and returns numpy arrays (host memory: copied in and out);
`module.run_device(x_ptr, y_ptr, stream)` takes device pointers (a torch CUDA tensor's
data_ptr(), its stream's cuda_stream) and only launches.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from mhagen.dtypes import numpy_dtype, to_storage
from mhagen.errors import ArtifactError, InputError, TargetError
from mhagen.inputs import argument
from mhagen.ir.graph import Graph
from mhagen.call_checks import check_lengths
from mhagen.runtime import fresh_path

MHA_ERR_DEVICE = 11      # mhagen.artifact.capi.STATUS


class CudaArtifactModule:
    """A CUDA artifact loaded through its libmha.so; see the module docstring."""

    def __init__(self, path: Path, manifest: dict, graph: Graph, target):
        self.path, self.graph, self.target = Path(path), graph, target
        shapes = manifest["shapes"]
        self.batch, self.seq_len = shapes["batch"], shapes["seq_len"]
        self.in_shape, self.out_shape = tuple(shapes["input"]), tuple(shapes["output"])
        self.dtype = numpy_dtype(graph.dtype)
        library = self.path / "libmha.so"
        if not library.is_file():
            why = (manifest.get("c_api") or {}).get("skipped", "libmha.so is missing")
            raise ArtifactError(f"{self.path}: a CUDA artifact runs through its C API, and it "
                                f"has none ({why}); save it again where g++ is installed")
        try:
            lib = ctypes.CDLL(str(fresh_path(library)))   # the file there now
        except OSError as err:
            raise ArtifactError(f"{library} does not load ({err}); rebuild the artifact") \
                from None
        lib.mha_create.restype = ctypes.c_void_p
        lib.mha_create.argtypes = [ctypes.c_char_p]
        lib.mha_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.c_void_p]
        lib.mha_run_padded.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.mha_run_device.argtypes = [ctypes.c_void_p] * 4
        lib.mha_kernel_name.restype = ctypes.c_char_p
        lib.mha_last_error.restype = ctypes.c_char_p
        lib.mha_destroy.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._lock = threading.Lock()
        self._handle = lib.mha_create(str(self.path).encode())
        if not self._handle:
            message = lib.mha_last_error().decode()
            error = TargetError if lib.mha_last_error_code() == MHA_ERR_DEVICE else ArtifactError
            raise error(message)
        self.kernels = [lib.mha_kernel_name(k).decode() for k in range(lib.mha_num_kernels())]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise ArtifactError(f"{what}: {self._lib.mha_last_error().decode()}")

    def __call__(self, x, *, kv_lens=None) -> np.ndarray:
        """y = layer(x) for a numpy x of shape in_shape (the layer's dtype, or float32 for a
        half-precision layer: rounded on the way in, and float32 comes back)."""
        if self._handle is None:
            raise ArtifactError("this module was closed")
        storage = numpy_dtype(self.graph.dtype)
        a = argument(x, "x", dtype=(storage, np.float32), expects=f"of shape {self.in_shape}")
        if a.shape != self.in_shape:
            raise InputError(f"x has shape {a.shape}; this artifact runs {self.in_shape} "
                             "(build another one for other shapes)")
        returns = np.float32 if self.dtype != np.float32 and a.dtype == np.float32 else \
            self.dtype
        a = np.ascontiguousarray(to_storage("x", a, self.graph.dtype))
        y = np.empty(self.out_shape, self.dtype)
        lens = check_lengths(self.graph, kv_lens, self.batch, self.seq_len)
        with self._lock:
            if lens is not None:
                lens = np.ascontiguousarray(lens, np.int32)
                self._check(self._lib.mha_run_padded(self._handle, a.ctypes.data, self.batch,
                                                     self.seq_len, lens.ctypes.data,
                                                     y.ctypes.data), "mha_run_padded")
            else:
                self._check(self._lib.mha_run(self._handle, a.ctypes.data, self.batch,
                                              self.seq_len, y.ctypes.data), "mha_run")
        return y.astype(returns, copy=False)

    def run_device(self, x_ptr: int, y_ptr: int, stream: int = 0) -> None:
        """Launch the layer on device arrays x, y (pointers to in_shape / out_shape values of
        the layer's dtype) on `stream` (0: the legacy default stream); returns at once."""
        if self._handle is None:
            raise ArtifactError("this module was closed")
        with self._lock:
            self._check(self._lib.mha_run_device(self._handle, x_ptr, y_ptr, stream or None),
                        "mha_run_device")

    def close(self) -> None:
        """Free the device memory now (also done when the module is collected)."""
        if getattr(self, "_handle", None):
            self._lib.mha_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    def __repr__(self):
        return (f"<CUDA artifact {self.path.name}: {self.graph.name} {self.in_shape} -> "
                f"{self.out_shape} for {self.target.name}, kernels {', '.join(self.kernels)}>")
