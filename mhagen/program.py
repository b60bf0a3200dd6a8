"""A lowered layer: buffers and the kernels that run in order over them (no TVM needed here:
mhagen.load rebuilds it from the manifest).

The unfused path is one kernel over every node; the fused path is several kernels (packed
QKV GEMM, attention, output GEMM) that pass temporaries. The Module allocates
temporaries once, computes params (repacked weights, block masks) from the user's weights
when they are bound, and calls the kernels in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from mhagen.ir.kinds import SUPPORTED_DTYPES
from mhagen.ir.verify import MAX_ELEMENTS
from mhagen.params import pack_param
from mhagen.records.database import workload_key
from mhagen.workloads import ElementwiseWorkload


SCALARS = ("batch", "seq")      # kernel arguments that are not buffers (symbolic builds;
CROSS_SCALARS = SCALARS + ("kv_seq",)   # cross-attention: and the context's length)


def round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b (padded tile and panel sizes)."""
    return (a + b - 1) // b * b


@dataclass
class Buffer:
    name: str
    shape: tuple
    role: str                    # one of ROLES ("state": a decoding layer's K/V cache)
    dtype: str = "float32"
    pack: dict | None = None     # params: how to make it from the weights (mhagen.params)
    value: np.ndarray | None = None  # params of kind "constant": the array
    doc: str = ""
    symbolic: dict | None = None  # symbolic-length builds: {axis: "batch" | "rows" |
                                  # "padded_rows" | "kv_rows" | "kv_padded_rows" | "tiles"};
                                  # `shape` then holds the maximum ("pool_blocks": a paged
                                  # cache's pool, any size; shape holds 1)

    def call_shape(self, dims: dict) -> tuple:
        """The shape of one call: symbolic axes from dims (call_dims()), the rest fixed."""
        if not self.symbolic:
            return tuple(self.shape)
        return tuple(dims[self.symbolic[a]] if a in self.symbolic else n
                     for a, n in enumerate(self.shape))

    def make(self, weights) -> np.ndarray:
        """This param for `weights` (a constant's value when it does not depend on them)."""
        if self.pack["kind"] == "constant":
            return self.value
        return pack_param(self.pack, weights)

    def describe(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
             "role": self.role}
        if self.pack is not None:
            d["pack"] = self.pack
        if self.symbolic:
            d["symbolic"] = {str(a): k for a, k in self.symbolic.items()}
        return d


@dataclass
class Stage:
    """One scheduling unit inside a kernel: its pattern, blocks and a workload description."""
    name: str
    pattern: str
    node: str
    blocks: tuple
    workload: object = field(default_factory=ElementwiseWorkload)   # what its rule reads
    #                                         (mhagen.workloads; epilogues, packs: nothing)


@dataclass
class Kernel:
    name: str
    args: list                   # buffer names in call order (symbolic-length builds end
                                 # with the scalars SCALARS: the call's batch and seq)
    prim_func: object = None     # a TE-made PrimFunc to schedule with rules ...
    stages: list = field(default_factory=list)
    template: str | None = None  # ... or a template a rule instantiates (e.g. "attention")
    workload: object = None      # a template's AttentionWorkload (mhagen/workloads.py)
    multiplies: str | None = None   # a loaded program's kernel: "amx" | "pairs" (else the
    #                                 workload says)
    config: object = None        # the template's config (its layout depends on it)
    tuned: bool = False          # config came from a tuning record


