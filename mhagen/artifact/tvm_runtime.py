"""TVM's runtime as the C API links it (leaf module: standard library only).

libmha.so links TVM's two runtime libraries and compiles against the tvm-ffi headers. TVM's
wheels lay them out as below; the host's come from the installed packages (find_tvm_runtime),
another architecture's from that architecture's wheels (mhagen.artifact.other_arch, which
extracts the same paths).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

# library name -> its path inside TVM's wheels (package/relative path)
RUNTIME_FILES = {"libtvm_ffi.so": "tvm_ffi/lib/libtvm_ffi.so",
                 "libtvm_runtime.so": "tvm/lib/libtvm_runtime.so"}
RUNTIME_LIBS = tuple(RUNTIME_FILES)          # in link order
INCLUDE_DIR = "tvm_ffi/include"              # the tvm-ffi headers (and dlpack) in the wheel
PROBE_HEADER = "tvm/ffi/extra/module.h"      # a header the C API includes: proves the dir


def find_tvm_runtime():
    """(include_dir, (libtvm_ffi.so, libtvm_runtime.so)) of the installed wheels, without
    importing TVM; or a string saying what is missing."""
    roots = {}
    for rel in (*RUNTIME_FILES.values(), INCLUDE_DIR):
        pkg = rel.split("/", 1)[0]
        if pkg in roots:
            continue
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            return f"the {pkg} package is not installed"
        roots[pkg] = Path(list(spec.submodule_search_locations)[0]).parent

    def installed(rel):
        return roots[rel.split("/", 1)[0]] / rel
    include = installed(INCLUDE_DIR)
    libs = tuple(installed(rel) for rel in RUNTIME_FILES.values())
    for p in (include / PROBE_HEADER, *libs):
        if not p.exists():
            return f"TVM runtime file {p} is missing"
    return include, libs
