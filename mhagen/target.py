"""Resolve a target preset (targets/*.json) into what rules and the compiler read.

Rules read attributes (vector_bits, cores, features), never target names.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import asdict, dataclass, fields

from mhagen import host
from mhagen.backends import FAMILY_OF_ARCH, Backend
from mhagen.errors import TargetError
from mhagen.host import DEFAULT_CACHES, host_arch, host_caches, host_cores, host_cpu_model  # noqa: F401
from mhagen.runtime import prepare_tvm_threads
from mhagen.targets import load_preset, preset_names



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
    family: str = ""             # the backend ("cpu-x86", "cpu-arm"): mhagen/backends.py
    device: str = "cpu"          # where the kernels run and their buffers live

    @property
    def lanes(self) -> int:
        """float32 lanes per vector register."""
        return self.vector_bits // 32

    def backend(self) -> Backend:
        """This target's backend (mhagen/backends.py), bound to it: the one place a target is
        mapped to its family's rules and templates (importing them: TVM). Entry points
        (build, tune, a module's precision) ask once and pass the backend down."""
        return Backend.for_target(self)

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
        kept per class; cache sizes pick the closest record within a class. AVX without FMA
        (Sandy/Ivy Bridge) shares the AVX2 class: the same 16 ymm registers and tiles; SSE
        only is "x86_64-v128-r16". A GPU's class is its architecture ("cuda-sm_90")."""
        if self.device != "cpu":
            return f"{self.arch}-{self.tvm_target_dict().get('arch', '')}"
        return f"{self.arch}-v{self.vector_bits}-r{self.vector_registers}"

    def runs_here(self) -> bool:
        return self.cannot_run() is None

    @property
    def machine_cpu(self) -> str:
        """The CPU (LLVM's name) whose tuning records suit this build best: this machine's
        as the host preset names it when the code runs here (a preset such as x86-avx2 on a
        Zen 4 runs on a Zen 4), else the CPU the code is compiled for."""
        if self.device == "cpu" and self.arch == host_arch() and self.runs_here():
            return host_cpu_name(self.arch)
        return self.cpu

    def missing_features(self) -> list:
        """CPU features this code needs that this machine lacks (empty: it runs here)."""
        return host.missing_features(self.arch, self.required_features())

    def cannot_run(self) -> str | None:
        """None when this machine can run this target's code, else why not."""
        if self.device == "cuda":
            what = f"this code ({self.name}, CUDA {self.tvm_target_dict().get('arch')})"
            why = cuda_driver_problem()
            if why:
                return f"{what} needs an NVIDIA GPU: {why}"
            return (f"{what} is compiled only: mhagen's runtime calls CPU kernels, calling "
                    "CUDA kernels (device buffers, launches) is not implemented yet")
        why = host.cannot_run_reason(self.arch, self.required_features(),
                                     f"this code ({self.name}, {self.cpu_class})")
        fallback = presets_that_run_here(self.arch) if why and self.arch == host_arch() else ""
        return f"{why}: build for target {fallback} instead" if fallback else why

    def check_runs_here(self) -> None:
        """Raise TargetError, naming what is missing, when this code cannot run here (an
        instruction this CPU lacks would kill the process with SIGILL)."""
        why = self.cannot_run()
        if why:
            raise TargetError(why)

    def required_features(self) -> tuple:
        return tuple(f for f in self.features if f in host.RUNTIME_FEATURES)

    @property
    def backend_family(self) -> str:
        return self.family or FAMILY_OF_ARCH.get(self.arch, self.arch)

    def to_dict(self) -> dict:
        """JSON-able fields (the manifest's "target"); from_dict is the inverse."""
        d = asdict(self)
        d["tvm"] = self.tvm_target_dict()
        del d["tvm_dict"]
        d.update(features=list(self.required_features()), all_features=list(self.features),
                 cpu_class=self.cpu_class, family=self.backend_family)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Target":
        """The Target a manifest's "target" describes (older manifests: defaults filled in)."""
        known = {f.name for f in fields(cls)} - {"tvm_dict", "features"}
        features = tuple(d.get("all_features") or d.get("features") or ())
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        kw.setdefault("vector_registers", vector_registers(d["arch"], features))
        for k, v in DEFAULT_CACHES.items():
            kw[k] = int(kw.get(k, v))
        tvm_dict = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                for k, v in d["tvm"].items()))
        return cls(tvm_dict=tvm_dict, features=features, **kw)

    def describe(self) -> str:
        d = self.tvm_target_dict()
        if self.device != "cpu":
            return (f"{self.name}: {d.get('kind')} {d.get('arch')}, {self.cores} SMs, "
                    f"{d.get('max_shared_memory_per_block')} bytes of shared memory per block, "
                    f"L2 {self.l2_kib} KiB")
        return (f"{self.name}: {d.get('mtriple')} cpu={d.get('mcpu')} vector={self.vector_bits} "
                f"bits, {self.vector_registers} vector registers, L1d {self.l1d_kib} KiB, "
                f"L2 {self.l2_kib} KiB, cores={self.cores}")


