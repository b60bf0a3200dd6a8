"""Resolve a target preset (targets/*.json) into what rules and the compiler read.

Rules read attributes (vector_bits, cores, features), never target names.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from mhagen.errors import TargetError


@dataclass(frozen=True)
class Target:
    name: str
    tvm_dict: tuple          # sorted items of the TVM target dict (hashable)
    arch: str
    cores: int
    vector_bits: int
    features: tuple
    cross_compiler: str | None = None
    vector_registers: int = 16   # architectural vector registers (x86: 16, AVX-512/aarch64: 32)
    l1d_kib: int = 32            # data caches per core (L3: the whole chip), for cache blocking
    l2_kib: int = 1024
    l3_kib: int = 0
    cpu: str = ""                # LLVM's CPU name (the `mcpu` the code is compiled for)

    @property
    def lanes(self) -> int:
        """float32 lanes per vector register."""
        return self.vector_bits // 32

    @property
    def tvm(self):
        import tvm
        return tvm.target.Target(self.tvm_target_dict())

    def tvm_target_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.tvm_dict}

    @property
    def cpu_class(self) -> str:
        """What changes the best schedule, as a name: ISA family, vector width, vector
        registers ("x86_64-v512-r32": AVX-512; "x86_64-v256-r16": AVX2). Tuning records are
        kept per class; cache sizes pick the closest record within a class."""
        return f"{self.arch}-v{self.vector_bits}-r{self.vector_registers}"

    def runs_here(self) -> bool:
        return self.arch == host_arch() and not self.missing_features()

    def missing_features(self) -> list:
        """CPU features this code needs that this machine lacks (empty: it runs here)."""
        if self.arch != host_arch():
            return []
        return sorted(set(self.required_features()) - set(host_features()))

    def check_runs_here(self) -> None:
        """Raise TargetError, naming what is missing, when this code cannot run here (an
        instruction this CPU lacks would kill the process with SIGILL)."""
        if self.arch != host_arch():
            raise TargetError(f"this is {self.arch} code ({self.name}); it cannot run on this "
                              f"{host_arch()} machine")
        missing = self.missing_features()
        if missing:
            raise TargetError(f"this code ({self.name}, {self.cpu_class}) needs CPU features "
                              f"{', '.join(missing)} that this machine lacks: build for "
                              f"target 'x86' (this CPU) or 'x86-avx2' instead")

    def required_features(self) -> tuple:
        return tuple(f for f in self.features if f in _RUNTIME_FEATURES)

    def describe(self) -> str:
        d = self.tvm_target_dict()
        return (f"{self.name}: {d.get('mtriple')} cpu={d.get('mcpu')} vector={self.vector_bits} "
                f"bits, {self.vector_registers} vector registers, L1d {self.l1d_kib} KiB, "
                f"L2 {self.l2_kib} KiB, cores={self.cores}")


_RUNTIME_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "neon", "sve")


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def host_caches() -> dict:
    """This machine's caches in KiB as {"l1d_kib", "l2_kib", "l3_kib"} (Linux sysfs, cpu0;
    empty where sysfs does not say)."""
    out = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return out
    for e in entries:
        try:
            with open(f"{root}/{e}/level") as f:
                level = int(f.read())
            with open(f"{root}/{e}/type") as f:
                kind = f.read().strip()
            with open(f"{root}/{e}/size") as f:
                size = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        kib = int(size[:-1]) * (1024 if size.endswith("M") else 1) if size[-1] in "KM" \
            else int(size) // 1024
        out[{1: "l1d_kib", 2: "l2_kib", 3: "l3_kib"}.get(level, "other")] = kib
    out.pop("other", None)
    return out


# Caches assumed when a preset names none and the host's cannot be read (or the code is for
# another machine): a typical AVX2 / AVX-512 / Neoverse core.
DEFAULT_CACHES = {"l1d_kib": 32, "l2_kib": 1024, "l3_kib": 0}


def host_cpu_model() -> str:
    """The CPU's model name as the OS reports it (lscpu's "Model name"), or ""."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model name")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def host_features() -> tuple:
    """This CPU's features as LLVM names them (asked once per process)."""
    from mhagen.runtime import prepare_tvm_threads
    prepare_tvm_threads()
    import tvm
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    t = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    return tuple(sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(t)))


def _vector_bits(features) -> int:
    if "avx512f" in features:
        return 512
    if "avx2" in features or "avx" in features:
        return 256
    return 128


def vector_registers(arch: str, features) -> int:
    """Architectural vector registers when a preset does not say: 32 on aarch64 (v0-v31 /
    z0-z31) and with AVX-512 (zmm0-31), else 16 (x86 AVX2/SSE)."""
    return 32 if arch == "aarch64" or "avx512f" in features else 16


def resolve(target) -> Target:
    """A preset name ("x86") or a Target -> a resolved Target for this build."""
    if isinstance(target, Target):
        return target
    from mhagen.runtime import prepare_tvm_threads
    from mhagen.targets import load_preset, preset_names
    prepare_tvm_threads()
    if not isinstance(target, str):
        raise TargetError(f"target must be a preset name, got {target!r}; presets: "
                          f"{', '.join(preset_names())}")
    try:
        preset = load_preset(target)
    except KeyError:
        raise TargetError(f"unknown target {target!r}; choose one of: "
                          f"{', '.join(preset_names())}") from None
    import tvm
    tvm_dict = dict(preset["tvm"])
    if tvm_dict.get("mcpu") == "host":
        if preset["arch"] != host_arch():
            raise TargetError(f"target {target!r} means this machine's CPU, but this machine is "
                              f"{host_arch()}, not {preset['arch']}; pick a named-CPU preset")
        tvm_dict["mcpu"] = str(tvm.target.codegen.llvm_get_system_cpu())
        if tvm_dict["mcpu"] in ("generic", ""):
            raise TargetError("LLVM does not recognise this CPU; use a named preset such as "
                              "x86-avx2 instead of the host preset")
    cores = host_cores() if preset.get("cores", "host") == "host" else int(preset["cores"])
    tvm_dict["num-cores"] = cores
    features = tuple(sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(
        tvm.target.Target(tvm_dict))))
    bits = preset.get("vector_bits") or _vector_bits(features)
    registers = preset.get("vector_registers") or vector_registers(preset["arch"], features)
    # caches: the preset's, else this machine's when the code is for this machine's arch
    caches = dict(DEFAULT_CACHES)
    if preset["arch"] == host_arch():
        caches.update(host_caches())
    caches.update({k: int(preset[k]) for k in DEFAULT_CACHES if preset.get(k)})
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in tvm_dict.items()))
    return Target(preset["name"], frozen,
                  preset["arch"], cores, int(bits), features, preset.get("cross_compiler"),
                  int(registers), cpu=str(tvm_dict.get("mcpu", "")), **caches)
