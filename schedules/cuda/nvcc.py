"""Device code at build time: the CUDA source TVM generated -> nvcc -> PTX -> ptxas -> fatbin.

TVM 0.27 keeps CUDA kernels as source in the module and compiles them when the module is
loaded (NVRTC by default, and only where TVM's CUDA runtime is present: not on a machine
without a GPU driver). mhagen compiles them here, at build time, for the preset's arch:
  nvcc -ptx -arch=compute_XX   -> the PTX (one .entry per GPU kernel)
  ptxas -v -arch=sm_XX         -> the cubin, and the resource report (registers, spills, smem)
  fatbinary                    -> sm_XX code plus compute_XX PTX (newer GPUs JIT the PTX)
and refuses a kernel that needs more shared memory than the target allows (ptxas itself refuses
more static shared memory than 48 KiB). Spills are reported (resources), not refused.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from mhagen.errors import ScheduleError, TargetError
from mhagen.schedules.cuda.launch import launch_table

TOOLS = ("nvcc", "ptxas", "fatbinary")
# shared memory per block (static + dynamic) a kernel may opt into, by architecture; without
# opting in, 48 KiB
OPT_IN_SHARED = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_87": 163 * 1024,
                 "sm_89": 99 * 1024, "sm_90": 227 * 1024}


def shared_limit(target) -> int:
    """The most shared memory one block of `target` can have (opting in above 48 KiB)."""
    t = target.tvm_target_dict()
    return OPT_IN_SHARED.get(t.get("arch"), t["max_shared_memory_per_block"])
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr")


@dataclass
class KernelResources:
    """What ptxas reports for one GPU kernel (.entry)."""
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclass
class DeviceCode:
    """The device side of a CUDA build: what a GPU machine loads without compiling."""
    arch: str                    # "sm_90"
    source: str                  # the CUDA source TVM generated
    fatbin: bytes
    ptx: str
    ptxas_report: str
    resources: dict = field(default_factory=dict)   # entry name -> KernelResources
    launches: list = field(default_factory=list)    # KernelLaunch per kernel, in run order
    launch_problem: str = ""     # why there is no launch table (no artifact can be saved)

    def entries(self) -> list:
        return re.findall(r"^\.(?:visible )?\.entry (\w+)\(", self.ptx, re.M)


def find_tool(name: str) -> str | None:
    """A CUDA tool on the PATH, or from NVIDIA's PyPI wheels (nvidia-cuda-cuobjdump puts
    cuobjdump in site-packages/nvidia/cu13/bin)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for path in sorted(Path(root).glob(f"cu*/bin/{name}")):
            return str(path)
    return None


def sass(fatbin: bytes) -> dict:
    """GPU function name -> its SASS (the machine code of the fatbin's cubin), by cuobjdump."""
    tool, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if tool is None or disasm is None:
        raise TargetError("disassembling needs cuobjdump and nvdisasm (pip install "
                          "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    # cuobjdump runs nvdisasm, looked up on the PATH
    env = {**os.environ, "PATH": f"{Path(disasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory(prefix="mhagen-sass-") as tmp:
        Path(tmp, "k.fatbin").write_bytes(fatbin)
        text = _run([tool, "-sass", "k.fatbin"], tmp, "cuobjdump", env)
    parts = re.split(r"^\s*Function : (\w+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def missing_tools() -> list:
    return [t for t in TOOLS if shutil.which(t) is None]


def _run(cmd, cwd, what, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ScheduleError(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def parse_ptxas_report(report: str) -> dict:
    """entry name -> KernelResources from `ptxas -v` output."""
    out, name, frame = {}, None, (0, 0, 0)
    for line in report.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m:
            frame = tuple(int(v) for v in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name is not None:
            smem = re.search(r"(\d+) bytes smem", line)
            out[name] = KernelResources(int(m.group(1)), int(smem.group(1)) if smem else 0,
                                        *frame)
            name, frame = None, (0, 0, 0)
    return out


def compile_source(source: str, arch: str) -> DeviceCode:
    """CUDA source -> DeviceCode for `arch` ("sm_80", "sm_90")."""
    missing = missing_tools()
    if missing:
        raise TargetError(f"building CUDA kernels needs the CUDA toolkit's {', '.join(missing)} "
                          "on the PATH")
    sm = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory(prefix="mhagen-cuda-") as tmp:
        Path(tmp, "kernels.cu").write_text(source)
        _run(["nvcc", "-ptx", f"-arch=compute_{sm}", *NVCC_FLAGS, "kernels.cu",
              "-o", "kernels.ptx"], tmp, "nvcc")
        report = _run(["ptxas", "-v", "-O3", f"-arch=sm_{sm}", "kernels.ptx",
                       "-o", "kernels.cubin"], tmp, "ptxas")
        _run(["fatbinary", "--create=kernels.fatbin", "-64",
              f"--image3=kind=elf,sm={sm},file=kernels.cubin",
              f"--image3=kind=ptx,sm={sm},file=kernels.ptx"], tmp, "fatbinary")
        return DeviceCode(arch=arch, source=source, fatbin=Path(tmp, "kernels.fatbin").read_bytes(),
                          ptx=Path(tmp, "kernels.ptx").read_text(), ptxas_report=report,
                          resources=parse_ptxas_report(report))


def compile_device(executable, target, mod, program) -> DeviceCode:
    """The device code of a CUDA build, compiled now; checked against the program's kernels
    and the target's shared memory. `mod`: the scheduled kernels (for the launch table)."""
    cuda = [m for m in executable.mod.imports if m.kind == "cuda"]
    if len(cuda) != 1:
        raise ScheduleError(f"a CUDA build for {target.name} holds {len(cuda)} CUDA modules "
                            "(expected one): no kernel was bound to GPU threads?")
    tvm_dict = target.tvm_target_dict()
    code = compile_source(cuda[0].inspect_source("cuda"), tvm_dict["arch"])
    limit = tvm_dict.get("max_shared_memory_per_block")
    for entry, r in code.resources.items():
        if limit and r.shared_bytes > limit:
            raise ScheduleError(f"GPU kernel {entry} uses {r.shared_bytes} bytes of shared "
                                f"memory; {target.name} allows {limit} per block")
    try:   # what an artifact launches; a program that cannot be launched still compiles
        code.launches = [replace(la, static_shared=code.resources[la.entry].shared_bytes)
                         for la in launch_table(mod, target, program)]
    except ScheduleError as err:
        code.launch_problem = str(err)
    for la in code.launches:
        if la.static_shared + la.dynamic_shared > shared_limit(target):
            raise ScheduleError(f"GPU kernel {la.entry} needs {la.static_shared} + "
                                f"{la.dynamic_shared} bytes of shared memory; {target.name} "
                                f"allows {shared_limit(target)} per block")
    missing = {la.entry for la in code.launches} - set(code.entries())
    if missing:
        raise ScheduleError(f"the PTX lacks the GPU kernels {sorted(missing)}")
    return code
