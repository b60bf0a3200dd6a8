"""Lowering: a verified graph -> passes -> a Program of kernels (TE PrimFuncs or templates)."""
from __future__ import annotations

from mhagen.lower.program import Buffer, Kernel, Program, Stage
from mhagen.passes import run_passes


def lower(graph, batch: int, seq_len: int, target, fuse: bool = True) -> Program:
    """Fused kernels when the passes recognise the graph, else one unfused kernel."""
    from mhagen.lower.te import lower_unfused
    from mhagen.schedules import fused_attention_rule
    graph.shapes(**_dims(graph, batch, seq_len))
    fusion = run_passes(graph, fuse=fuse)
    rule = fused_attention_rule(target) if fusion.fused else None
    if fusion.fused and rule is not None:
        from mhagen.lower.fused import lower_fused
        program = lower_fused(fusion.graph, batch, seq_len, target, rule)
    else:
        program = lower_unfused(graph, batch, seq_len)
    program.fusion = fusion.reason if rule is not None or not fusion.fused else \
        "not fused: no attention template for this target"
    return program


def _dims(graph, batch, seq_len):
    shape = graph.inputs[0].attrs["shape"]
    return {d: v for d, v in zip(shape[:2], (batch, seq_len)) if isinstance(d, str)}


__all__ = ["Buffer", "Kernel", "Program", "Stage", "lower"]
