"""The manifest of a saved module: format versions, content hash, reading and checking.

Format versions (MODULE_VERSION is written; READABLE_VERSIONS load):
  1  program buffers without param recipes: no longer read (read_manifest says to re-save it)
  2  program buffers carry their param recipes (mhagen.params); target carries family/device
  3  the tensors in one safetensors file, weights.safetensors (files.write_params_file): the
     params table gives each param's byte offset in it, the weights table where each weight
     comes from (unpacked from the params, or a tensor of its own); format 2 keeps
     weights.bin and params.bin (files.read_tensors)

content_hash is the sha256 of the manifest (sorted keys, compact JSON) without its
"content_hash" and "c_api" entries; as the manifest holds every file's sha256, it names the
whole artifact. libmha.so bakes it in and refuses a directory whose manifest has another one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mhagen.errors import ArtifactError
from mhagen.version import __version__

MODULE_FORMAT = "mhagen.module"
MODULE_VERSION = 3
READABLE_VERSIONS = (2, 3)
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


def tvm_version() -> str:
    """The installed TVM's version, without importing TVM."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("apache-tvm")
    except PackageNotFoundError:
        return "unknown"


def module_manifest(module, weight_table=None, files=None, params=None) -> dict:
    """The manifest of a module (without content_hash and c_api: save adds them)."""
    info = module.info
    return {
        "format": MODULE_FORMAT, "version": MODULE_VERSION,
        "mhagen_version": __version__, "tvm_version": tvm_version(),
        "target": module.target.to_dict(),
        "graph": json.loads(module.graph.to_json()),
        "shapes": {"batch": module.batch, "seq_len": module.seq_len,
                   "input": list(module.in_shape), "output": list(module.out_shape),
                   "dtype": module.graph.dtype,
                   **({"kv_seq_len": module.kv_seq_len} if module.kv_seq_len else {})},
        "fuse": info.fuse,
        "tuning": info.tuning_records,
        "program": module.program.describe(),
        "weights": weight_table,
        "params": params,
        "schedule": info.decisions,
        "files": files or {},
    }


def read_manifest(path: Path) -> dict:
    """The manifest of the module directory `path`, checked: format, version, content hash,
    the keys a loader needs."""
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise ArtifactError(f"{path} is not a saved mhagen module: {mpath.name} is missing "
                            "(save one with module.save(dir) or `mhagen build --out dir`)")
    try:
        man = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{mpath} is corrupt ({err}); rebuild the module") from None
    if not isinstance(man, dict) or man.get("format") != MODULE_FORMAT:
        raise ArtifactError(f"{mpath} is not an mhagen module manifest")
    if man.get("version") == 1:
        raise ArtifactError(f"{path} has module format version 1 (program buffers without "
                            "param recipes), which this mhagen no longer reads: load it with "
                            "the mhagen that saved it and save it again (module.save) with "
                            "this one, or rebuild it")
    if man.get("version") not in READABLE_VERSIONS:
        raise ArtifactError(f"{path} has module format version {man.get('version')}; this mhagen "
                            f"reads versions {', '.join(map(str, READABLE_VERSIONS))}: rebuild it "
                            "with this mhagen")
    missing = [k for k in ("files", "target", "graph", "shapes", "program") if k not in man]
    if missing:
        raise ArtifactError(f"{mpath} lacks {', '.join(missing)}; rebuild the module")
    check_content_hash(man, path)  # any other edit of manifest.json
    return man
