"""TVM's tensor intrinsics (the mma/wmma/dot-product descriptions that dlight's tensor-core
rules and MetaSchedule tensorize with), imported fast.

Each of their ~250 TVMScript functions calls inspect.stack() while parsed, which looks up
every frame's source file through all of sys.modules: importing them took 65 s of the first
float16 CUDA build in a process, and 80-190 s of a tuning run, on a Zen 3 VM. TVM reads only
the third frame's source line (is_defined_in_class) and the frames' locals, which the cheap
stack below keeps.
"""
from __future__ import annotations

import inspect
import sys


def import_tensor_intrinsics() -> None:
    """Import tvm.s_tir.tensor_intrin (once) under a cheap inspect.stack."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.stack

    def stack(context=1):
        frame, frames = sys._getframe(1), []
        while frame is not None:
            if len(frames) < 3:
                frames.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
            else:
                frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                                frame.f_code.co_name, None, None))
            frame = frame.f_back
        return frames

    inspect.stack = stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = original
