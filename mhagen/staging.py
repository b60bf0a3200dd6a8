"""A module's arrays for its kernels and the arguments of one call (mhagen/module.py calls).

Staging owns the 64-byte aligned arrays the kernels read and write besides the caller's (the
temporaries, staging copies of inputs, key and cache lengths), the TVM tensors over them made
once, the bound params as the kernels take them (pack), and runs the kernels on a call's
arguments. It checks nothing the caller passes: Module does, before.
"""
from __future__ import annotations

import math

import numpy as np

from mhagen import runtime
from mhagen.arrays import aligned_empty, aligned_zeros, is_aligned
from mhagen.dtypes import TO_STORAGE
from mhagen.errors import ArtifactError
from mhagen.inputs import argument


def aligned_copy(arr, buffer) -> np.ndarray:
    """A param as the kernels take it: buffer's dtype and shape, 64-byte aligned."""
    arr = np.asarray(arr, dtype=buffer.dtype)
    if arr.shape != tuple(buffer.shape):
        raise ArtifactError(f"param {buffer.name!r} has shape {arr.shape}, the kernels expect "
                            f"{tuple(buffer.shape)}")
    out = aligned_empty(buffer.shape, buffer.dtype)
    out[...] = arr
    return out


def deliver(result, target):
    """The returned array: the kernels' [rows, columns] output copied into `result` [batch,
    seq, features] unless they wrote it in place (padded columns, an out= they cannot fill,
    a half layer answering in float32)."""
    if target is not result:
        batch, seq, features = result.shape
        result[...] = target.reshape(batch, seq, -1)[..., :features]
    return result


