"""The input policy: how every array argument is read (x, context, weights, kv_lens, out,
a KVCache's arrays, a key padding mask), by one function, `argument`, whose messages name
the argument; and the answer's form (`answered`: torch in, torch out).

Converted (into a new array, in the dtype the argument needs):
  - numpy arrays of any real floating-point or integer dtype (float64, float16, int64 ...);
  - Python lists and tuples of numbers (nested, rectangular);
  - torch CPU tensors (through Tensor.numpy(), bfloat16 as its int16 bits: the tensor's own
    memory; torch is imported only when one is given);
  - DLPack arrays: a raw DLPack capsule or any object with __dlpack__ (mhagen/dlpack.py:
    numpy over the producer's memory, bfloat16 included);
  - any other object with __array__ (numpy.asarray).
What an argument needs: x and context, the layer's dtype, or float32 where the layer is a
half-precision one (its float32 inputs are rounded into storage on the way in, and the call
answers in float32); the weights, the layer's dtype; kv_lens, int32 (integers only, each
fitting int32); a key padding mask (need=MASK), booleans (True: the key is ignored) or
torch's additive form (0 seen, -inf ignored); the reference (layer.reference), its float
values as they are (integers as float64). Values beyond the needed float dtype's range
(1e39 into float32) are refused, not turned into inf. Nothing is copied where nothing needs
to be: a C-contiguous x in the layer's dtype (or float32) is read where it lies when 64-byte
aligned, be it a numpy array, a torch CPU tensor (torch's allocator aligns to 64 bytes) or
DLPack memory.

The answer (`answered`): out= itself where given (the call wrote into its memory: a numpy
array, a torch tensor or a DLPack array); else a torch tensor over the answer's numpy
memory (torch.from_numpy: no copy) where x was a torch tensor; else the numpy array.

Refused (mhagen.InputError, one line saying what was passed and how to fix it): booleans
(but in a mask), complex numbers, object and string arrays, ragged lists ("x is a ragged
list: rows of different lengths"), objects that are no numbers ("x is a dict; pass a numpy
array [batch, seq, d_model]"), a torch tensor that requires grad while grad is enabled
("mhagen is inference-only: pass t.detach() or call under torch.no_grad()/
torch.inference_mode()"), a torch tensor off the CPU ("x is on cuda:0; mhagen's CPU modules
take CPU tensors: x.cpu()"), DLPack memory off the host, a DLPack capsule read already,
lengths that are not integers or do not fit int32.

No allocation: where the caller asks for none, the argument is used in place and never
converted, since a copy would silently break that promise: out= (the call writes into it),
the arrays bound by Module.prepare() (read in place every run), a KVCache's k, v and lens
(written and advanced in place). There a numpy array, or a torch tensor or DLPack array
through a numpy view of its memory (`shared`), of another dtype or layout is refused with
the dtype and layout needed (`in_place=` says why).
"""
from __future__ import annotations

import sys

import numpy as np

from mhagen.arrays import ALIGNMENT, as_torch, is_aligned
from mhagen.dlpack import from_dlpack, is_capsule, is_dlpack
from mhagen.dtypes import is_float, name_of, numpy_dtype
from mhagen.errors import InputError

FLOAT, LENGTHS, MASK = "float", "lengths", "mask"
_INT32 = np.iinfo(np.int32)


def argument(value, name: str, *, need: str = FLOAT, dtype=None, expects: str = "",
             in_place: str | None = None, aligned: bool = False, shape=None) -> np.ndarray:
    """`value` as the numpy array argument `name` needs (see the module docstring).

    need: FLOAT (real numbers, converted to `dtype`), LENGTHS (integers, int32) or MASK (a
        key padding mask: booleans, True ignored, or 0 / -inf; returned as booleans).
    dtype: FLOAT's dtype, or a tuple of dtypes taken as they are, anything else converted to
        the first; None: float arrays as they are, integers as float64.
    expects: what the argument should be, for messages ("[batch, seq, 64]", "of shape (2,)").
    in_place: why no copy may be made (the caller asked for none): then `value` must already
        be a numpy array of `dtype` (and `shape`; C-contiguous, writable and 64-byte aligned
        where `aligned`), or a torch tensor or DLPack array whose memory is one (returned
        as a numpy view of it: `shared`), else it is refused saying so."""
    if in_place is not None:
        view = shared(value, name)
        if (isinstance(view, np.ndarray) and view.dtype == dtype
                and (shape is None or view.shape == shape)
                and (not aligned or is_aligned(view))):
            return view
        _refuse_in_place(value, view, name, numpy_dtype(dtype), in_place, aligned, shape)
    if need == MASK:
        return _mask(_numbers(value, name, expects, masks=True), name)
    if need == LENGTHS:
        if type(value) is np.ndarray and value.dtype == np.int32:
            return value
        return _lengths(_numbers(value, name, expects), name, expects)
    takes = tuple(numpy_dtype(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,))
                  if d is not None)
    if type(value) is np.ndarray and value.dtype in takes:
        return value
    if type(value).__module__.split(".")[0] == "torch":
        value = _from_torch(value, name, expects)      # its memory: taken as it is, if it can
        if type(value) is np.ndarray and value.dtype in takes:
            return value
    return _floats(_numbers(value, name, expects), name, takes)


