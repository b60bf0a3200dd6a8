"""build(): graph -> verify -> passes -> lower (TE / templates) -> schedule rules ->
tvm.compile (one library, one function per kernel) -> Module."""
from __future__ import annotations

import time

import tvm

from mhagen.backends import backend_for
from mhagen.checks import positive_int
from mhagen.errors import GraphError
from mhagen.ir.graph import Graph
from mhagen.lower import lower
from mhagen.module import BuildInfo, Module
from mhagen.schedules import schedule_kernel
from mhagen.target import resolve
from mhagen.tuning.records import Database, Tuning


def compile_program(program, target, tuning=None):
    """Schedule every kernel (consulting `tuning` records) and compile them into one library;
    returns (executable, texts, decisions, device code). A backend with device code (CUDA)
    compiles it here too (its DeviceCode; texts["source"]: CUDA source, PTX, ptxas report);
    else the device code is None."""
    funcs, decisions = {}, []
    for kernel in program.kernels:
        record = tuning.lookup(program.key(kernel.name)) if tuning and program.key else None
        func, dec = schedule_kernel(kernel, target, record=record)
        funcs[kernel.name] = func.with_attr("global_symbol", kernel.name)
        decisions += [d.__dict__ for d in dec]
    mod = tvm.IRModule(funcs)
    executable = tvm.compile(mod, target=target.tvm)
    texts = {"te": program.te_text, "tir": mod.script()}
    device_compile = backend_for(target).device_compile
    device = None
    if device_compile is not None:
        device = device_compile(executable, target)
        texts["source"] = "\n".join([device.source, device.ptx, device.ptxas_report])
    return executable, texts, decisions, device


def resolve_tuning(tuning, target):
    """"auto" (user database, then shipped records), None (defaults only), a database path,
    or a Tuning object."""
    if isinstance(tuning, Tuning):
        return tuning
    if tuning == "auto":
        return Tuning.default(target)
    if tuning is None or tuning == "none":
        return Tuning.none()
    return Tuning([Database.load(tuning, missing_ok=False)])


def build(layer: Graph, target="x86", *, batch: int = 1, seq_len: int = 128, weights=None,
          fuse: bool = True, tuning="auto"):
    if not isinstance(layer, Graph):
        raise GraphError(f"build() takes a mhagen graph (mhagen.mha(...) or a Graph), got "
                         f"{type(layer).__name__}")
    positive_int("batch", batch)
    positive_int("seq_len", seq_len)
    t = resolve(target)
    if len(layer.inputs) != 1:
        raise GraphError(f"build() compiles graphs with one input [batch, seq, d_model]; "
                         f"{layer.name!r} has {len(layer.inputs)}")
    start = time.perf_counter()
    tuning = resolve_tuning(tuning, t)
    program = lower(layer, batch, seq_len, t, fuse=fuse, tuning=tuning)
    executable, texts, decisions, device = compile_program(program, t, tuning)
    tuned = {d["kernel"] for d in decisions if d["source"] == "tuned"}
    used = [tuning.lookup(program.key(k)) for k in sorted(tuned)]
    info = BuildInfo(fuse=fuse, texts=texts, decisions=decisions, tuning_records=used,
                     compile_seconds=time.perf_counter() - start, executable=executable,
                     device_code=device, builder=build)
    return Module(layer, t, batch, seq_len, program, executable.mod, weights=weights, info=info)
