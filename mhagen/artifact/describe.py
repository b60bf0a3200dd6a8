"""A saved module's manifest as readable text (`mhagen inspect DIR`)."""
from __future__ import annotations

import json
from pathlib import Path

from mhagen.artifact.capi import _layer_summary as layer_summary
from mhagen.artifact.files import sha256_file
from mhagen.errors import ArtifactError


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _read_manifest(mpath: Path) -> dict:
    try:
        man = json.loads(mpath.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"cannot read {mpath}: {err}") from None
    if not isinstance(man, dict):
        raise ArtifactError(f"{mpath} is not an mhagen manifest (a JSON object is expected, "
                            f"found {type(man).__name__})")
    return man


_WRONG_TYPES = (AttributeError, TypeError, KeyError, ValueError, IndexError)


def _malformed(mpath, err) -> ArtifactError:
    """A manifest whose JSON holds other types than mhagen writes (edited by hand or a tool)."""
    return ArtifactError(f"{mpath} is malformed: its fields are not of the types mhagen "
                         f"writes ({type(err).__name__}: {str(err)[:200]}); rebuild the module "
                         "or copy it again")


def damaged_files(directory, man: dict | None = None) -> list:
    """The files of the artifact in `directory` that are missing or differ from the sha256
    its manifest lists, the C API's included ("name (why)"). libmha.so cannot check itself
    (the dynamic loader maps it before any of its code runs), so this is how a copied
    artifact is checked whole: `mhagen inspect DIR --what manifest`."""
    directory = Path(directory)
    man = man if man is not None else _read_manifest(directory / "manifest.json")
    try:
        listed = {**(man.get("files") or {}), **((man.get("c_api") or {}).get("files") or {})}
    except _WRONG_TYPES as err:
        raise _malformed(directory / "manifest.json", err) from None
    bad = []
    for name, digest in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            bad.append(f"{name} (missing)")
        elif sha256_file(path) != digest:
            bad.append(f"{name} (sha256 differs)")
    return bad


def describe(manifest_or_dir) -> str:
    """A saved module's manifest as readable text (for `mhagen inspect DIR`): versions, layer,
    target, shapes, kernels and buffers, weights and params, files, the C API."""
    where, mpath = None, "the manifest"
    if isinstance(manifest_or_dir, (str, Path)):
        where = Path(manifest_or_dir)
        mpath = where / "manifest.json" if where.is_dir() else where
        man = _read_manifest(mpath)
    else:
        man = manifest_or_dir
    try:
        return _describe(man, where)
    except _WRONG_TYPES as err:
        raise _malformed(mpath, err) from None


def _describe(man: dict, where: Path | None) -> str:
    t, sh = man.get("target", {}), man.get("shapes", {})
    lines = [f"{man.get('format')} version {man.get('version')}  (mhagen "
             f"{man.get('mhagen_version')}, TVM {man.get('tvm_version')})",
             f"content hash  {man.get('content_hash', '(none)')}",
             f"layer         {layer_summary(man)}",
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
    code = man.get("device_code")
    if code:
        lines.append(f"device code   {code.get('file')} for {code.get('arch')}, launched in order:")
        for la in code.get("launches", []):
            lines.append(f"  launch  {la['entry']} grid {la['grid']} block {la['block']} "
                         f"dynamic shared {la['dynamic_shared']} B ({', '.join(la['args'])})")
    new_format = man.get("version", 0) >= 3      # one safetensors file (files.py)
    for key, fname in (("weights", "weights.bin"), ("params", "params.bin")):
        table = man.get(key)
        if table and new_format and key == "weights":
            lines.append(f"weights       {len(table)} tensors, in the layer's layout (from the "
                         "params, or stored as named)")
            for e in table:
                lines.append(f"  {e['name']:<10} {str(e['shape']):<22} {e['dtype']:<8} "
                             f"from {e['from']}")
        elif table and new_format:
            lines.append(f"params        weights.safetensors, {len(table)} tensors, "
                         f"{_fmt_bytes(sum(e['nbytes'] for e in table))}")
            for e in table:
                lines.append(f"  {e['name']:<10} {str(e['shape']):<22} {e['dtype']:<8} "
                             f"@{e['offset']}")
        elif table:
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
        extra = ", ".join(c.get("runtime_libs", [])) or "the CUDA driver at run time"
        lines.append(f"C API         {c.get('header')}, {c.get('library')} (+ {extra}), by "
                     f"{c.get('compiler')}")
        lines.append("  build   cc app.c -I DIR -L DIR -lmha -Wl,-rpath,DIR")
        shared = c.get("shared_runtime")
        if shared:   # links to mhagen's cache: copy with cp -rL, or save self_contained=True
            lines.append(f"  lib/    links to the shared TVM runtime in "
                         f"{Path(next(iter(shared.values()))).parent} (save with "
                         "self_contained=True for copies)")
    if where is not None and where.is_dir():
        bad = damaged_files(where, man)
        lines.append(f"check         DAMAGED: {', '.join(bad)}; copy the artifact again or "
                     "rebuild it" if bad else "check         every file matches its sha256")
    return "\n".join(lines)


__all__ = ["damaged_files", "describe"]
