"""Artifacts that apps embed: the manifest's content hash, the generated C API, a readable
manifest printer.

A saved module (Module.save, `mhagen build --out DIR`) is a directory:
  manifest.json   format/version, mhagen and TVM versions, target and CPU features, graph,
                  shapes and dtypes, program (buffers, kernels), weight/param tables with sha256,
                  file sha256s, schedule decisions, tuning (records used), content_hash, c_api
  kernel.so       the kernels (TVM library); weights.bin (user layout); params.bin (kernel-ready)
  mha.h           the generated C header (shapes, status codes, the API, documented)
  libmha.so       the C API (rpath $ORIGIN/lib); mha_api.cc, its generated source
  lib/            libtvm_ffi.so and libtvm_runtime.so (about 6 MB), what libmha.so links
  te.txt, tir.txt, source.txt   inspection texts

content_hash is the sha256 of the manifest (sorted keys, compact JSON) without its
"content_hash" and "c_api" entries; as the manifest holds every file's sha256, it names the
whole artifact. libmha.so bakes it in and refuses a directory whose manifest has another one.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from mhagen.errors import ArtifactError

NOT_HASHED = ("content_hash", "c_api")


def content_hash(manifest: dict) -> str:
    """sha256 of the manifest without its content_hash and c_api entries."""
    body = {k: v for k, v in manifest.items() if k not in NOT_HASHED}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def check_content_hash(manifest: dict, where) -> None:
    """Raise ArtifactError if the manifest's content_hash (when present) does not match it."""
    stored = manifest.get("content_hash")
    if stored is not None and stored != content_hash(manifest):
        raise ArtifactError(f"{where}: manifest.json was edited or is corrupted (its content "
                            "hash does not match); rebuild the module or copy it again")


def finish(path, manifest: dict, *, toolchain=None) -> dict:
    """Complete a manifest that Module.save is about to write to `path`: add tuning (if
    absent) and content_hash, then generate and compile the C API (mha.h, libmha.so,
    lib/) -- or record in manifest["c_api"]["skipped"] why not (no C++ compiler, no weights,
    code for another architecture without a cross toolchain). Returns the manifest."""
    from mhagen.artifact.capi import Toolchain, remove_c_api, write_c_api
    from mhagen.target import host_arch
    manifest.setdefault("tuning", [])     # the tuning records used (Module._manifest fills it)
    manifest.pop("c_api", None)
    manifest["content_hash"] = content_hash(manifest)
    reason = None
    if not manifest.get("params"):
        reason = "no weights bound (bind weights, then save: the C API runs params.bin)"
    elif toolchain is None:
        arch = manifest["target"]["arch"]
        # another arch: its cross g++ and its TVM runtime from mhagen's cache (mhagen.cross)
        toolchain = Toolchain.cross(arch) if arch != host_arch() else Toolchain.host()
        if isinstance(toolchain, str):
            reason = toolchain
    if reason is None:
        try:
            manifest["c_api"] = write_c_api(path, manifest, toolchain)
        except ArtifactError as err:
            reason = str(err)
            warnings.warn(f"mhagen: no C API in {path}: {err}", stacklevel=3)
    if reason is not None:
        remove_c_api(path)
        manifest["c_api"] = {"skipped": reason}
    return manifest


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(manifest_or_dir) -> str:
    """A saved module's manifest as readable text (for `mhagen inspect DIR`): versions, layer,
    target, shapes, kernels and buffers, weights and params, files, the C API."""
    where = None
    if isinstance(manifest_or_dir, (str, Path)):
        where = Path(manifest_or_dir)
        mpath = where / "manifest.json" if where.is_dir() else where
        try:
            man = json.loads(mpath.read_text())
        except (OSError, ValueError) as err:
            raise ArtifactError(f"cannot read {mpath}: {err}") from None
    else:
        man = manifest_or_dir
    from mhagen.artifact.capi import _layer_summary
    t, sh = man.get("target", {}), man.get("shapes", {})
    lines = [f"{man.get('format')} version {man.get('version')}  (mhagen "
             f"{man.get('mhagen_version')}, TVM {man.get('tvm_version')})",
             f"content hash  {man.get('content_hash', '(none)')}",
             f"layer         {_layer_summary(man)}",
             f"target        {t.get('name')}: {t.get('arch')}, cpu {t.get('tvm', {}).get('mcpu')},"
             f" {t.get('vector_bits')}-bit vectors, {t.get('cores')} cores; needs "
             f"{' '.join(t.get('features') or []) or 'nothing'}",
             f"input  x      {sh.get('input')} {sh.get('dtype')}",
             f"output y      {sh.get('output')} {sh.get('dtype')}"]
    prog = man.get("program") or {}
    if prog:
        lines.append(f"program       {prog.get('fusion', '')}")
        for k in prog.get("kernels", []):
            lines.append(f"  kernel  {k['name']}({', '.join(k['args'])})")
        for b in prog.get("buffers", []):
            lines.append(f"  {b['role']:<7} {b['name']:<10} {str(b['shape']):<22} {b['dtype']}")
    for key, fname in (("weights", "weights.bin"), ("params", "params.bin")):
        table = man.get(key)
        if table:
            lines.append(f"{key:<13} {fname}, {len(table)} tensors, "
                         f"{_fmt_bytes(sum(e['nbytes'] for e in table))}")
            for e in table:
                lines.append(f"  {e['name']:<10} {str(e['shape']):<22} {e['dtype']:<8} "
                             f"@{e['offset']:<9} sha256 {e['sha256'][:16]}")
        else:
            lines.append(f"{key:<13} none")
    rec = man.get("tuning")
    lines.append(f"tuning        {len(rec)} records" if rec
                 else "tuning        none (rule defaults)")
    for name, digest in (man.get("files") or {}).items():
        size = ""
        if where is not None and (where / name).is_file():
            size = _fmt_bytes((where / name).stat().st_size)
        lines.append(f"  file    {name:<12} {size:>10}  sha256 {digest[:16]}")
    c = man.get("c_api") or {}
    if c.get("skipped"):
        lines.append(f"C API         none: {c['skipped']}")
    elif c:
        lines.append(f"C API         {c.get('header')}, {c.get('library')} (+ "
                     f"{', '.join(c.get('runtime_libs', []))}), by {c.get('compiler')}")
        lines.append("  build   cc app.c -I DIR -L DIR -lmha -Wl,-rpath,DIR")
    return "\n".join(lines)


__all__ = ["check_content_hash", "content_hash", "describe", "finish"]
