"""Facts about this machine (leaf module: the standard library and numpy, no TVM):
architecture, usable cores, caches, CPU model, and the CPU features that decide whether
compiled code runs here (those the kernel lists in /proc/cpuinfo that the CPU itself reports
too, as the C API asks the CPU)."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
from typing import NamedTuple

# Caches assumed when a preset names none and the host's cannot be read (or the code is for
# another machine): a typical AVX2 / AVX-512 / Neoverse core.
DEFAULT_CACHES = {"l1d_kib": 32, "l2_kib": 1024, "l3_kib": 0}

class Feature(NamedTuple):
    """How to tell whether this CPU has one feature: the flag the Linux kernel lists in
    /proc/cpuinfo (x86 "flags", aarch64 "Features"); the name numpy's CPU dispatch gives it
    ("" where numpy does not detect it; numpy asks the CPU: CPUID and XGETBV on x86,
    AT_HWCAP on aarch64); and how the C API's mha_create asks the CPU itself
    (runtime/mha_cpu.h): x86 (CPUID leaf, subleaf, register 0-3 = eax..edx, bit, the XCR0
    state the OS must have enabled, 0: none), aarch64 (the AT_HWCAP bit,)."""
    cpuinfo: str
    numpy: str
    probe: tuple


EAX, EBX, ECX, EDX = range(4)
AVX_STATE, AVX512_STATE = 0x06, 0xE6    # XCR0: xmm, ymm; and the opmask and zmm state
AMX_STATE = 0x60000                     # XCR0: AMX's tile configuration and tile data
_EXT = 0x80000001                       # AMD's extended leaf

# The features compiled code may need, by the name LLVM gives them. x86: every extension
# an -mcpu lets LLVM's code generator use (it picks instructions from all of them: a
# bfloat16 layer built for Zen 4 runs AVX-512 BF16 vdpbf16ps, and it listed only AVX-512
# F/BW/DQ/VL), so code for one CPU needs all of that CPU's; extensions reachable only
# through intrinsics mhagen never writes (AES, SHA, AMX-INT8, ...) are left out; AMX-TILE
# and AMX-BF16 are in: bfloat16 GEMMs run on them (schedules/x86/amx.py). aarch64: NEON
# and SVE (the NEON presets' half-precision code uses only base NEON conversions; checked
# in tests/test_arm.py).
X86_FEATURES = {
    "ssse3": Feature("ssse3", "SSSE3", (1, 0, ECX, 9, 0)),
    "sse4.1": Feature("sse4_1", "SSE41", (1, 0, ECX, 19, 0)),
    "sse4.2": Feature("sse4_2", "SSE42", (1, 0, ECX, 20, 0)),
    "popcnt": Feature("popcnt", "POPCNT", (1, 0, ECX, 23, 0)),
    "movbe": Feature("movbe", "MOVBE", (1, 0, ECX, 22, 0)),
    "lzcnt": Feature("abm", "LZCNT", (_EXT, 0, ECX, 5, 0)),
    "bmi": Feature("bmi1", "BMI", (7, 0, EBX, 3, 0)),
    "bmi2": Feature("bmi2", "BMI2", (7, 0, EBX, 8, 0)),
    "avx": Feature("avx", "AVX", (1, 0, ECX, 28, AVX_STATE)),
    "f16c": Feature("f16c", "F16C", (1, 0, ECX, 29, AVX_STATE)),
    "fma": Feature("fma", "FMA3", (1, 0, ECX, 12, AVX_STATE)),
    "avx2": Feature("avx2", "AVX2", (7, 0, EBX, 5, AVX_STATE)),
    "fma4": Feature("fma4", "FMA4", (_EXT, 0, ECX, 16, AVX_STATE)),
    "xop": Feature("xop", "XOP", (_EXT, 0, ECX, 11, AVX_STATE)),
    # AMD only: LLVM writes SSE4a's insertq/extrq for shuffles in code for Zen (a bfloat16
    # layer for znver4 had insertq: SIGILL on an Intel Xeon with every other feature)
    "sse4a": Feature("sse4a", "", (_EXT, 0, ECX, 6, 0)),
    "tbm": Feature("tbm", "", (_EXT, 0, ECX, 21, 0)),
    "gfni": Feature("gfni", "GFNI", (7, 0, ECX, 8, 0)),
    "vaes": Feature("vaes", "VAES", (7, 0, ECX, 9, AVX_STATE)),
    "vpclmulqdq": Feature("vpclmulqdq", "VPCLMULQDQ", (7, 0, ECX, 10, AVX_STATE)),
    "avx512f": Feature("avx512f", "AVX512F", (7, 0, EBX, 16, AVX512_STATE)),
    "avx512dq": Feature("avx512dq", "AVX512DQ", (7, 0, EBX, 17, AVX512_STATE)),
    "avx512ifma": Feature("avx512ifma", "AVX512IFMA", (7, 0, EBX, 21, AVX512_STATE)),
    "avx512cd": Feature("avx512cd", "AVX512CD", (7, 0, EBX, 28, AVX512_STATE)),
    "avx512bw": Feature("avx512bw", "AVX512BW", (7, 0, EBX, 30, AVX512_STATE)),
    "avx512vl": Feature("avx512vl", "AVX512VL", (7, 0, EBX, 31, AVX512_STATE)),
    "avx512vbmi": Feature("avx512vbmi", "AVX512VBMI", (7, 0, ECX, 1, AVX512_STATE)),
    "avx512vbmi2": Feature("avx512_vbmi2", "AVX512VBMI2", (7, 0, ECX, 6, AVX512_STATE)),
    "avx512vnni": Feature("avx512_vnni", "AVX512VNNI", (7, 0, ECX, 11, AVX512_STATE)),
    "avx512bitalg": Feature("avx512_bitalg", "AVX512BITALG", (7, 0, ECX, 12, AVX512_STATE)),
    "avx512vpopcntdq": Feature("avx512_vpopcntdq", "AVX512VPOPCNTDQ",
                               (7, 0, ECX, 14, AVX512_STATE)),
    "avx512fp16": Feature("avx512_fp16", "AVX512FP16", (7, 0, EDX, 23, AVX512_STATE)),
    "avx512bf16": Feature("avx512_bf16", "AVX512BF16", (7, 1, EAX, 5, AVX512_STATE)),
    "avxvnni": Feature("avx_vnni", "", (7, 1, EAX, 4, AVX_STATE)),
    "amx-tile": Feature("amx_tile", "", (7, 0, EDX, 24, AMX_STATE)),
    "amx-bf16": Feature("amx_bf16", "", (7, 0, EDX, 22, AMX_STATE))}
AARCH64_FEATURES = {
    "neon": Feature("asimd", "ASIMD", (1,)),      # HWCAP_ASIMD
    "sve": Feature("sve", "SVE", (22,))}          # HWCAP_SVE
FEATURES_OF_ARCH = {"x86_64": X86_FEATURES, "aarch64": AARCH64_FEATURES}
RUNTIME_FEATURES = {**X86_FEATURES, **AARCH64_FEATURES}


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def usable_cpus() -> list:
    """The logical CPUs this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def host_cores(sysfs: str = "/sys/devices/system/cpu") -> int:
    """The physical cores among the usable CPUs: SMT siblings (two hardware threads of one
    core, Linux's thread_siblings_list) count once. mhagen runs one TVM thread per core, as
    ONNX Runtime, PyTorch (MKL) and TVM's own default do: siblings share the core's FMA
    units and its L1/L2, which the cache blocking assumes one thread has. Where sysfs does
    not say, every usable CPU counts."""
    cpus, cores = usable_cpus(), set()
    for cpu in cpus:
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return len(cpus)
    return max(1, len(cores))


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
    return {f: bool(found[feat.numpy]) for f, feat in RUNTIME_FEATURES.items()
            if feat.numpy in found}


