"""Read a saved module: the manifest, kernel.so and the params only (no lowering, no TE/TIR, no
schedule templates, no `import tvm`: mhagen/runtime.py loads kernel.so with TVM's runtime).

The artifact package knows nothing of Module: read_artifact returns the parts (LoadedArtifact)
and Module.from_artifact (mhagen/module.py) makes the module of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mhagen import runtime
from mhagen.artifact.cuda_module import CudaArtifactModule
from mhagen.artifact.files import (KERNEL_FILES, TENSOR_FILE, TEXT_FILES, read_params_file,
                                   read_tensors, sha256_file)
from mhagen.artifact.manifest import read_manifest
from mhagen.errors import ArtifactError, GraphError, MhagenError
from mhagen.host import RUNTIME_FEATURES
from mhagen.ir.graph import Graph
from mhagen.ir.kinds import SUPPORTED_DTYPES
from mhagen.program import Program
from mhagen.target import Target


@dataclass(frozen=True)
class LoadedArtifact:
    """A CPU artifact's parts, checked against each other: what a Module is made of."""
    path: Path
    manifest: dict
    graph: Graph
    target: Target
    program: Program
    library: object          # kernel.so loaded by TVM's runtime
    shapes: dict             # the manifest's: batch, seq_len, kv_seq_len, input, output
    weights: dict | None     # the layer's weights (None: saved without)
    params: dict | None      # the kernels' packed params as stored (not yet aligned)
    texts: dict              # inspection texts: te, tir, source

    @property
    def kernel_path(self) -> Path:
        return self.path / "kernel.so"


def _check_files(path: Path, files: dict, kernels: str) -> None:
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"{path}: {name} is missing; copy the whole directory")
        if sha256_file(f) != digest:
            raise ArtifactError(f"{path}: {name} is corrupted (checksum mismatch); rebuild or "
                                "copy it again")
    if kernels not in files:
        raise ArtifactError(f"{path}: the manifest lists no {kernels}; rebuild the module")


def _check_program(program: Program, params: dict, path, shapes: dict) -> None:
    """The kernels' params as the program describes them; the inputs and output a Module
    passes, as large as the manifest's shapes (x and the output hold its rows and columns,
    the output's padded to whole panels maybe; key or cache lengths one per batch row)."""
    for b in program.role("param"):
        p = params.get(b.name)
        if p is None or p.shape != tuple(b.shape) or str(p.dtype) != b.dtype:
            raise ArtifactError(f"{path}: the params file does not hold {b.name!r} as the "
                                f"program describes it ({b.dtype} {list(b.shape)}); rebuild "
                                "the module")
    inputs = program.role("input")
    storage = inputs[0].dtype if inputs else None    # the layer's dtype (mhagen/dtypes.py)
    floats = [b for b in inputs if b.dtype == storage]
    if storage not in SUPPORTED_DTYPES or len(program.role("output")) != 1 or \
            len(floats) > 2 or any(b.dtype not in ("int32", storage) for b in inputs):
        raise ArtifactError(f"{path}: the program needs the input x (then a context and key "
                            "lengths, if any) "
                            "and one output buffer")
    def holds(buffer, shape):   # its rows, and at least its columns (outputs may be padded)
        return (math.prod(buffer.shape[:-1]) == math.prod(shape[:-1])
                and buffer.shape[-1] >= shape[-1])
    if (any(list(shapes[k][:2]) != [shapes["batch"], shapes["seq_len"]]
            for k in ("input", "output"))
            or not holds(floats[0], shapes["input"])
            or not holds(program.role("output")[0], shapes["output"])
            or any(b.dtype == "int32" and tuple(b.shape) != (shapes["batch"],)
                   and b.name not in ("cu_seqlens", "block_tables") for b in inputs)):
        raise ArtifactError(f"{path}: the program's input and output buffers do not hold the "
                            f"manifest's shapes ({shapes['input']} in, {shapes['output']} out); "
                            "rebuild the module")


def read_artifact(path) -> LoadedArtifact | CudaArtifactModule:
    """Read a directory written by Module.save(); checks format, target and checksums. A
    CUDA artifact comes back as a CudaArtifactModule (mhagen/artifact/cuda_module.py: its
    libmha.so through ctypes, no TVM), which needs the NVIDIA driver and a GPU."""
    path = Path(path)
    man = read_manifest(path)
    device = man["target"].get("device", "cpu") if isinstance(man["target"], dict) else "cpu"
    _check_files(path, man["files"], KERNEL_FILES.get(device, KERNEL_FILES["cpu"]))
    try:
        return _load(path, man)
    except GraphError as err:
        raise ArtifactError(f"{path}/manifest.json holds an invalid graph ({err}); rebuild "
                            "the module") from None
    except MhagenError:   # already says what is wrong (no GPU, a missing file, ...)
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        # the content hash holds, so the manifest was written like this (by hand or a tool)
        raise ArtifactError(f"{path}/manifest.json is malformed ({type(err).__name__}: "
                            f"{str(err)[:300]}); rebuild the module") from None


def _load(path, man) -> LoadedArtifact | CudaArtifactModule:
    target = Target.from_dict(man["target"])
    graph = Graph.from_json(man["graph"])
    graph.shapes()     # verify
    program = Program.from_description(man["program"])
    shapes = man["shapes"]
    if target.device != "cpu":   # GPU code runs through the artifact's own C API
        return CudaArtifactModule(path, man, graph, target)
    why = target.cannot_run()
    unknown = sorted(set(man["target"].get("features") or []) - set(RUNTIME_FEATURES))
    if why is None and unknown:
        why = (f"it needs CPU features {', '.join(unknown)} that this machine lacks or mhagen "
               "cannot check")
    if why:
        raise ArtifactError(f"{path}: {why}")
    weights = params = None
    if man.get("params"):
        if man["version"] >= 3:
            weights, params = read_params_file(path / TENSOR_FILE, man["program"]["buffers"],
                                               man["params"], man.get("weights") or [])
        else:      # format 2: weights.bin and params.bin
            weights = read_tensors(path / "weights.bin", man.get("weights") or [])
            params = read_tensors(path / "params.bin", man["params"])
        _check_program(program, params, path, shapes)
    texts = {w: (path / f"{w}.txt").read_text() for w in TEXT_FILES
             if (path / f"{w}.txt").is_file()}
    for b in program.role("param"):   # constants (block tables) come from the params file
        if params and (b.pack or {}).get("kind") == "constant":
            b.value = params[b.name]
    library = runtime.load_library(path / "kernel.so")
    for k in program.compiled:
        library[k.name]     # AttributeError: kernel.so has no such function
    return LoadedArtifact(path, man, graph, target, program, library, shapes, weights, params,
                          texts)
