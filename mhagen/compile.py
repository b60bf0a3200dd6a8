"""build(): graph -> verify -> lower to TE -> schedule rules -> tvm.compile -> Module."""
from __future__ import annotations

import time

from mhagen.errors import GraphError
from mhagen.ir.graph import Graph


def build(layer: Graph, target="x86", *, batch: int = 1, seq_len: int = 128, weights=None):
    import tvm
    from tvm import s_tir

    from mhagen.lower.te import lower
    from mhagen.module import Module
    from mhagen.schedules import apply_rules
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
    lowered = lower(layer, batch, seq_len)
    sch = s_tir.Schedule(tvm.IRModule({"main": lowered.prim_func}))
    decisions = apply_rules(sch, lowered.stages, t)
    executable = tvm.compile(sch.mod, target=t.tvm)
    seconds = time.perf_counter() - start
    return Module(layer, t, batch, seq_len, lowered.params, executable.mod,
                  weights=weights, texts={"te": lowered.te_text, "tir": sch.mod.script()},
                  decisions=[d.__dict__ for d in decisions], executable=executable,
                  compile_seconds=seconds)