@dataclass
class Program:
    buffers: dict                # name -> Buffer, in call-argument order of first use
    kernels: list
    te_text: str = ""
    fusion: str = ""
    key_parts: tuple | None = None  # (graph, target, batch, seq, {kernel: call fields})
                                    # of its tuning keys (set by lower(); None: its kernels
                                    # consult no records)
    symbolic: dict | None = None  # one build for every length: {"batch": bool, "seq": bool,
                                  # "row_tile": rows the GEMM temporaries are padded to}
    packed: list | None = None    # the kernels of a packed call (mhagen/packed.py), in
                                  # order: the GEMMs above, and kernels of their own
    packed_q_tile: int = 0        # the query tiles of their tile table

    @property
    def compiled(self) -> list:
        """Every kernel the library holds: the padded call's, then those only packed calls
        run."""
        names = {k.name for k in self.kernels}
        return self.kernels + [k for k in self.packed or [] if k.name not in names]

    def call_dims(self, batch: int, seq: int, kv_seq: int | None = None,
                  tiles: int = 1) -> dict:
        """The values of the symbolic axes (and the kernels' scalar arguments) for a call;
        kv_seq: a cross-attention's context length; tiles: a packed call's query tiles (the
        rows of its tile table; padded calls read none)."""
        rows = batch * seq
        tile = self.symbolic["row_tile"] if self.symbolic else 1
        kv_rows = batch * (kv_seq or seq)
        return {"batch": batch, "seq": seq, "rows": rows, "padded_rows": round_up(rows, tile),
                "kv_seq": kv_seq or seq, "kv_rows": kv_rows,
                "kv_padded_rows": round_up(kv_rows, tile), "tiles": tiles}

    @property
    def tunable(self) -> bool:
        """Whether its kernels have tuning keys (records may tune them)."""
        return self.key_parts is not None

    def key(self, kernel_name: str) -> dict | None:
        """The readable tuning key of one of its kernels (mhagen.records.database), or None."""
        if self.key_parts is None:
            return None
        graph, target, batch, seq, *calls = self.key_parts
        return workload_key(graph, target, batch, seq, kernel_name,
                            calls[0].get(kernel_name) if calls else None)

    def role(self, role):
        return [b for b in self.buffers.values() if b.role == role]

    def describe(self) -> dict:
        """JSON-able summary (the manifest's "program", what the C API and mhagen.load read):
        buffers with their param recipes, the kernels in call order with their arguments."""
        d = {"buffers": [b.describe() for b in self.buffers.values()],
             "kernels": [{"name": k.name, "args": list(k.args),
                          **({"multiplies": multiplies(k)} if multiplies(k) else {})}
                         for k in self.kernels],
             "fusion": self.fusion}
        if self.symbolic:
            d["symbolic"] = dict(self.symbolic)
        if self.packed:
            d["packed"] = {"kernels": [{"name": k.name, "args": list(k.args)}
                                       for k in self.packed], "q_tile": self.packed_q_tile}
        return d

    @classmethod
    def from_description(cls, d: dict) -> "Program":
        """The Program describe() wrote (kernels without code: they live in kernel.so);
        ValueError where the description is not one describe() could have written."""
        _check_description(d)
        buffers = {b["name"]: Buffer(b["name"], tuple(b["shape"]), b["role"], b["dtype"],
                                     pack=b.get("pack"),
                                     symbolic={int(a): k for a, k in
                                               b.get("symbolic", {}).items()} or None)
                   for b in d["buffers"]}
        kernels = [Kernel(k["name"], list(k["args"]),
                          multiplies=k.get("multiplies"))
                   for k in d["kernels"]]
        packed = d.get("packed")
        return cls(buffers, kernels, fusion=d.get("fusion", ""), symbolic=d.get("symbolic"),
                   packed=[Kernel(k["name"], list(k["args"])) for k in packed["kernels"]]
                   if packed else None, packed_q_tile=packed["q_tile"] if packed else 0)


ROLES = ("input", "param", "temp", "output", "state")
SYMBOLIC_AXES = ("batch", "rows", "padded_rows", "kv_rows", "kv_padded_rows", "tiles",
                 "pool_blocks")   # pool_blocks: a paged K/V cache's blocks, the caller's
BUFFER_DTYPES = SUPPORTED_DTYPES + ("int32",)   # int32: key lengths, block tables


def _check_description(d) -> None:
    """Names, shapes (positive 32-bit ints), roles and dtypes of the buffers; kernels that
    name buffers of the program."""
    if not isinstance(d, dict) or not isinstance(d.get("buffers"), list) or not isinstance(
            d.get("kernels"), list) or not d["kernels"]:
        raise ValueError("the program needs lists of buffers and kernels")
    names = set()
    for b in d["buffers"]:
        if not isinstance(b, dict) or not isinstance(b.get("name"), str) or not b["name"]:
            raise ValueError(f"buffer {b!r} has no name")
        shape = b.get("shape")
        if not isinstance(shape, list) or not shape or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_ELEMENTS
                for n in shape):
            raise ValueError(f"buffer {b['name']!r} has shape {shape!r}")
        if b.get("role") not in ROLES or b.get("dtype") not in BUFFER_DTYPES:
            raise ValueError(f"buffer {b['name']!r} has role {b.get('role')!r} and dtype "
                             f"{b.get('dtype')!r}")
        symbolic = b.get("symbolic", {})
        if not isinstance(b.get("pack", {}) or {}, dict) or not isinstance(symbolic, dict) \
                or any(k not in [str(a) for a in range(len(shape))] or v not in SYMBOLIC_AXES
                       for k, v in symbolic.items()):
            raise ValueError(f"buffer {b['name']!r} has pack or symbolic entries of the "
                             f"wrong type (symbolic: axis -> one of {', '.join(SYMBOLIC_AXES)})")
        names.add(b["name"])
    packed = d.get("packed") or {"kernels": [], "q_tile": 1}
    if not isinstance(packed, dict) or not isinstance(packed.get("kernels"), list) or not (
            isinstance(packed.get("q_tile"), int) and packed["q_tile"] > 0):
        raise ValueError("the program's packed calls need a list of kernels and a positive "
                         "q_tile")
    for k in d["kernels"] + packed["kernels"]:
        if not isinstance(k, dict) or not isinstance(k.get("name"), str) or not k["name"] \
                or not isinstance(k.get("args"), list) or not all(
                    isinstance(a, str) and (a in names or a in CROSS_SCALARS)
                    for a in k["args"]):
            raise ValueError(f"kernel {k!r} needs a name and arguments among the buffers "
                             f"(or the scalars {', '.join(CROSS_SCALARS)})")


def multiplies(kernel) -> str | None:
    """"amx" or "pairs" for a kernel whose products run on bfloat16 AMX tiles or vdpbf16ps
    pairs (its workload says so, or a loaded program's description), else None."""
    if kernel.multiplies:
        return kernel.multiplies
    work = kernel.workload
    return "amx" if getattr(work, "amx", False) else "pairs" if getattr(work, "pairs", False) \
        else None