# x86-64 machine code (System V ABI) for the two instructions the C API's check runs:
# void cpuid(unsigned leaf, unsigned subleaf, unsigned out[4]) -- out = eax, ebx, ecx, edx
_CPUID = bytes.fromhex("53" "4989d0" "89f8" "89f1" "0fa2" "418900" "41895804" "41894808"
                       "4189500c" "5b" "c3")
# unsigned long long xgetbv0(void) -- XCR0
_XGETBV = bytes.fromhex("31c9" "0f01d0" "48c1e220" "4809d0" "c3")


@functools.lru_cache(maxsize=None)
def _x86_instructions():
    """(cpuid, xgetbv) as ctypes functions over a page of the code above, or None where
    this is not x86-64 Linux or the OS refuses to make a page executable."""
    if host_arch() != "x86_64" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if page in (None, ctypes.c_void_p(-1).value):
            return None
        ctypes.memmove(page, _CPUID, len(_CPUID))
        ctypes.memmove(page + 64, _XGETBV, len(_XGETBV))
        if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return None
    except (OSError, AttributeError):
        return None
    cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint, ctypes.c_uint,
                             ctypes.POINTER(ctypes.c_uint))(page)
    xgetbv = ctypes.CFUNCTYPE(ctypes.c_ulonglong)(page + 64)
    return cpuid, xgetbv


