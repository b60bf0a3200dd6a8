"""The C API's compiled libraries and TVM's runtime libraries, kept once in mhagen's cache.

Compiling the C API (mha_runtime.cc, two g++ runs for a CPU artifact) takes seconds; its
output depends only on the sources written into the artifact (the generated mha.h and
mha_config.h, the runtime sources), the compiler and its flags, and TVM's runtime it links.
BuildCache keys the outputs by the sha256 of all of these (the compiler by its resolved path
and `--version`), so a save of the same module (or any artifact whose generated sources are
byte-identical) copies the libraries instead of compiling them.

TVM's runtime libraries (about 6 MB) are the same for every artifact of one TVM install:
shared_runtime_libs() keeps one copy per content in the cache, and an artifact's lib/ holds
symbolic links to it unless it is saved self-contained (copies).

Layout, under mhagen.artifact.other_arch.cache_root() ($MHAGEN_CACHE, default ~/.cache/mhagen):
  capi/<key>/             the outputs of one C API build (libmha.so, lib/libmha_impl.so,
                          mha_libraries.h), written to a temporary directory first, then
                          renamed: two processes building the same key both succeed
  tvm-runtime/<digest>/   libtvm_ffi.so, libtvm_runtime.so (same atomic write)
A cache that cannot be written (read-only home) only costs time: the build runs in place and
the libraries are copied.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from mhagen.artifact.files import sha256_file
from mhagen.artifact.other_arch import cache_root

KEY_VERSION = 1      # bump when what the key covers changes


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def file_digest(path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for this process."""
    st = os.stat(path)
    return _digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def compiler_identity(cxx: str) -> str:
    """The compiler's resolved path and `--version` (what its output depends on)."""
    argv = shlex.split(cxx)
    exe = shutil.which(argv[0]) or argv[0]
    try:
        version = subprocess.run([*argv, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return f"{os.path.realpath(exe)} {' '.join(argv[1:])}\n{version}"


def build_key(directory: Path, sources: list, commands: list, toolchain) -> str:
    """The cache key of one C API build: its sources' bytes, the commands, the compiler,
    the tvm-ffi headers' directory and TVM's runtime libraries' contents."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": KEY_VERSION, "commands": commands,
                         "compiler": compiler_identity(toolchain.cxx),
                         "include": str(toolchain.include_dir),
                         "runtime": [file_digest(p) for p in toolchain.runtime_libs],
                         "sources": {n: file_digest(directory / n) for n in sorted(sources)}},
                        sort_keys=True).encode())
    return h.hexdigest()


def _store_atomically(dest: Path, files: dict) -> None:
    """Copy `files` (name relative to dest -> source path) into dest, made whole or not at
    all: a temporary directory beside it, then renamed. Errors (a read-only cache) pass."""
    if dest.is_dir():
        return
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            for name, src in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tmp / name)
            os.rename(tmp, dest)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)   # another process stored it first, or
            # the cache is not writable: either way the artifact is complete
    except OSError:
        pass


def cached_build(directory: Path, outputs: list, key: str, build) -> bool:
    """Put `outputs` (paths relative to `directory`) there: from the cache entry `key` if it
    holds them all, else by calling build() and storing them. Returns True on a cache hit."""
    entry = cache_root() / "capi" / key
    if all((entry / o).is_file() for o in outputs):
        for o in outputs:
            dst = directory / o
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            shutil.copyfile(entry / o, dst)
        return True
    build()
    _store_atomically(entry, {o: directory / o for o in outputs})
    return False


def shared_runtime_libs(libs) -> list:
    """Paths of TVM's runtime libraries `libs` in mhagen's cache (copied there once, keyed by
    their contents; libraries already in the cache, e.g. another architecture's from
    mhagen.artifact.other_arch, are used where they are). None where the cache cannot be
    written."""
    root = cache_root().resolve()
    out, to_copy = [], []
    for p in map(Path, libs):
        if root in p.resolve().parents:
            out.append(p.resolve())
        else:
            out.append(None)
            to_copy.append(p)
    if to_copy:
        digest = hashlib.sha256("".join(file_digest(p) for p in to_copy).encode()).hexdigest()
        dest = root / "tvm-runtime" / digest[:32]
        _store_atomically(dest, {p.name: p for p in to_copy})
        copied = iter(dest / p.name for p in to_copy)
        out = [o if o is not None else next(copied) for o in out]
    return [o if o.is_file() else None for o in out]
