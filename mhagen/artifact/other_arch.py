"""Builds for another architecture (cross-compiling: aarch64 kernels built and checked on this
machine).

One table, ARCHES, says per architecture what such a build needs -- the cross compilers and
binutils, the target's C library (to link, and for qemu), the emulator, the Debian packages
that provide them, the PyPI platform tag of TVM's runtime wheels -- so no code below tests a
target's name.

  export_options(target)     export_library options: the cross g++ for a foreign target;
                             TargetError naming the packages to install when it is missing
  fetch_runtime(arch)        download the apache-tvm / apache-tvm-ffi wheels for that arch (the
                             versions installed here) and keep libtvm_ffi.so, libtvm_runtime.so
                             and the tvm-ffi headers in the cache
  runtime(arch)              those files from the cache, or a string saying how to get them
  compile_app(...)           cross-compile a C program against an artifact (the one-line build
                             of examples/c_app/README.md with the cross cc)
  run(argv, ...)             run a program of that arch under qemu-user

The cache is $MHAGEN_CACHE/<arch>/tvm-<tvm>-ffi-<tvm-ffi>/ (default $XDG_CACHE_HOME/mhagen or
~/.cache/mhagen): include/, lib/libtvm_ffi.so, lib/libtvm_runtime.so, wheels.json.
`python -m mhagen.artifact.other_arch fetch aarch64` fills it (about 100 MB of download, 6 MB
kept).
mhagen.artifact.toolchain.Toolchain.for_arch(arch) builds an artifact's C API with the cross
compiler and these files. Imports of this package: tvm_runtime only.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from mhagen.artifact.tvm_runtime import INCLUDE_DIR, PROBE_HEADER, RUNTIME_FILES, RUNTIME_LIBS
from mhagen.errors import TargetError
from mhagen.target import host_arch


@dataclass(frozen=True)
class Arch:
    triple: str
    cc: str                 # cross C compiler (apps)
    cxx: str                # cross C++ compiler (kernel.so, libmha.so)
    objdump: str
    sysroot: str            # the target's C library: qemu's -L
    qemu: str
    packages: tuple         # Debian packages of the cross toolchain
    emulator_packages: tuple
    wheel_platform: str     # pip download --platform (TVM's wheels are manylinux_2_28)


ARCHES = {
    "aarch64": Arch(triple="aarch64-linux-gnu", cc="aarch64-linux-gnu-gcc",
                    cxx="aarch64-linux-gnu-g++", objdump="aarch64-linux-gnu-objdump",
                    sysroot="/usr/aarch64-linux-gnu", qemu="qemu-aarch64",
                    packages=("gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu",
                              "libc6-dev-arm64-cross"),
                    emulator_packages=("qemu-user",),
                    wheel_platform="manylinux_2_28_aarch64"),
}


def arch_info(arch: str) -> Arch:
    try:
        return ARCHES[arch]
    except KeyError:
        raise TargetError(f"mhagen cannot cross-build for {arch}; it knows "
                          f"{', '.join(sorted(ARCHES))}") from None


def install_hint(arch: str, emulator: bool = False) -> str:
    a = arch_info(arch)
    pkgs = a.packages + (a.emulator_packages if emulator else ())
    return (f"install them with: sudo apt-get install -y {' '.join(pkgs)}  (Debian/Ubuntu; "
            ".ci/setup-arm.sh does this)")


def _is_other_arch(target) -> bool:
    return target.arch != host_arch()


def target_compiler(target) -> str:
    """The path of the C++ compiler that links `target`'s code; TargetError if missing."""
    a = arch_info(target.arch)
    cxx = target.cross_compiler or a.cxx
    path = shutil.which(cxx)
    if path is None:
        raise TargetError(f"building for {target.name} ({target.arch}) needs the cross compiler "
                          f"{cxx}, which is not installed; {install_hint(target.arch)}")
    return path


def export_options(target) -> dict:
    """Keyword arguments for Executable.export_library: {} for this machine's code, else the
    cross compiler as fcompile."""
    if not _is_other_arch(target):
        return {}
    from tvm.support import cc
    return {"fcompile": cc.cross_compiler(target_compiler(target))}


# -- TVM's runtime for the other architecture ------------------------------------------------
def cache_root() -> Path:
    root = os.environ.get("MHAGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mhagen")
    return Path(root)


def _versions() -> tuple:
    return version("apache-tvm"), version("apache-tvm-ffi")


def runtime_dir(arch: str) -> Path:
    tvm_v, ffi_v = _versions()
    return cache_root() / arch / f"tvm-{tvm_v}-ffi-{ffi_v}"


def runtime(arch: str):
    """(include_dir, (libtvm_ffi.so, libtvm_runtime.so)) for `arch` from the cache, or a
    string saying how to fetch them."""
    d = runtime_dir(arch)
    libs = tuple(d / "lib" / n for n in RUNTIME_LIBS)
    header = d / "include" / PROBE_HEADER
    if all(p.is_file() for p in (header, *libs)):
        return d / "include", libs
    return (f"no {arch} TVM runtime in {d} (fetch it once: python -m "
            f"mhagen.artifact.other_arch fetch {arch}; then save the module again)")


