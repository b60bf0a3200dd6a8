"""TVMScript parsed fast: mhagen's templates and TVM's tensor intrinsics.

TVM's parser calls inspect.stack() for every prim_func and inspect.getouterframes() for every
macro call; both look up each frame's source file through all of sys.modules. That took 65 s
of the first float16 CUDA build in a process (the ~250 tensor-intrinsic functions that dlight
and MetaSchedule tensorize with), 80-190 s of a tuning run, and 0.9 s of every 1.4 s parse of
an attention template (its ~8 macro calls), on a Zen 3 VM. TVM reads only the frames and
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
