"""The launch table of a CUDA build: for each GPU kernel, in the order the program runs them,
its entry name, grid and block sizes and the buffers it takes.

TVM's host code computes these and launches the kernels through TVM's CUDA runtime; the pip
TVM has none, and an artifact should run where only the CUDA driver is. So the build reads
them from TVM's lowering (the same pipeline tvm.compile runs, split into host and device
functions) and the artifact's C API launches the fatbin's kernels itself (cuLaunchKernel).
Only fixed shapes: every extent must be a constant (the CUDA backend is not symbolic).
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass

import tvm
from tvm import tirx

from mhagen.errors import ScheduleError
from mhagen.schedules.cuda.verify import children

_AXES = {"blockIdx.x": ("grid", 0), "blockIdx.y": ("grid", 1), "blockIdx.z": ("grid", 2),
         "threadIdx.x": ("block", 0), "threadIdx.y": ("block", 1),
         "threadIdx.z": ("block", 2)}


@dataclass(frozen=True)
class KernelLaunch:
    """One cuLaunchKernel of a program kernel."""
    kernel: str            # the program kernel ("attention")
    entry: str             # the GPU function in the fatbin ("attention_kernel")
    grid: tuple            # (x, y, z) blocks
    block: tuple           # (x, y, z) threads
    dynamic_shared: int    # bytes of dynamic shared memory
    args: tuple            # program buffer names, in the entry's parameter order
    static_shared: int = 0   # bytes of static shared memory (ptxas; with the dynamic ones
    #                          above 48 KiB, the kernel must opt in)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: dict) -> "KernelLaunch":
        return KernelLaunch(d["kernel"], d["entry"], tuple(d["grid"]), tuple(d["block"]),
                            int(d["dynamic_shared"]), tuple(d["args"]),
                            int(d.get("static_shared", 0)))


def _dynamic_shared_bytes(buffer) -> int:
    n = tvm.runtime.DataType(str(buffer.dtype)).bits // 8
    for dim in buffer.shape:
        if not isinstance(dim, tirx.IntImm):
            raise ScheduleError(f"dynamic shared memory {buffer.name} has a symbolic size")
        n *= int(dim)
    return n


def _thread_extents(stmt, found: dict) -> None:
    """Collect launch_thread extents (tag -> extent) and, under "shared.dyn", the bytes of
    dynamic shared memory."""
    if type(stmt).__name__ == "AllocBuffer" and stmt.buffer.scope() == "shared.dyn":
        found["shared.dyn"] = found.get("shared.dyn", 0) + _dynamic_shared_bytes(stmt.buffer)
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        tag = stmt.node.thread_tag
        if not isinstance(stmt.value, tirx.IntImm):
            raise ScheduleError(f"GPU launch size {tag} = {stmt.value} is not a constant; the "
                                "CUDA artifacts run fixed shapes only")
        if found.setdefault(tag, int(stmt.value)) != int(stmt.value):
            raise ScheduleError(f"{tag} launched with two extents ({found[tag]}, {stmt.value})")
    for child in children(stmt):
        _thread_extents(child, found)


def launch_table(mod: tvm.IRModule, target, program) -> list:
    """KernelLaunch per program kernel of the scheduled module `mod` (one GPU kernel each)."""
    tvm_target = target.tvm
    host = tvm_target.host or tvm.target.Target("llvm")
    bound = tirx.transform.BindTarget(tvm.target.Target(tvm_target, host))(mod)
    pipeline, _, _ = tirx.get_default_tir_pipeline(tvm_target)
    _, devices = importlib.import_module("tvm.tirx.build").split_host_device_mods(
        pipeline(bound))
    entries = {gv.name_hint: f for dm in devices.values() for gv, f in dm.functions.items()}
    buffers = set(program.buffers)
    launches = []
    for kernel in program.kernels:
        entry = f"{kernel.name}_kernel"
        func = entries.pop(entry, None)
        if func is None:
            raise ScheduleError(f"kernel {kernel.name} has no GPU function {entry}; the CUDA "
                                "artifacts expect one GPU kernel per program kernel")
        # the GPU function's parameters are named after the PrimFunc's (name_ptr), whose
        # order is the program kernel's arguments
        names = {p.name: arg for p, arg in zip(mod[kernel.name].params, kernel.args)}
        args = []
        for p in func.params:
            arg = names.get(p.name.removesuffix("_ptr"))
            if arg not in buffers:
                raise ScheduleError(f"{entry} takes {p.name}, which is no program buffer")
            args.append(arg)
        found = {}
        _thread_extents(func.body, found)
        dims = {"grid": [1, 1, 1], "block": [1, 1, 1]}
        dynamic = found.pop("shared.dyn", 0)
        if dynamic and not any("dyn" in str(p) for p in
                               func.attrs["tirx.kernel_launch_params"]):
            raise ScheduleError(f"{entry} allocates dynamic shared memory it is not launched "
                                "with")
        for tag, extent in found.items():
            where, axis = _AXES[tag]
            dims[where][axis] = extent
        launches.append(KernelLaunch(kernel.name, entry, tuple(dims["grid"]),
                                     tuple(dims["block"]), dynamic, tuple(args)))
    if entries:
        raise ScheduleError(f"GPU functions {sorted(entries)} belong to no program kernel")
    return launches
