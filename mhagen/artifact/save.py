"""Save a module as an artifact directory (see mhagen/artifact/__init__.py for the files)."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

from mhagen.artifact import capi
from mhagen.artifact.files import KERNEL_FILES, sha256_file, write_tensors
from mhagen.artifact.manifest import content_hash, module_manifest
from mhagen.cross import export_options
from mhagen.errors import ArtifactError
from mhagen.host import host_arch
from mhagen.inspection import TEXT_FILES, source_text

HASHED_FILES = (*KERNEL_FILES.values(), "weights.bin", "params.bin") + tuple(
    f"{w}.txt" for w in TEXT_FILES)


def save_module(module, path) -> Path:
    """Write `module` to directory `path` (created): kernel.so (GPU targets: kernels.fatbin
    and the launch table in the manifest), weights and params, texts, manifest.json, and the
    C API when a compiler is at hand. Returns the path."""
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
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
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
    if module.weights is not None:
        table = write_tensors(path / "weights.bin",
                              {n: module.weights[n] for n in sorted(module.weights)})
        params = write_tensors(path / "params.bin", module.bound_params)
    else:
        for name in ("weights.bin", "params.bin"):
            if (path / name).exists():
                os.remove(path / name)
    files = {n: sha256_file(path / n) for n in HASHED_FILES if (path / n).exists()}
    manifest = module_manifest(module, table, files, params)
    if device != "cpu":
        code = module.info.device_code
        manifest["device_code"] = {
            "file": KERNEL_FILES[device], "arch": code.arch,
            "launches": [la.to_dict() for la in code.launches],
            "resources": {e: r.__dict__ for e, r in sorted(code.resources.items())}}
    manifest = finish(path, manifest)
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


def finish(path, manifest: dict, *, toolchain=None) -> dict:
    """Complete a manifest that Module.save is about to write to `path`: add tuning (if
    absent) and content_hash, then generate and compile the C API (mha.h, libmha.so,
    lib/) -- or record in manifest["c_api"]["skipped"] why not (no C++ compiler, no weights,
    code for another architecture without a cross toolchain). Returns the manifest."""
    manifest.setdefault("tuning", [])     # the tuning records used
    manifest.pop("c_api", None)
    manifest["content_hash"] = content_hash(manifest)
    reason = None
    if not manifest.get("params"):
        reason = "no weights bound (bind weights, then save: the C API runs params.bin)"
    elif toolchain is None:
        arch = manifest["target"]["arch"]
        # another arch: its cross g++ and its TVM runtime from mhagen's cache (mhagen.cross);
        # a GPU's C API runs on this machine's architecture (the host of the GPU)
        cross = arch != host_arch() and manifest["target"].get("device", "cpu") == "cpu"
        toolchain = capi.Toolchain.cross(arch) if cross else capi.Toolchain.host()
        if isinstance(toolchain, str):
            reason = toolchain
    if reason is None:
        try:
            manifest["c_api"] = capi.write_c_api(path, manifest, toolchain)
        except ArtifactError as err:
            reason = str(err)
            warnings.warn(f"mhagen: no C API in {path}: {err}", stacklevel=3)
    if reason is not None:
        capi.remove_c_api(path)
        manifest["c_api"] = {"skipped": reason}
    return manifest
