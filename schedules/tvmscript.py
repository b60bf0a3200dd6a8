"""TVMScript parsed fast: mhagen's templates and TVM's tensor intrinsics; and a TIR walk for
finishing scheduled kernels (wrap_loop_bodies).

TVM's parser calls inspect.stack() for every prim_func and inspect.getouterframes() for every
macro call; both look up each frame's source file through all of sys.modules, which made
the first CUDA build, a tuning run's start and every attention template's parse slow (see
benchmarks/PERFORMANCE.md, Schedule decisions). TVM reads only the frames and
their locals and globals, and the third frame's source line (is_defined_in_class), which
the cheap stack below keeps.
"""
from __future__ import annotations

import contextlib
import inspect
import sys


def _frames(frame, context):
    frames = []
    while frame is not None:
        if len(frames) < 3:
            frames.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
        else:
            frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                            frame.f_code.co_name, None, None))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def cheap_stack():
    """inspect.stack and inspect.getouterframes without source lookups past the third
    frame, while TVMScript is parsed (not thread-safe: parse in one thread at a time)."""
    original = inspect.stack, inspect.getouterframes
    inspect.stack = lambda context=1: _frames(sys._getframe(1), context)
    inspect.getouterframes = lambda frame, context=1: _frames(frame, context)
    try:
        yield
    finally:
        inspect.stack, inspect.getouterframes = original


def import_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin (once) under the cheap stack."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with cheap_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401


def wrap_loop_bodies(body, annotation: str, wrap):
    """body (a scheduled PrimFunc's) with every loop annotated `annotation` running
    wrap(its body) in each iteration (a parallel task), the annotation dropped; None when no
    loop has it. (TVM 0.27's Python has no IR mutator: the walk rebuilds the nodes on the
    way to such a loop, which the schedules leave under the root block.)"""
    from tvm import s_tir, tirx
    found = []

    def walk(stmt):
        if isinstance(stmt, tirx.For):
            if annotation in stmt.annotations:
                found.append(stmt)
                rest = {k: v for k, v in stmt.annotations.items() if k != annotation}
                return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
                                wrap(stmt.body), stmt.thread_binding, rest)
            inner = walk(stmt.body)
            return stmt if inner.same_as(stmt.body) else tirx.For(
                stmt.loop_var, stmt.min, stmt.extent, stmt.kind, inner, stmt.thread_binding,
                stmt.annotations)
        if isinstance(stmt, tirx.SeqStmt):
            seq = [walk(s) for s in stmt.seq]
            return stmt if all(a.same_as(b) for a, b in zip(seq, stmt.seq)) else tirx.SeqStmt(seq)
        if isinstance(stmt, tirx.AttrStmt):
            inner = walk(stmt.body)
            return stmt if inner.same_as(stmt.body) else tirx.AttrStmt(
                stmt.node, stmt.attr_key, stmt.value, inner)
        if isinstance(stmt, s_tir.SBlockRealize):
            b = stmt.block
            inner = walk(b.body)
            if inner.same_as(b.body):
                return stmt
            block = s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, inner, b.init,
                                 b.alloc_buffers, b.match_buffers, b.annotations)
            return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
        return stmt
    out = walk(body)
    return out if found else None