def cpuid_features() -> dict:
    """{LLVM name: bool} for every X86_FEATURES entry, asked of the CPU exactly as the C
    API's mha_create asks it (runtime/mha_cpu.h: the CPUID bit, a leaf beyond the CPU's
    highest reads as absent, the register state enabled in XCR0); empty off x86-64 Linux or
    where the OS refuses executable memory. numpy detects no AVX-VNNI: under qemu -cpu
    SandyBridge on an AVX-VNNI host, trusting /proc/cpuinfo for it built +avxvnni, which
    implies AVX2, for a CPU without AVX2."""
    code = _x86_instructions()
    if code is None:
        return {}
    cpuid, xgetbv = code

    def regs(leaf, subleaf=0):
        out = (ctypes.c_uint * 4)()
        cpuid(leaf, subleaf, out)
        return list(out)

    highest = {0: regs(0)[0], 0x80000000: regs(0x80000000)[0]}
    osxsave = bool(regs(1)[ECX] >> 27 & 1)
    xcr0 = xgetbv() if osxsave else 0

    def has(leaf, subleaf, reg, bit, state):
        if leaf > highest[leaf & 0x80000000] or not regs(leaf, subleaf)[reg] >> bit & 1:
            return False
        return state == 0 or (osxsave and xcr0 & state == state)

    return {f: has(*feat.probe) for f, feat in X86_FEATURES.items()}


@functools.lru_cache(maxsize=None)
def runtime_features() -> tuple:
    """The RUNTIME_FEATURES this CPU has, by their LLVM names: listed by the kernel and not
    denied by the CPU (asked through CPUID as the C API asks it, and numpy's detection).
    They disagree where a process runs on another CPU than the one /proc/cpuinfo
    describes: under qemu-x86_64 -cpu EPYC (an AVX2-only Zen 1) the file still lists the
    host's AVX-512, and trusting it alone ran AVX-512 code into SIGILL. Where neither CPUID
    nor numpy can be asked about a feature, the kernel's list stands."""
    listed = set(_cpuinfo_field("flags", "Features").split())
    reported, asked = cpu_reported_features(), cpuid_features()
    return tuple(sorted(f for f, feat in RUNTIME_FEATURES.items()
                        if feat.cpuinfo in listed and reported.get(f, True)
                        and asked.get(f, True)))


def missing_features(arch: str, required) -> list:
    """Which of `required` (LLVM names) code for `arch` needs that this machine lacks; code of
    another architecture lacks nothing here (it cannot run at all: see can_run)."""
    if arch != host_arch():
        return []
    return sorted(set(f for f in required if f in RUNTIME_FEATURES) - set(runtime_features()))


def cannot_run_reason(arch: str, required, what: str) -> str | None:
    """None when code for `arch` needing `required` runs here, else why not. Code using
    AMX asks Linux for the tile state first (amx_permitted)."""
    if arch != host_arch():
        return f"{what} is {arch} code; this machine is {host_arch()}: run it on a {arch} machine"
    missing = missing_features(arch, required)
    if missing:
        return (f"{what} needs CPU features {', '.join(missing)} that this machine lacks "
                "(an instruction it lacks would kill the process with SIGILL)")
    if "amx-tile" in required and not amx_permitted():
        return (f"{what} runs AMX tiles, and Linux refused this process their state "
                "(arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it): build the "
                "layer for a target without amx-tile (e.g. x86-avx512)")
    return None


@functools.lru_cache(maxsize=None)
def amx_permitted() -> bool:
    """Whether this process may use AMX tiles: Linux (5.16+) enables their 8 KiB of state
    per process on request (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); without
    it the first tile instruction raises SIGILL. Asked once; granted for the process."""
    if host_arch() != "x86_64" or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0
    except (OSError, AttributeError):
        return False
