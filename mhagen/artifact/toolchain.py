"""What compiles an artifact's C API: a C++17 compiler, the tvm-ffi headers and TVM's runtime
libraries for the artifact's architecture -- this machine's (Toolchain.host) or another
architecture's through other_arch.py (Toolchain.for_arch: a toolchain for another architecture).

Imports: other_arch and the leaf tvm_runtime; nothing here imports the C API generator, and
other_arch imports nothing of this package but tvm_runtime.
"""
from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from mhagen.artifact import other_arch
from mhagen.artifact.tvm_runtime import find_tvm_runtime
from mhagen.errors import TargetError


def _which(program):
    return shutil.which(program)


@dataclass(frozen=True)
class Toolchain:
    """What compiles and links libmha.so: a C++17 compiler, the tvm-ffi headers and TVM's
    runtime libraries for the artifact's architecture."""
    cxx: str
    include_dir: Path
    runtime_libs: tuple          # paths of libtvm_ffi.so, libtvm_runtime.so

    @staticmethod
    def host(cxx: str | None = None) -> "Toolchain | str":
        """This machine's toolchain, or a string saying why there is none."""
        cxx = cxx or os.environ.get("CXX") or "g++"
        if _which(shlex.split(cxx)[0]) is None:
            return f"no C++ compiler ({cxx!r} not found; set CXX)"
        found = find_tvm_runtime()
        if isinstance(found, str):
            return found
        include, libs = found
        return Toolchain(cxx, include, libs)

    @staticmethod
    def for_arch(arch: str, cxx: str | None = None) -> "Toolchain | str":
        """The cross toolchain for `arch` (e.g. aarch64-linux-gnu-g++ and the aarch64 TVM
        runtime from mhagen's cache, see other_arch.py), or a string saying why there is none."""
        try:
            a = other_arch.arch_info(arch)
        except TargetError as err:
            return str(err)
        cxx = cxx or a.cxx
        if _which(shlex.split(cxx)[0]) is None:
            return f"{arch} C API needs the cross compiler {cxx}; {other_arch.install_hint(arch)}"
        found = other_arch.runtime(arch)
        if isinstance(found, str):
            return found
        include, libs = found
        return Toolchain(cxx, include, libs)
