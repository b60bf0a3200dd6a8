"""Save a module as an artifact directory (see mhagen/artifact/__init__.py for the files)."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

from mhagen.artifact import capi
from mhagen.artifact.files import (KERNEL_FILES, OLD_TENSOR_FILES, TENSOR_FILE, TEXT_FILES,
                                   sha256_file, source_text, write_params_file)
from mhagen.artifact.manifest import content_hash, module_manifest
from mhagen.artifact.other_arch import export_options
from mhagen.errors import ArtifactError
from mhagen.host import host_arch

HASHED_FILES = (*KERNEL_FILES.values(), TENSOR_FILE) + tuple(
    f"{w}.txt" for w in TEXT_FILES)


def save_module(module, path, *, c_api: bool = True, self_contained: bool = False) -> Path:
    """Write `module` to directory `path` (created): kernel.so (GPU targets: kernels.fatbin
    and the launch table in the manifest), weights.safetensors (the kernels' params, and the
    weights only where the params cannot give them back: files.write_params_file), texts,
    manifest.json, and the C API when a compiler is at hand and `c_api` (its libraries come
    from mhagen's cache when the same sources were compiled before). lib/ links to TVM's
    runtime libraries in mhagen's cache, or holds copies when `self_contained` (an artifact to
    ship elsewhere). Returns the path; refuses a path that is not a directory before anything
    is built or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ArtifactError(f"{path} is a file, not a directory: save the module into a new "
                            "or existing directory")
    device = module.target.device
    if device == "cpu":
        # the cross compiler first: nothing is written when it is missing
        options = export_options(module.target) if module.info.executable is not None else {}
    elif module.info.device_code is None:
        raise ArtifactError(f"this {device} module has no device code to save (a loaded "
                            "one: copy its directory instead)")
    elif not module.info.device_code.launches:
        raise ArtifactError(f"this {device} module cannot be saved: its C API could not launch "
                            f"it ({module.info.device_code.launch_problem}); build it fused")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):   # a parent is a file
        raise ArtifactError(f"cannot create directory {path}: a part of that path is a file"
                            ) from None
    if device == "cpu":
        _write_library(module, path, options)
    else:
        # GPU code: the fatbin compiled at build time (TVM's export_library would store CUDA
        # source) and the launch table; the C API launches them through the CUDA driver
        (path / KERNEL_FILES[device]).write_bytes(module.info.device_code.fatbin)
    module.info.texts["source"] = source_text(module)
    for what in TEXT_FILES:
        (path / f"{what}.txt").write_text(module.info.texts.get(what, ""))
    table = params = None
    for name in (*OLD_TENSOR_FILES, TENSOR_FILE):   # an earlier save's, in any format
        if (path / name).exists():
            os.remove(path / name)
    if module.weights is not None:
        params, table = write_params_file(
            path / TENSOR_FILE, module.program.describe()["buffers"], module.bound_params,
            module.weights)
    files = {n: sha256_file(path / n) for n in HASHED_FILES if (path / n).exists()}
    manifest = module_manifest(module, table, files, params)
    if device != "cpu":
        code = module.info.device_code
        manifest["device_code"] = {
            "file": KERNEL_FILES[device], "arch": code.arch,
            "launches": [la.to_dict() for la in code.launches],
            "resources": {e: r.__dict__ for e, r in sorted(code.resources.items())}}
    manifest = finish(path, manifest, c_api=c_api, self_contained=self_contained)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return path


def _write_library(module, path: Path, options: dict) -> None:
    info = module.info
    if info.executable is not None:
        info.executable.export_library(str(path / "kernel.so"), **options)
    elif info.library_path is not None:  # a loaded module: its library, copied as is
        if Path(info.library_path).resolve() != (path / "kernel.so").resolve():
            shutil.copyfile(info.library_path, path / "kernel.so")
    else:
        raise ArtifactError("this module has no library to save")


def finish(path, manifest: dict, *, toolchain=None, c_api: bool = True,
           self_contained: bool = False) -> dict:
    """Complete a manifest that Module.save is about to write to `path`: add tuning (if
    absent) and content_hash, then generate and compile the C API (mha.h, libmha.so,
    lib/) -- or record in manifest["c_api"]["skipped"] why not (no C++ compiler, no weights,
    code for another architecture without a cross toolchain). Returns the manifest."""
    manifest.setdefault("tuning", [])     # the tuning records used
    manifest.pop("c_api", None)
    manifest["content_hash"] = content_hash(manifest)
    reason = None
    if not c_api:
        reason = "not asked for (saved with c_api=False)"
    elif not manifest.get("params"):
        reason = "no weights bound (bind weights, then save: the C API runs the params)"
    elif toolchain is None:
        arch = manifest["target"]["arch"]
        # another arch: its g++ and its TVM runtime from mhagen's cache (artifact.other_arch);
        # a GPU's C API runs on this machine's architecture (the host of the GPU)
        other_arch = arch != host_arch() and manifest["target"].get("device", "cpu") == "cpu"
        toolchain = capi.Toolchain.for_arch(arch) if other_arch else capi.Toolchain.host()
        if isinstance(toolchain, str):
            reason = toolchain
    if reason is None:
        try:
            manifest["c_api"] = capi.write_c_api(path, manifest, toolchain,
                                                 self_contained=self_contained)
        except ArtifactError as err:
            reason = str(err)
            warnings.warn(f"mhagen: no C API in {path}: {err}", stacklevel=3)
    if reason is not None:
        capi.remove_c_api(path)
        manifest["c_api"] = {"skipped": reason}
    return manifest
