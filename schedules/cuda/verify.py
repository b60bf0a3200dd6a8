"""Every statement of a CUDA kernel must run inside GPU threads.

TVM compiles a block that no schedule bound to blockIdx/threadIdx into host code (a CUDA
build then holds no kernel at all, and no error says so). After scheduling, this walks the
kernel: every block (TE kernels) and every buffer store (templates, written without blocks)
must lie under a thread-bound loop or a `thread_extent` attribute (T.launch_thread).
"""
from __future__ import annotations

from tvm import s_tir, tirx

from mhagen.errors import ScheduleError

_CHILDREN = ("body", "block", "init", "then_case", "else_case")


def children(stmt):
    """A statement's child statements (sequence items, bodies, branches, blocks)."""
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    found = []
    for name in _CHILDREN:
        child = getattr(stmt, name, None)
        if isinstance(child, (tirx.Stmt, s_tir.SBlock)):
            found.append(child)
    return found


def _binds_threads(stmt) -> bool:
    if isinstance(stmt, tirx.For):
        return stmt.kind == tirx.ForKind.THREAD_BINDING
    return isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent"


def unbound(func) -> list:
    """Names of the blocks, and of the buffers stored to, outside any GPU thread binding."""
    outside = []

    def walk(stmt, bound):
        bound = bound or _binds_threads(stmt)
        if not bound:
            if isinstance(stmt, s_tir.SBlock) and stmt.name_hint != "root":
                outside.append(stmt.name_hint)
            elif isinstance(stmt, tirx.BufferStore):
                outside.append(stmt.buffer.name)
        for child in children(stmt):
            walk(child, bound)
    walk(func.body, False)
    return list(dict.fromkeys(outside))


def check_bound(kernel, func, target) -> None:
    """Raise ScheduleError naming the stages of `kernel` that no GPU thread runs."""
    names = unbound(func)
    if not names:
        return
    stage_of = {b: s.name for s in kernel.stages for b in s.blocks}
    stages = sorted({stage_of.get(n, n) for n in names})
    raise ScheduleError(
        f"kernel {kernel.name} for {target.name}: stage(s) {', '.join(stages)} "
        f"(block/buffer {', '.join(names[:8])}) are not bound to GPU threads; TVM would compile "
        "them as host code, leaving no GPU kernel for them. Schedule them with thread "
        "bindings (blockIdx/threadIdx) or a GPU rule")
