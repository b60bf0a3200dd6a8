"""build(): graph -> verify -> passes -> lower (TE / templates) -> schedule rules ->
tvm.compile (one library, one function per kernel) -> Module."""
from __future__ import annotations

import time

from mhagen.errors import GraphError
from mhagen.ir.graph import Graph


def compile_program(program, target):
    """Schedule every kernel and compile them into one library; returns (executable, texts,
    decisions)."""
    import tvm

    from mhagen.schedules import schedule_kernel
    funcs, decisions = {}, []
    for kernel in program.kernels:
        func, dec = schedule_kernel(kernel, target)
        funcs[kernel.name] = func.with_attr("global_symbol", kernel.name)
        decisions += [d.__dict__ for d in dec]
    mod = tvm.IRModule(funcs)
    executable = tvm.compile(mod, target=target.tvm)
    return executable, {"te": program.te_text, "tir": mod.script()}, decisions


def build(layer: Graph, target="x86", *, batch: int = 1, seq_len: int = 128, weights=None,
          fuse: bool = True):
    from mhagen.lower import lower
    from mhagen.module import Module
    from mhagen.target import resolve

    if not isinstance(layer, Graph):
        raise GraphError(f"build() takes a mhagen graph (mhagen.mha(...) or a Graph), got "
                         f"{type(layer).__name__}")
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GraphError(f"{name}={value!r} must be a positive integer")
    t = resolve(target)
    if len(layer.inputs) != 1:
        raise GraphError(f"build() compiles graphs with one input [batch, seq, d_model]; "
                         f"{layer.name!r} has {len(layer.inputs)}")
    start = time.perf_counter()
    program = lower(layer, batch, seq_len, t, fuse=fuse)
    executable, texts, decisions = compile_program(program, t)
    return Module(layer, t, batch, seq_len, program, executable.mod, weights=weights,
                  texts=texts, decisions=decisions, executable=executable,
                  compile_seconds=time.perf_counter() - start, fuse=fuse)
