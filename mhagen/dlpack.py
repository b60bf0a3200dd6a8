"""DLPack arrays read as numpy arrays over the same memory (no copy): a raw DLPack capsule
(`torch.utils.dlpack.to_dlpack(t)`, a C extension's) or any object with `__dlpack__` (JAX,
CuPy, TVM, Paddle ... arrays), for mhagen/inputs.py.

numpy imports CPU memory through DLPack but takes no raw capsule and no bfloat16; so a
capsule's DLTensor is read here first (device, dtype: ctypes over the struct DLPack fixes),
a bfloat16 one is relabelled uint16 (same bits) and viewed as ml_dtypes' bfloat16, and the
capsule is handed to numpy.from_dlpack. No framework is imported.
"""
from __future__ import annotations

import ctypes

import numpy as np

from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError

LEGACY, VERSIONED = b"dltensor", b"dltensor_versioned"
# where the DLTensor starts in the managed struct the capsule points to: DLManagedTensor
# begins with it; DLManagedTensorVersioned has version (8), manager_ctx (8), deleter (8) and
# flags (8) first
_TENSOR_AT = {LEGACY: 0, VERSIONED: 32}
# DLTensor: data (8), device {int32 type, int32 id} (8), ndim (4), dtype {uint8 code, uint8
# bits, uint16 lanes}
_DEVICE_AT, _DTYPE_AT = 8, 20
_UINT, _BFLOAT = 1, 4                     # DLPack's kDLUInt, kDLBfloat type codes
# devices whose memory the CPU reads: kDLCPU, kDLCUDAHost, kDLROCMHost (numpy's list)
HOST_DEVICES = (1, 3, 11)
DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
                14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}

# the C API's capsule functions as functions of their own (setting argtypes on
# ctypes.pythonapi's shared ones would change them for every other user)
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def is_capsule(value) -> bool:
    """value is a Python capsule (a raw DLPack export, or another C extension's pointer)."""
    return type(value).__name__ == "PyCapsule" and type(value).__module__ == "builtins"


def is_dlpack(value) -> bool:
    """value is read through DLPack: a capsule, or an object with __dlpack__."""
    return is_capsule(value) or hasattr(value, "__dlpack__")


def from_dlpack(value, name: str) -> np.ndarray:
    """The numpy array over the memory of `value` (a DLPack capsule or an object with
    __dlpack__), without a copy; InputError (naming the argument `name`) for memory off the
    CPU, a capsule already read, or a dtype numpy has no form of."""
    capsule = value if is_capsule(value) else _exported(value, name)
    kind = _capsule_name(capsule)
    if kind not in _TENSOR_AT:
        read = kind in (b"used_dltensor", b"used_dltensor_versioned")
        raise InputError(f"{name} is a DLPack capsule that was read already (a capsule can be "
                         "read once): pass the array itself, or export it again"
                         if read else f"{name} is a capsule that is no DLPack tensor "
                         f"({(kind or b'unnamed').decode(errors='replace')!r}); pass a numpy "
                         "array, a torch tensor or a DLPack array")
    tensor = _capsule_pointer(capsule, kind) + _TENSOR_AT[kind]
    device = (ctypes.c_int32.from_address(tensor + _DEVICE_AT).value,
              ctypes.c_int32.from_address(tensor + _DEVICE_AT + 4).value)
    if device[0] not in HOST_DEVICES:
        where = DEVICE_NAMES.get(device[0], f"device type {device[0]}")
        raise InputError(f"{name} is a DLPack tensor on {where}:{device[1]}; mhagen's CPU "
                         "modules read host memory: copy it to the CPU first")
    code = ctypes.c_uint8.from_address(tensor + _DTYPE_AT)
    bits = ctypes.c_uint8.from_address(tensor + _DTYPE_AT + 1).value
    lanes = ctypes.c_uint16.from_address(tensor + _DTYPE_AT + 2).value
    bfloat16 = code.value == _BFLOAT and bits == 16 and lanes == 1
    if bfloat16:     # numpy has no bfloat16: the same bits as uint16, viewed back below
        code.value = _UINT
    try:
        array = np.from_dlpack(_Exported(capsule, device))
    except (TypeError, ValueError, RuntimeError, BufferError) as err:
        raise InputError(f"{name} is a DLPack tensor numpy cannot read ({_first_line(err)}); "
                         "pass float32, float16, bfloat16 or integer CPU memory") from None
    return array.view(numpy_dtype("bfloat16")) if bfloat16 else array


def _exported(value, name):
    """value.__dlpack__(): its capsule (DLPack 1.0's, which says whether the memory may be
    written, where the producer makes one), or the producer's refusal as an InputError."""
    try:
        try:
            return value.__dlpack__(max_version=(1, 0))
        except TypeError:           # a producer older than DLPack 1.0: no max_version
            return value.__dlpack__()
    except Exception as err:   # noqa: BLE001 - a foreign array type's own refusal
        raise InputError(f"{name} is {type(value).__name__} whose __dlpack__() refused "
                         f"({_first_line(err)}); pass a numpy array or a CPU tensor") from None


class _Exported:
    """A capsule as numpy.from_dlpack takes it: an object whose __dlpack__ gives it."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _first_line(err) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]
