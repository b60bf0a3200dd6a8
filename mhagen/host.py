"""Facts about this machine (leaf module: the standard library and numpy, no TVM):
architecture, usable cores, caches, CPU model, and the CPU features that decide whether
compiled code runs here (those the kernel lists in /proc/cpuinfo that the CPU itself reports
too, as the C API asks the CPU)."""
from __future__ import annotations

import functools
import os
import platform

# Caches assumed when a preset names none and the host's cannot be read (or the code is for
# another machine): a typical AVX2 / AVX-512 / Neoverse core.
DEFAULT_CACHES = {"l1d_kib": 32, "l2_kib": 1024, "l3_kib": 0}

# The features compiled code may need, by the name LLVM gives them -> (the name the Linux
# kernel lists in /proc/cpuinfo: x86 "flags", aarch64 "Features"; the name numpy's CPU
# dispatch gives it: numpy asks the CPU, CPUID and the register state the OS enabled,
# XGETBV, on x86, AT_HWCAP on aarch64). x86: the vector extensions of every class (SSE4 for
# SSE-only builds, AVX for Sandy Bridge, AVX2/FMA, AVX-512) and the scalar ones LLVM uses
# with them (POPCNT, BMI1/2, F16C's conversions for half precision).
RUNTIME_FEATURES = {
    "ssse3": ("ssse3", "SSSE3"), "sse4.1": ("sse4_1", "SSE41"), "sse4.2": ("sse4_2", "SSE42"),
    "popcnt": ("popcnt", "POPCNT"), "avx": ("avx", "AVX"), "f16c": ("f16c", "F16C"),
    "bmi": ("bmi1", "BMI"), "bmi2": ("bmi2", "BMI2"), "avx2": ("avx2", "AVX2"),
    "fma": ("fma", "FMA3"), "avx512f": ("avx512f", "AVX512F"),
    "avx512bw": ("avx512bw", "AVX512BW"), "avx512dq": ("avx512dq", "AVX512DQ"),
    "avx512vl": ("avx512vl", "AVX512VL"), "neon": ("asimd", "ASIMD"), "sve": ("sve", "SVE")}


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _read_cache(entry: str):
    """(level, KiB) of one sysfs cache entry, or None (instruction cache, unreadable)."""
    try:
        with open(f"{entry}/level") as f:
            level = int(f.read())
        with open(f"{entry}/type") as f:
            kind = f.read().strip()
        with open(f"{entry}/size") as f:
            size = f.read().strip().upper()
    except (OSError, ValueError):
        return None
    if kind == "Instruction" or not size:
        return None
    if size[-1] in "KM":
        return level, int(size[:-1]) * (1024 if size.endswith("M") else 1)
    return level, int(size) // 1024


def host_caches() -> dict:
    """This machine's caches in KiB as {"l1d_kib", "l2_kib", "l3_kib"} (Linux sysfs, cpu0;
    empty where sysfs does not say)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return {}
    names = {1: "l1d_kib", 2: "l2_kib", 3: "l3_kib"}
    found = (_read_cache(f"{root}/{e}") for e in entries)
    return {names[level]: kib for level, kib in filter(None, found) if level in names}


def _cpuinfo_field(*keys: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def host_cpu_model() -> str:
    """The CPU's model name as the OS reports it (lscpu's "Model name"), or ""."""
    return _cpuinfo_field("model name", "Model name")


def cpu_reported_features() -> dict:
    """{LLVM name: bool} for the RUNTIME_FEATURES the CPU itself reports, as numpy's CPU
    dispatch detected them at import; empty where numpy does not say."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as found
    except ImportError:     # pragma: no cover - numpy < 2
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as found
        except ImportError:
            return {}
    return {f: bool(found[name]) for f, (_, name) in RUNTIME_FEATURES.items() if name in found}


@functools.lru_cache(maxsize=None)
def runtime_features() -> tuple:
    """The RUNTIME_FEATURES this CPU has, by their LLVM names: listed by the kernel and not
    denied by the CPU. The two disagree where a process runs on another CPU than the one
    /proc/cpuinfo describes: under qemu-x86_64 -cpu EPYC (an AVX2-only Zen 1) the file still
    lists the host's AVX-512, and trusting it alone ran AVX-512 code into SIGILL."""
    listed = set(_cpuinfo_field("flags", "Features").split())
    reported = cpu_reported_features()
    return tuple(sorted(f for f, (name, _) in RUNTIME_FEATURES.items()
                        if name in listed and reported.get(f, True)))


def missing_features(arch: str, required) -> list:
    """Which of `required` (LLVM names) code for `arch` needs that this machine lacks; code of
    another architecture lacks nothing here (it cannot run at all: see can_run)."""
    if arch != host_arch():
        return []
    return sorted(set(f for f in required if f in RUNTIME_FEATURES) - set(runtime_features()))


def cannot_run_reason(arch: str, required, what: str) -> str | None:
    """None when code for `arch` needing `required` runs here, else why not."""
    if arch != host_arch():
        return f"{what} is {arch} code; this machine is {host_arch()}: run it on a {arch} machine"
    missing = missing_features(arch, required)
    if missing:
        return (f"{what} needs CPU features {', '.join(missing)} that this machine lacks "
                "(an instruction it lacks would kill the process with SIGILL)")
    return None