@functools.lru_cache(maxsize=None)
def cuda_driver_problem() -> str | None:
    """Why this machine cannot run CUDA code (no driver, no GPU); None when it has both."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "this machine has no CUDA driver (libcuda.so.1 not found)"
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "the CUDA driver finds no usable GPU (cuInit or cuDeviceGetCount failed)"
    if count.value == 0:
        return "the CUDA driver finds no GPU"
    return None


@functools.lru_cache(maxsize=None)
def host_llvm_cpu() -> str:
    """This CPU as LLVM names it ("znver4", "skylake-avx512")."""
    prepare_tvm_threads()
    import tvm
    return str(tvm.target.codegen.llvm_get_system_cpu())


def presets_that_run_here(arch: str) -> str:
    """The presets of `arch` with a "fallback" list whose features this machine has ("'x86'
    (this CPU) or 'x86-avx2'"; only 'x86' on a CPU without AVX2)."""
    names = []
    for name in preset_names():
        preset = load_preset(name)
        needs = preset.get("fallback")
        if preset["arch"] == arch and needs is not None and not host.missing_features(arch,
                                                                                      needs):
            this_cpu = preset["tvm"].get("mcpu") == "host"
            names.append(f"'{name}'" + (" (this CPU)" if this_cpu else ""))
    return " or ".join(names)


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
    prepare_tvm_threads()
    if not isinstance(target, str):
        raise TargetError(f"target must be a preset name, got {target!r}; presets: "
                          f"{', '.join(preset_names())}")
    try:
        preset = load_preset(target)
    except KeyError:
        raise TargetError(f"unknown target {target!r}; choose one of: "
                          f"{', '.join(preset_names())}") from None
    tvm_dict = dict(preset["tvm"])
    if tvm_dict["kind"] != "llvm":
        return _resolve_device(preset, tvm_dict)
    import tvm
    if tvm_dict.get("mcpu") == "host":
        if preset["arch"] != host_arch():
            raise TargetError(f"target {target!r} means this machine's CPU, but this machine is "
                              f"{host_arch()}, not {preset['arch']}; pick a named-CPU preset")
        tvm_dict = host_cpu(tvm_dict, preset["arch"])
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
                  int(registers), cpu=str(tvm_dict.get("mcpu", "")),
                  family=preset.get("family") or FAMILY_OF_ARCH.get(preset["arch"], ""),
                  device=preset.get("device", "cpu"), **caches)


# The x86-64 psABI levels as LLVM names them, best first, and the vector extensions that
# tell LLVM did not know a CPU when its name for it lacks one the CPU has.
X86_LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64")
CLASS_FEATURES = frozenset({"avx512f", "avx2", "fma", "avx", "sse4.2"})


def _checked_features(tvm_dict) -> set:
    """The features of an LLVM target that host.RUNTIME_FEATURES checks."""
    import tvm
    named = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target(tvm_dict))
    return {str(f) for f in named if str(f) in host.RUNTIME_FEATURES}


def host_cpu(tvm_dict, arch) -> dict:
    """The TVM target dict of this machine's CPU: LLVM's name for it, and -mattr turning off
    the checked features (host.RUNTIME_FEATURES) of that CPU this machine lacks (a
    hypervisor may hide some) and on the ones it has beyond that CPU, so the code needs
    exactly what this machine has. LLVM names a CPU by family and model; one it does not
    know gets an older CPU's name or "generic" (under qemu -cpu max, an AVX2 CPU was
    "k8-sse3" and got SSE3 code): there the best x86-64 level this machine reaches
    (x86-64-v3: AVX2, FMA; v4: AVX-512) stands in for the name."""
    have = set(host.runtime_features())
    d = dict(tvm_dict, mcpu=host_llvm_cpu())
    unknown = d["mcpu"] in ("generic", "")
    named = _checked_features(d)
    if arch == "x86_64" and (unknown or (have - named) & CLASS_FEATURES):
        for level in X86_LEVELS:      # best first; plain x86-64 checks nothing
            named = _checked_features(dict(d, mcpu=level))
            if named <= have:
                d["mcpu"] = level
                break
    elif unknown:
        raise TargetError("LLVM does not recognise this CPU; use a named preset instead of "
                          "the host preset")
    extra = [f"+{f}" for f in sorted(have - named)] + [f"-{f}" for f in sorted(named - have)]
    if extra:
        d["mattr"] = [*tvm_dict.get("mattr", []), *extra]
    return d


def host_cpu_name(arch) -> str:
    """This CPU as the host preset names it: LLVM's name, or on x86 the x86-64 level that
    stands in for a CPU LLVM does not know (host_cpu)."""
    if arch == "x86_64":
        return _x86_host_cpu_name(host_llvm_cpu(), tuple(sorted(host.runtime_features())))
    return host_llvm_cpu()


@functools.lru_cache(maxsize=None)
def _x86_host_cpu_name(llvm_cpu, features) -> str:
    """host_cpu's name for this CPU, kept per (LLVM's name, features): a tuning record
    lookup asks for it (0.17 ms a query to LLVM)."""
    return host_cpu({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}, "x86_64")["mcpu"]


def _resolve_device(preset, tvm_dict) -> Target:
    """A GPU preset: all it says is data (no LLVM feature query, no host facts)."""
    caches = dict(DEFAULT_CACHES)
    caches.update({k: int(preset[k]) for k in DEFAULT_CACHES if preset.get(k)})
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in tvm_dict.items()))
    return Target(preset["name"], frozen, preset["arch"], int(preset["cores"]),
                  int(preset.get("vector_bits") or 32), (), None,
                  int(preset.get("vector_registers") or 0), family=preset["family"],
                  device=preset["device"], **caches)