def fetch_runtime(arch: str, *, quiet: bool = True):
    """Download this TVM's and tvm-ffi's wheels for `arch` from PyPI (pip download) and keep
    the runtime libraries and headers in the cache; returns runtime(arch). Does nothing when
    they are already there."""
    found = runtime(arch)
    if not isinstance(found, str):
        return found
    a = arch_info(arch)
    tvm_v, ffi_v = _versions()
    dest = runtime_dir(arch)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
               "--platform", a.wheel_platform,
               "--python-version", f"{sys.version_info.major}{sys.version_info.minor}",
               "-d", tmp, f"apache-tvm=={tvm_v}", f"apache-tvm-ffi=={ffi_v}"]
        r = subprocess.run(cmd + (["-q"] if quiet else []), capture_output=quiet, text=True)
        if r.returncode != 0:
            raise TargetError(f"could not download TVM's {arch} wheels ({' '.join(cmd)}):\n"
                              f"{(r.stderr or '')[-2000:]}")
        staging = Path(tmp) / "runtime"
        wheels = {}
        for whl in sorted(Path(tmp).glob("*.whl")):
            wheels[whl.name] = _extract(whl, staging)
        found = [p for p in (staging / "lib" / n for n in RUNTIME_LIBS) if p.is_file()]
        if len(found) != len(RUNTIME_LIBS) or not (staging / "include" / "tvm").is_dir():
            raise TargetError(f"TVM's {arch} wheels {sorted(wheels)} lack {RUNTIME_LIBS} or the "
                              "tvm-ffi headers")
        (staging / "wheels.json").write_text(json.dumps(
            {"arch": arch, "platform": a.wheel_platform, "wheels": wheels}, indent=1))
        if dest.exists() and isinstance(runtime(arch), str):
            shutil.rmtree(dest)          # an incomplete or outdated cache
        try:
            staging.rename(dest)
        except OSError:                  # another process (a test worker) was first: use its
            if isinstance(runtime(arch), str):
                raise
    return runtime(arch)


def _extract(wheel: Path, staging: Path) -> list:
    """Copy TVM's runtime libraries and the tvm-ffi headers (tvm_runtime.RUNTIME_FILES,
    INCLUDE_DIR) out of a wheel into staging/lib and staging/include; returns what was taken."""
    taken = set()
    libs = {rel: name for name, rel in RUNTIME_FILES.items()}
    include = INCLUDE_DIR + "/"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name in libs:
                out, what = staging / "lib" / libs[name], name
            elif name.startswith(include) and not info.is_dir():
                out, what = staging / "include" / name[len(include):], include
            else:
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            taken.add(what)
    return sorted(taken)


# -- building and running programs -----------------------------------------------------------
def compile_app(source, artifact_dir, output, arch: str = "aarch64", extra=()) -> Path:
    """Cross-compile a C (or C++, by suffix) program against the artifact in artifact_dir:
    cc -O2 SRC -I DIR -L DIR -lmha -Wl,-rpath,DIR -o OUTPUT (DIR absolute)."""
    a = arch_info(arch)
    source, artifact_dir = Path(source), Path(artifact_dir).resolve()
    compiler = a.cxx if source.suffix in (".cc", ".cpp", ".cxx") else a.cc
    if shutil.which(compiler) is None:
        raise TargetError(f"cross-compiling {source.name} needs {compiler}; {install_hint(arch)}")
    cmd = [compiler, "-O2", str(source), f"-I{artifact_dir}", f"-L{artifact_dir}", "-lmha",
           f"-Wl,-rpath,{artifact_dir}", *extra, "-o", str(output)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise TargetError(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    return Path(output)


@functools.lru_cache(maxsize=None)
def _qemu_cpus(qemu: str) -> frozenset:
    out = subprocess.run([qemu, "-cpu", "help"], capture_output=True, text=True).stdout
    return frozenset(w for line in out.splitlines()[1:] for w in line.split()[:1])


def qemu_cpu(mcpu, features, vector_bits, arch: str = "aarch64") -> str:
    """The qemu -cpu that emulates a target: its own CPU model when qemu has it (cortex-a72,
    neoverse-n1: no SVE, so a stray SVE instruction traps), else `max`, with the SVE vector
    length set to the target's (sveN=on) when the target uses SVE."""
    qemu = require_emulator(arch)
    if mcpu in _qemu_cpus(qemu) and "sve" not in features:
        return mcpu
    return f"max,sve{vector_bits}=on" if "sve" in features else "max"


def require_emulator(arch: str) -> str:
    a = arch_info(arch)
    qemu = shutil.which(a.qemu)
    if qemu is None or not Path(a.sysroot, "lib").is_dir():
        missing = a.qemu if qemu is None else f"the {arch} C library ({a.sysroot})"
        raise TargetError(f"running {arch} code here needs {missing}; "
                          f"{install_hint(arch, emulator=True)}")
    return qemu


def run(argv, arch: str = "aarch64", *, cpu: str = "max", timeout: float = 300, env=None,
        cwd=None) -> subprocess.CompletedProcess:
    """Run an `arch` program under qemu-user: qemu -L <sysroot> -cpu CPU argv..."""
    a = arch_info(arch)
    cmd = [require_emulator(arch), "-L", a.sysroot, "-cpu", cpu, *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def disassemble(path, arch: str = "aarch64") -> str:
    """objdump -d of an object or library of `arch`."""
    a = arch_info(arch)
    if shutil.which(a.objdump) is None:
        raise TargetError(f"disassembling {arch} code needs {a.objdump}; {install_hint(arch)}")
    return subprocess.run([a.objdump, "-d", str(path)], capture_output=True, text=True,
                          check=True).stdout


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m mhagen.artifact.other_arch",
                                description="Cross-build support: fetch TVM's runtime for "
                                            "another architecture into the cache.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download TVM's runtime libraries for ARCH")
    f.add_argument("arch", nargs="?", default="aarch64", choices=sorted(ARCHES))
    sub.add_parser("where", help="print the cache directory")
    args = p.parse_args(argv)
    if args.command == "where":
        print(cache_root())
        return 0
    try:
        include, libs = fetch_runtime(args.arch, quiet=False)
    except TargetError as err:
        print(f"mhagen.artifact.other_arch: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.arch} TVM runtime: {', '.join(map(str, libs))}\nheaders: {include}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