def shared(value, name: str):
    """A torch tensor or a DLPack array as a numpy array over its memory (no copy; a torch
    tensor's refusals: grad, device); anything else as it is."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.split(".")[0] == "torch":
        return _from_torch(value, name, "")
    if is_dlpack(value):
        return from_dlpack(value, name)
    return value


def is_torch(value) -> bool:
    """value is a torch tensor (torch is never imported to tell: if it is not imported yet,
    nothing is a tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, getattr(torch, "Tensor", ()))


def answered(result: np.ndarray, x, out=None):
    """A call's answer in the form it was asked for (see the module docstring): `out` where
    given (a capsule, read once, gives way to `result`, the numpy view of its memory), else
    `result` as a torch tensor where x is one, else `result`."""
    if out is None:
        return as_torch(result) if is_torch(x) else result
    return result if is_capsule(out) else out


def _numbers(value, name, expects, masks=False) -> np.ndarray:
    """value as a numpy array of real numbers (any real float or integer dtype; masks:
    booleans too), or refused."""
    if isinstance(value, np.ndarray):
        arr = np.asarray(value)          # a subclass (np.matrix, np.ma) as a plain array
    elif type(value).__module__.split(".")[0] == "torch":
        arr = _from_torch(value, name, expects)
    elif is_dlpack(value):
        arr = from_dlpack(value, name)
    elif isinstance(value, (list, tuple)):
        arr = _from_sequence(value, name, expects)
    elif isinstance(value, (int, float, np.generic)) or hasattr(value, "__array__"):
        try:
            arr = np.asarray(value)
        except Exception as err:   # noqa: BLE001 - a foreign array type's own refusal
            raise InputError(f"{name} is {_a_type(value)} that numpy cannot read "
                             f"({_first_line(err)}); pass a numpy array {expects}".rstrip()
                             ) from None
    else:
        what = "None" if value is None else _a_type(value)
        raise InputError(f"{name} is {what}; pass a numpy array {expects}".rstrip())
    if not (masks and arr.dtype == bool):
        _check_kind(arr, name, expects)
    return arr


def _from_sequence(value, name, expects) -> np.ndarray:
    kind = type(value).__name__
    try:
        arr = np.asarray(value)
    except ValueError as err:
        if "inhomogeneous" in str(err):
            raise InputError(f"{name} is a ragged {kind}: rows of different lengths; pass a "
                             f"rectangular one or a numpy array {expects}".rstrip()) from None
        raise InputError(f"{name} is a {kind} numpy cannot read ({_first_line(err)}); pass "
                         f"a numpy array {expects}".rstrip()) from None
    except Exception as err:   # noqa: BLE001 - an item's own refusal (a tensor needing grad)
        raise InputError(f"{name} is a {kind} numpy cannot read ({_first_line(err)}); pass "
                         f"a numpy array {expects}".rstrip()) from None
    return arr


def _from_torch(t, name, expects) -> np.ndarray:
    """A torch tensor's values (its memory where numpy can share it); torch is imported here
    only because `t` comes from it (so it is imported already)."""
    import torch
    if not isinstance(t, torch.Tensor):
        if hasattr(t, "__array__"):
            return np.asarray(t)
        raise InputError(f"{name} is {_a_type(t)}; pass a numpy array {expects}".rstrip())
    if not t.is_cpu:
        raise InputError(f"{name} is on {t.device}; mhagen's CPU modules take CPU tensors: "
                         f"{name}.cpu()")
    if t.requires_grad:
        if torch.is_grad_enabled():
            raise InputError(f"{name} requires grad; mhagen is inference-only: pass "
                             f"{name}.detach() or call under torch.no_grad()/"
                             "torch.inference_mode()")
        t = t.detach()      # under no_grad: the same memory, without the grad flag numpy refuses
    try:
        if t.dtype == torch.bfloat16:     # numpy has no bfloat16: its bits, as ml_dtypes'
            return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return t.numpy()
    except (TypeError, RuntimeError) as err:   # sparse, quantized, ...: torch says why
        raise InputError(f"{name} is a torch tensor numpy cannot read ({_first_line(err)}); "
                         f"pass a dense CPU tensor or a numpy array {expects}".rstrip()
                         ) from None


