"""CoreModule: a compiled attention core (mhagen.attention_core) you call with q, k, v.

    module = mhagen.build(core, "x86")             # every batch, q_len and kv_len
    out = module(q, k, v)                          # [batch, q_len, heads, head_dim]
    out = module(q, k, v, kv_lens=..., kv_starts=...)   # a core with key_padding=True

q, k and v are read where they lie, with their own strides (only head_dim must be
contiguous): torch CPU tensors go to the kernels through DLPack, never copied (a transposed
view included), and the answer is a torch tensor then; numpy arrays likewise, answered in
numpy. Other inputs (lists, other dtypes, a tensor whose head_dim is strided) are converted
first (mhagen/inputs.py). Calling a built module needs TVM's runtime library only; a lazy one
(mhagen.build(core, lazy=True)) compiles each kernel on its first call.

The module owns the partial results' temporaries (sized for the largest call so far), so
calls take a lock: one at a time.
"""
from __future__ import annotations

import threading

import numpy as np

from mhagen import runtime
from mhagen.arrays import aligned_empty
from mhagen.errors import InputError, TargetError
from mhagen.inputs import argument

_INT32_MAX = 2 ** 31 - 1


class CoreModule:
    """An attention core compiled for one target: any batch, q_len and kv_len (up to the
    limits given to build, if any). Its kernels (mhagen/lower/core.py): core_step for one
    query a row, core_prefill for q_len == kv_len up to the build's max_seq_len (default
    4096), core for the rest. compile_kernel: a built module's compiler of one kernel (the
    kernels not in `library` are compiled on their first call)."""

    def __init__(self, core, target, program, library=None, *, texts=None,
                 compile_seconds=None, limits=None, compile_kernel=None):
        self.core, self.target, self.program = core, target, program
        self.texts = texts or {}
        self.compile_seconds = compile_seconds
        self.limits = dict(limits or {})        # max_batch, max_seq_len, max_kv_seq_len
        self.cannot_run = target.cannot_run()
        self.dtype = core.numpy_dtype
        self.kernels = {k.name: k for k in program.kernels}
        self._library, self._compile_kernel = library, compile_kernel
        self._functions = {}
        prefill = self.kernels.get("core_prefill")
        self._prefill_most = prefill.workload.seq if prefill else 0
        self._prefill_batch = prefill.workload.batch if prefill and \
            prefill.workload.table_batch > 1 else None
        # the params (block table, score tables) as the kernels take them
        self._params = {b.name: runtime.tensor(_aligned(b.value))
                        for b in program.buffers.values() if b.role == "param"}
        self._scratch = {}      # name -> (float32 array, {shape: tensor over it})
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<mhagen.CoreModule {self.core!r} on {self.target.name}>"

    def inspect(self, what: str = "tir") -> str:
        """The kernels' scheduled TIR ("tir": the kernels compiled so far) or what each
        kernel runs ("program")."""
        if what == "program":
            return self.program.te_text
        if what != "tir":
            raise InputError(f"inspect() of an attention core gives 'tir' or 'program', "
                             f"not {what!r}")
        return "\n".join(self.texts.values())

    def kernel_for(self, batch: int, q_len: int, kv_len: int) -> str:
        """The kernel a call of these sizes runs."""
        if q_len == 1:
            return "core_step"
        if q_len == kv_len and q_len <= self._prefill_most and (
                self._prefill_batch is None or batch <= self._prefill_batch):
            return "core_prefill"
        return "core"

    def _function(self, name):
        """A kernel's function: from the built library, or compiled now (a lazy build)."""
        func = self._functions.get(name)
        if func is None:
            if self._library is not None:
                func = self._library[name]
            else:
                func = self._compile_kernel(self.kernels[name], self.texts)
            self._functions[name] = func
        return func

    # -- calls ---------------------------------------------------------------------------
    def __call__(self, q, k, v, *, kv_lens=None, kv_starts=None, out=None):
        """out [batch, q_len, heads, head_dim] of q [batch, heads, q_len, head_dim], k and v
        [batch, kv_heads, kv_len, head_dim] (kv_len >= q_len where the mask reads query
        positions: the queries are the last q_len of them). kv_lens / kv_starts ([batch]
        ints, a key_padding core): row b sees keys kv_starts[b] <= j < kv_lens[b]. out=: an
        array or tensor of that shape and the core's dtype, C-contiguous, written in place
        (what is returned)."""
        if self.cannot_run is not None:
            raise TargetError(f"cannot call this module: {self.cannot_run}")
        torch_in = _is_torch(q)
        q, k, v = (self._tensor(name, a, torch_in)
                   for name, a in (("q", q), ("k", k), ("v", v)))
        batch, q_len, kv_len = self.core.check_shapes(tuple(q.shape), tuple(k.shape),
                                                      tuple(v.shape))
        self._check_limits(batch, q_len, kv_len)
        ends, starts = self.core.check_bounds(kv_lens, kv_starts, batch, kv_len)
        shape = (batch, q_len, self.core.num_heads, self.core.head_dim)
        result = self._output(out, shape, torch_in)
        if batch == 0 or q_len == 0:
            return result
        if kv_len == 0:           # no key to see: every row gives zeros
            result[...] = 0
            return result
        for name, a in (("q", q), ("k", k), ("v", v)):
            _check_span(name, a)
        with self._lock:
            self._run(q, k, v, ends, starts, result, batch, q_len, kv_len)
        return result

    def _run(self, q, k, v, ends, starts, result, batch, q_len, kv_len):
        kernel = self.kernels[self.kernel_for(batch, q_len, kv_len)]
        func = self._function(kernel.name)
        if not _is_torch(q):     # numpy: bfloat16 goes through runtime.tensor's relabelling
            q, k, v = runtime.tensor(q), runtime.tensor(k), runtime.tensor(v)
        out2d = result.view(batch * q_len, -1) if _is_torch(result) else \
            runtime.tensor(result.reshape(batch * q_len, -1))
        args = dict(self._params, q=q, k=k, v=v, out=out2d, batch=batch, seq=q_len,
                    kv_seq=kv_len, kv_lens=ends, kv_starts=starts)
        if not kernel.workload.prefill:
            row_tile, workers = kernel.config.row_tile, kernel.config.workers
            dp = kernel.workload.head_dim_padded
            n = batch * self.core.kv_heads * -(-(self.core.group * q_len) // row_tile) \
                + workers - 1
            if n * row_tile * dp > _INT32_MAX:
                raise InputError(f"a call of batch {batch} and q_len {q_len} needs more than "
                                 "2^31 partial values (32-bit indices); split the batch")
            args.update(part_o=self._temp("part_o", (n, row_tile, dp)),
                        part_ml=self._temp("part_ml", (n, 2, row_tile)))
        func(*[args[a] for a in kernel.args])

    def _temp(self, name, shape):
        """A TVM tensor over the module's own float32 array `name` shaped for this call (the
        array grown when a call needs more; the tensors of recent shapes kept)."""
        held, made = self._scratch.get(name, (None, {}))
        tensor = made.get(shape)
        if tensor is not None:
            return tensor
        size = shape[0] * shape[1] * shape[2]
        if held is None or held.size < size or len(made) > 64:
            held, made = aligned_empty((max(size, 1),), "float32"), {}
            self._scratch[name] = (held, made)   # the tensors over an old array go with it
        tensor = made[shape] = runtime.tensor(held[:size].reshape(shape))
        return tensor

    def _check_limits(self, batch, q_len, kv_len):
        for name, value in (("batch", batch), ("seq_len", q_len), ("kv_seq_len", kv_len)):
            most = self.limits.get(f"max_{name}")
            if most is not None and value > most:
                raise InputError(f"{name} {value} is beyond this module's max_{name}={most} "
                                 f"(rebuild with max_{name}={value}, or without a limit)")
        if q_len > 1 and "core" not in self.kernels:
            raise InputError(f"q_len {q_len}: this module was built for one query a row "
                             "(max_seq_len=1); rebuild without max_seq_len to run prompts")

    def _tensor(self, name, a, torch_in):
        """q, k or v as the kernels take it: a torch CPU tensor or numpy array of the
        core's dtype whose head_dim is contiguous, as it is; anything else converted."""
        if _is_torch(a):
            import torch
            if a.device.type != "cpu":
                raise InputError(f"{name} is on {a.device}; mhagen's CPU modules take CPU "
                                 f"tensors: {name}.cpu()")
            if a.requires_grad and torch.is_grad_enabled():
                raise InputError(f"{name} requires grad; mhagen is inference-only: pass "
                                 f"{name}.detach() or call under torch.no_grad()/"
                                 "torch.inference_mode()")
            want = getattr(torch, self.core.dtype)
            if a.dtype != want and a.is_floating_point():
                a = a.to(want)
            if a.dtype != want:
                raise InputError(f"{name} is a torch {a.dtype} tensor; pass real numbers "
                                 f"({name}.to(torch.{self.core.dtype}))")
            if a.dim() == 4 and a.stride(-1) != 1 and a.shape[-1] > 1:
                a = a.contiguous()
            return a.detach()
        if torch_in:
            raise InputError(f"q is a torch tensor and {name} is not: pass q, k and v alike "
                             "(torch tensors, or numpy arrays)")
        a = argument(a, name, dtype=self.dtype,
                     expects=f"[batch, heads, len, {self.core.head_dim}]")
        if a.ndim == 4 and (a.strides[-1] != a.itemsize or min(a.strides) < 0):
            a = np.ascontiguousarray(a)
        return a

    def _output(self, out, shape, torch_in):
        if out is None:
            if torch_in:
                import torch
                return torch.empty(shape, dtype=getattr(torch, self.core.dtype))
            return aligned_empty(shape, self.dtype)
        want = f"a C-contiguous {self.core.dtype} array or tensor of shape {shape}"
        if _is_torch(out):
            import torch
            ok = (out.dtype == getattr(torch, self.core.dtype)
                  and tuple(out.shape) == shape and out.is_contiguous()
                  and out.device.type == "cpu")
        else:
            ok = (isinstance(out, np.ndarray) and out.dtype == self.dtype
                  and out.shape == shape and out.flags.c_contiguous and out.flags.writeable)
        if not ok:
            got = (f"{type(out).__module__.split('.')[0]} {getattr(out, 'dtype', '')} "
                   f"{tuple(getattr(out, 'shape', ()))}")
            raise InputError(f"out= must be {want} (the call writes its answer into it), "
                             f"got {got.strip()}")
        return out


def _aligned(value) -> np.ndarray:
    """A param's value as the kernels take it: a writable, 64-byte aligned copy."""
    out = aligned_empty(np.shape(value), np.asarray(value).dtype)
    out[...] = value
    return out


def _is_torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def _check_span(name, a) -> None:
    """The kernels index with 32-bit integers: the farthest element must be within 2^31."""
    strides = a.stride() if _is_torch(a) else tuple(s // a.itemsize for s in a.strides)
    span = sum((n - 1) * s for n, s in zip(a.shape, strides))
    if span > _INT32_MAX:
        raise InputError(f"{name} spans {span + 1} elements; the kernels index with 32-bit "
                         "integers (at most 2^31): split the batch")


__all__ = ["CoreModule"]
