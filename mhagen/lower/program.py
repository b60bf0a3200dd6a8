"""A lowered layer: buffers and the kernels that run in order over them (no TVM needed here).

The unfused path is one kernel over every node; the fused path is several kernels (packed
QKV GEMM, attention, output GEMM) that pass temporaries. The Module allocates
temporaries once, computes params (repacked weights, block masks) from the user's weights
when they are bound, and calls the kernels in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b (padded tile and panel sizes)."""
    return (a + b - 1) // b * b


@dataclass
class Buffer:
    name: str
    shape: tuple
    role: str                    # "input", "param", "temp" or "output"
    dtype: str = "float32"
    make: Callable | None = None  # params: weights dict -> numpy array of `shape`
    doc: str = ""


@dataclass
class Stage:
    """One scheduling unit inside a kernel: its pattern, blocks and a workload description."""
    name: str
    pattern: str
    node: str
    blocks: tuple
    workload: dict = field(default_factory=dict)


@dataclass
class Kernel:
    name: str
    args: list                   # buffer names in call order
    prim_func: object = None     # a TE-made PrimFunc to schedule with rules ...
    stages: list = field(default_factory=list)
    template: str | None = None  # ... or a template a rule instantiates (e.g. "attention")
    workload: dict = field(default_factory=dict)
    config: object = None        # the template's config (its layout depends on it)
    tuned: bool = False          # config came from a tuning record


@dataclass
class Program:
    buffers: dict                # name -> Buffer, in call-argument order of first use
    kernels: list
    te_text: str = ""
    fusion: str = ""
    key: Callable | None = None   # kernel name -> readable tuning key (set by lower())

    def role(self, role):
        return [b for b in self.buffers.values() if b.role == role]

    def describe(self) -> dict:
        """JSON-able summary (for the manifest and the C API): buffers and the call sequence."""
        return {"buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype,
                             "role": b.role} for b in self.buffers.values()],
                "kernels": [{"name": k.name, "args": list(k.args)} for k in self.kernels],
                "fusion": self.fusion}