def _check_kind(arr, name, expects) -> None:
    d = arr.dtype
    if d == bool:
        raise InputError(f"{name} is a bool array; pass numbers ({name}.astype(np.float32) "
                         "if 0 and 1 are meant)")
    if np.issubdtype(d, np.complexfloating):
        raise InputError(f"{name} is complex ({d}); mhagen's layers take real numbers: pass "
                         f"{name}.real if the imaginary parts are 0")
    if d.kind in "USa":
        raise InputError(f"{name} holds strings ({d}); pass a numpy array of numbers "
                         f"{expects}".rstrip())
    if d == object:
        raise InputError(f"{name} is an object array (items that are not numbers); pass a "
                         f"numpy array of numbers {expects}".rstrip())
    if not (is_float(d) or np.issubdtype(d, np.integer)):
        raise InputError(f"{name} has dtype {d}; pass real floating-point or integer numbers "
                         f"{expects}".rstrip())


def _floats(arr, name, takes) -> np.ndarray:
    if arr.dtype in takes:
        return arr
    if takes:
        want = takes[0]
    elif is_float(arr.dtype):
        return arr
    else:
        want = np.dtype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(want)
    if is_float(arr.dtype) and not np.isfinite(out).all() \
            and not np.array_equal(np.isfinite(out), np.isfinite(arr)):
        raise InputError(f"{name} has values beyond {name_of(want)}'s range (largest finite "
                         f"{float(np.finfo(want).max):.6g}); scale it, or pass finite values")
    return out


def _mask(arr, name) -> np.ndarray:
    """A key padding mask as booleans, True where a key is ignored: booleans as they are, an
    additive float mask (torch's other form) of 0 (seen) and -inf (ignored)."""
    if arr.dtype == bool:
        return arr
    if np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{name} holds integers ({arr.dtype}); pass booleans (True: the key "
                         "is ignored) or an additive float mask of 0 and -inf")
    ignored = np.isneginf(arr)
    if not np.all(ignored | (arr == 0)):
        odd = arr[~(ignored | (arr == 0))].reshape(-1)[0]
        raise InputError(f"{name} is an additive mask holding {float(odd)!r}; mhagen ignores "
                         "keys, it does not weigh them: pass booleans (True: ignored) or a "
                         "float mask of 0 and -inf only")
    return ignored


def _lengths(arr, name, expects) -> np.ndarray:
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(" ".join(f"{name} must be integers {expects}".split())
                         + f", got {arr.dtype} {arr.shape}")
    if arr.size and arr.dtype != np.int32 and (arr.min() < _INT32.min
                                               or arr.max() > _INT32.max):
        raise InputError(f"{name} has values beyond int32 ({arr.min()}..{arr.max()}); "
                         "lengths must fit int32")
    return arr.astype(np.int32)


def _refuse_in_place(value, view, name, dtype, why, aligned, shape):
    layout = f"C-contiguous, writable, {ALIGNMENT}-byte aligned " if aligned else ""
    wanted = f"{layout}{name_of(dtype)} numpy array"
    wanted = ("an " if wanted[0] in "aeiou" else "a ") + wanted
    if shape is not None:
        wanted += f" of shape {tuple(shape)}"
    raise InputError(f"{name} must be {wanted} ({why}), got "
                     f"{_described(value, view, aligned)}")


def _described(value, view, aligned) -> str:
    """What was passed, for an in-place argument's refusal (view: its numpy form, for a
    tensor or DLPack array; aligned: say how its layout falls short)."""
    if isinstance(view, np.ndarray):
        how = "" if not aligned or is_aligned(view) else (
            ", not C-contiguous" if not view.flags.c_contiguous else
            ", read-only" if not view.flags.writeable else f", not {ALIGNMENT}-byte aligned")
        what = "" if view is value else f"{_a_type(value)} "
        return f"{what}{name_of(view.dtype)} {view.shape}{how}"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"{_a_type(value)} {value.dtype} {tuple(value.shape)}"
    return "None" if value is None else _a_type(value)


def _a_type(value) -> str:
    """'a dict', 'an object', 'a torch.Tensor': what value is, for messages."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    name = kind.__name__ if module == "builtins" else f"{module}.{kind.__name__}"
    return ("an " if name[0] in "aeiouAEIOU" else "a ") + name


def _first_line(err) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]