class Staging:
    """The kernels' side of a module: its program's buffers as arrays and TVM tensors.
    dtype: the layer's storage dtype; out_features: the answer's last axis."""

    def __init__(self, graph, program, library, dtype, out_features: int):
        self.program, self.library = program, library
        self.dtype, self.out_features = dtype, out_features
        self.input = program.role("input")[0]
        self.output = program.role("output")[0]
        # the graph's optional inputs, by name (None: the layer takes none)
        self.lengths_name = graph.lengths_input and graph.lengths_input.name
        self.cache_lens_name = graph.cache_lens_input and graph.cache_lens_input.name
        self.context_name = graph.context_input and graph.context_input.name
        self.temps = {}             # buffer name -> the module's own array
        self.staged_tensors = {}    # (buffer, shape) -> (staging array, TVM tensor over it)
        self.calls = None
        self.resident_for = self.resident_tensors = None

    def pack(self, weights) -> dict:
        """The kernels' params of checked weights (each param's recipe), aligned."""
        out = {}
        for b in self.program.role("param"):
            if b.pack["kind"] == "constant" and b.value is None:
                raise ArtifactError(f"param {b.name!r} is a constant this module does not "
                                    "hold: rebuild it to bind other weights")
            out[b.name] = aligned_copy(b.make(weights), b)
        return out

    def arguments(self, params, x, dims, storage, lens=None, cache=None, context=None):
        """The kernels' arguments by name for one call of checked inputs: TVM tensors over
        numpy memory and, symbolic builds, the call's batch, seq and kv_seq. x (and a
        context) are passed without a copy when C-contiguous in the layer's dtype on a
        64-byte boundary, else copied (storage converts a half layer's float32); a decoding
        layer's cache arrays are always passed as they are (written in place)."""
        buffers = dict(self.resident(params))
        if self.program.symbolic:
            buffers.update(batch=dims["batch"], seq=dims["seq"], kv_seq=dims["kv_seq"])
            buffers.update((b.name, runtime.tensor(self.view(b, dims)))
                           for b in self.program.role("temp") if b.symbolic)
        buffers[self.input.name] = self.input_tensor(self.input, x, dims, storage)
        if context is not None:
            node = self.program.buffers[self.context_name]
            buffers[node.name] = self.input_tensor(node, context, dims, storage)
        if lens is not None:
            staged, buffers[self.lengths_name] = self.staged(
                self.program.buffers[self.lengths_name], dims)
            staged[...] = lens
        if cache is not None:
            staged, buffers[self.cache_lens_name] = self.staged(
                self.program.buffers[self.cache_lens_name], None)
            staged[...] = cache.lens
            buffers["k_cache"], buffers["v_cache"] = cache.tensors()
        return buffers

    def input_tensor(self, buffer, array, dims, storage):
        """A float input (x, a context) as the kernels take it: the caller's array when it
        is 64-byte aligned, else a copy in the module's staging buffer (a half layer's
        float32 input converted into it: StorageCasts.deferred)."""
        shape = buffer.call_shape(dims)
        if array.dtype != self.dtype:
            staged = self.view(buffer, dims)
            storage.convert(TO_STORAGE, array, staged)
            array = staged
        elif not is_aligned(array):
            staged = self.view(buffer, dims)
            staged[...] = array.reshape(shape)
            array = staged
        return runtime.tensor(array.reshape(shape))

    def output_array(self, out, dims, returns):
        """(the array returned, the aligned [rows, columns] array the kernels write);
        returns: the dtype of the array returned; out: the caller's (a numpy array, or a
        torch tensor or DLPack array, then the numpy view of its memory is returned)."""
        full = self.output.call_shape(dims)
        out_shape = (dims["batch"], dims["seq"], self.out_features)
        direct = full[1] == self.out_features and returns == self.dtype
        if out is None:
            if direct:
                a = aligned_empty(out_shape, self.output.dtype)
                return a, a.reshape(full)
            return np.empty(out_shape, returns), self.view(self.output, dims)
        out = argument(out, "out=", dtype=returns, shape=out_shape,   # a tensor: its memory
                       in_place="the call writes its answer into it")
        if direct and is_aligned(out):
            return out, out.reshape(full)
        return out, self.view(self.output, dims)

    def resident(self, params) -> dict:
        """TVM tensors over the params and the temporaries, made once per set of params."""
        if self.resident_for is not params:
            self.resident_tensors = {name: runtime.tensor(a) for name, a in params.items()}
            self.resident_tensors.update((b.name, runtime.tensor(self.temp(b)))
                                         for b in self.program.role("temp")
                                         if not b.symbolic)
            self.resident_for = params
        return self.resident_tensors

    def temp(self, buffer) -> np.ndarray:
        """The module's own array for a temporary (or staging) buffer, allocated once."""
        if buffer.name not in self.temps:
            # zeroed: GEMM padding rows are read but never written, and garbage there can
            # be denormals (a decode step's output GEMM ran 16x slower on them)
            self.temps[buffer.name] = aligned_zeros(buffer.shape, buffer.dtype)
        return self.temps[buffer.name]

    def staged(self, buffer, dims):
        """(the module's staging array for `buffer`, shaped for one call as view, or whole
        where dims is None; a TVM tensor over it), the tensor made once per shape: a decode
        step's cache lengths take no new tensor each call."""
        key = (buffer.name, None if dims is None else buffer.call_shape(dims))
        held = self.staged_tensors.get(key)
        if held is None:
            array = self.temp(buffer) if dims is None else self.view(buffer, dims)
            held = self.staged_tensors[key] = (array, runtime.tensor(array))
        return held

    def view(self, buffer, dims) -> np.ndarray:
        """The module's array for `buffer` shaped for one call (symbolic builds: the front
        of the maximum-size allocation)."""
        shape = buffer.call_shape(dims)
        full = self.temp(buffer)
        if shape == full.shape:
            return full
        return full.reshape(-1)[:math.prod(shape)].reshape(shape)

    def run(self, buffers):
        """Run the kernels in order on a call's arguments."""
        if self.calls is None:
            self.calls = [(self.library[k.name], k.args, k.name)
                          for k in self.program.kernels]
        for func, args, name in self.calls:
            try:
                func(*[buffers[a] for a in args])
            # TVM checks every argument's count (TypeError), ndim, shape and dtype (ValueError)
            except (ValueError, TypeError, KeyError) as err:
                raise ArtifactError(
                    f"kernel {name} refused its arguments ({str(err).splitlines()[0]}): "
                    "the program this module describes does not match its compiled kernels; "
                    "rebuild the module") from None
