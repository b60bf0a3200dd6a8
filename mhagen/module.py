"""Module: a compiled layer you call with numpy arrays; save/load; inspection.

A saved module is a directory:
  kernel.so       the compiled library (tvm.runtime.load_module)
  weights.bin     bound weights in the user's layout (w_q [H, D, d], ...), float32 little-endian,
                  back to back, no header; name/shape/offset/nbytes/sha256 in manifest "weights"
  params.bin      the kernels' parameters (weights repacked, block tables) in the same format,
                  table in manifest "params": what a C program passes to the kernels
  manifest.json   format version, versions, target, graph, shapes, weight table with sha256,
                  file checksums, schedule decisions
  te.txt, tir.txt, source.txt   tensor expressions, scheduled TensorIR, assembly (inspect)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from mhagen.errors import ArtifactError, InputError, TargetError
from mhagen.reference import check_input
from mhagen.target import host_arch
from mhagen.weights import check_weights

MODULE_FORMAT = "mhagen.module"
MODULE_VERSION = 1
INSPECT_KINDS = ("graph", "te", "tir", "source", "schedule", "manifest")
TEXT_FILES = ("te", "tir", "source")


def sha256_file(path) -> str:
    """sha256 of a file's bytes, as hex (the manifest's checksums)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


ALIGNMENT = 64   # bytes: what TVM assumes of every buffer it is given (aligned vector stores)


def aligned_empty(shape, dtype="float32") -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.empty(n + ALIGNMENT // dtype.itemsize, dtype)
    start = (-raw.ctypes.data % ALIGNMENT) // dtype.itemsize
    return raw[start:start + n].reshape(shape)


def _tensor_view(a: np.ndarray, shape):
    """A TVM tensor sharing a's memory (DLPack), or None when a is not C-contiguous, aligned
    and writable float data that DLPack can export."""
    import tvm_ffi
    if not (a.flags.c_contiguous and a.flags.writeable
            and a.__array_interface__["data"][0] % ALIGNMENT == 0):
        return None
    try:
        return tvm_ffi.from_dlpack(a.reshape(shape))
    except (BufferError, TypeError, ValueError, RuntimeError):
        return None


class Module:
    """A layer compiled for one target and one input shape [batch, seq_len, d_model].

    `module(x)` runs it on a float32 numpy array x and returns a float32 numpy array;
    `module(x, weights=w)` uses other weights for that call (same names and shapes).
    """

    def __init__(self, graph, target, batch, seq_len, program, runtime_module, *, weights=None,
                 texts=None, decisions=None, executable=None, compile_seconds=None, fuse=True,
                 tuning_records=None, library_path=None):
        self.graph, self.target = graph, target
        self.batch, self.seq_len = batch, seq_len
        self.program = program
        self.fuse = fuse
        self.params = [b.name for b in program.role("param")]
        self._rt = runtime_module
        self._executable = executable
        # Code for another architecture (a cross build) or for CPU features this machine
        # lacks (an AVX-512 build on an AVX2 host) is saved, never called: the first would
        # start LLVM's JIT, which refuses a foreign architecture, the second dies of SIGILL.
        self._cannot_run = None
        try:
            target.check_runs_here()
        except TargetError as err:
            self._cannot_run = str(err)
        self._calls = ([(runtime_module[k.name], k.args) for k in program.kernels]
                       if self._cannot_run is None else [])
        self.tuning_records = list(tuning_records or [])
        self.library_path = library_path
        self._resident_buffers = self._resident_for = self._out_slot = None
        self._in_buffer = program.role("input")[0]
        self._out_buffer = program.role("output")[0]
        self.texts = dict(texts or {})
        self.decisions = list(decisions or [])
        self.compile_seconds = compile_seconds
        self.d_model = graph.inputs[0].attrs["shape"][2]
        self.out_shape = tuple(graph.shapes(**self.graph.dims(self.batch, self.seq_len))[graph.output])
        self.weights = None
        self._bound = None
        if weights is not None:
            self.bind(weights)

    @property
    def cannot_run(self):
        """None when this machine can call the module, else why not (another architecture,
        or CPU features this machine lacks)."""
        return self._cannot_run

    @property
    def in_shape(self):
        return (self.batch, self.seq_len, self.d_model)

    def bind(self, weights) -> "Module":
        """Bind weights: checked, repacked for the kernels and copied to the device once."""
        self.weights = check_weights(self.graph, weights, dtype=np.float32)
        self._bound = self._params(self.weights)
        return self

    def _params(self, weights) -> dict:
        import tvm
        out = {}
        for b in self.program.role("param"):
            arr = np.ascontiguousarray(b.make(weights), dtype=b.dtype)
            assert arr.shape == tuple(b.shape), (b.name, arr.shape, b.shape)
            out[b.name] = tvm.runtime.tensor(arr, tvm.cpu())
        return out

    def _args(self, x, weights, out=None):
        """The kernels' arguments by buffer name. The input is passed without a copy when x
        is C-contiguous float32 on a 64-byte boundary (what the kernels assume), else copied
        into a buffer of the module; `out` (a TVM tensor, from _output_slot) receives the
        output."""
        if self._cannot_run is not None:
            raise TargetError(f"cannot call this module: {self._cannot_run} (it can still be "
                              "saved and run where it fits)")
        if type(x) is not np.ndarray or x.dtype != np.float32 or x.shape != self.in_shape:
            x = self._check_x(x)
        if weights is not None:
            buffers = dict(self._resident(),
                           **self._params(check_weights(self.graph, weights, dtype=np.float32)))
        elif self._bound is not None:
            buffers = dict(self._resident())
        else:
            raise InputError("no weights: pass weights= to mhagen.build(), call "
                             "module.bind(weights), or call module(x, weights=...)")
        view = _tensor_view(x, self._in_buffer.shape)
        if view is None:
            buffers[self._in_buffer.name].copyfrom(
                np.ascontiguousarray(x).reshape(self._in_buffer.shape))
        else:
            buffers[self._in_buffer.name] = view
        if out is not None:
            buffers[self._out_buffer.name] = out
        return buffers

    def _check_x(self, x):
        x = check_input(self.graph, x)
        if x.shape != self.in_shape:
            raise InputError(f"x has shape {x.shape}, but this module was built for "
                             f"{self.in_shape} (batch, seq_len, d_model); rebuild with "
                             f"mhagen.build(layer, batch={x.shape[0]}, seq_len={x.shape[1]})")
        if x.dtype != np.float32:
            raise InputError(f"x has dtype {x.dtype}; this module computes in float32: "
                             "pass x.astype(np.float32)")
        return x

    def _resident(self) -> dict:
        """Bound parameters and the module's own buffers (temporaries, input staging, output),
        allocated once: a Module is not safe to call from several threads at once."""
        if self._resident_buffers is None or self._resident_for is not self._bound:
            import tvm
            dev = tvm.cpu()
            temps = {b.name: tvm.runtime.empty(b.shape, b.dtype, dev)
                     for b in self.program.buffers.values()
                     if b.role in ("temp", "input", "output")}
            self._resident_buffers = dict(self._bound or {}, **temps)
            self._resident_for = self._bound
        return self._resident_buffers

    def _output_slot(self):
        """(array, TVM view of it) for the kernels to write the output into, 64-byte aligned:
        the previous call's when the caller has dropped every array sharing its memory, else
        a new one (fresh memory on every call costs page faults)."""
        import sys
        # references to the memory's owner: our aligned view and getrefcount's argument;
        # every array a caller still holds adds one
        if self._out_slot is None or sys.getrefcount(self._out_slot[0].base) > 2:
            import tvm_ffi
            b = self._out_buffer
            view = aligned_empty(b.shape, b.dtype)
            self._out_slot = (view, tvm_ffi.from_dlpack(view))
        return self._out_slot

    def _run(self, buffers):
        for func, args in self._calls:
            func(*[buffers[a] for a in args])

    def __call__(self, x, weights=None) -> np.ndarray:
        view, tensor = self._output_slot()
        self._run(self._args(x, weights, tensor))
        out = view.reshape(self.batch, self.seq_len, -1)
        return out if out.shape == self.out_shape else np.ascontiguousarray(
            out[..., :self.out_shape[2]])

    def latency(self, x=None, *, number: int = 10, repeat: int = 5, min_repeat_ms: int = 50):
        """Median seconds per call (kernels only, weights bound) over `repeat` runs of at
        least `number` calls and `min_repeat_ms` each."""
        import time
        if x is None:
            x = np.random.default_rng(0).standard_normal(self.in_shape).astype(np.float32)
        buffers = self._args(x, None)
        self._run(buffers)
        results = []
        for _ in range(repeat):
            n, start = 0, time.perf_counter()
            while n < number or (time.perf_counter() - start) * 1e3 < min_repeat_ms:
                self._run(buffers)
                n += 1
            results.append((time.perf_counter() - start) / n)
        return float(np.median(results))

    def flops(self) -> int:
        """Floating-point operations of one call (2 per multiply-add of every matmul)."""
        from mhagen.cost import graph_flops
        return graph_flops(self.graph, **self.graph.dims(self.batch, self.seq_len))

    # -- inspection ----------------------------------------------------------------------
    def inspect(self, what: str = "graph") -> str:
        """One stage as text: graph, te, tir (scheduled), source (assembly), schedule, manifest."""
        if what not in INSPECT_KINDS:
            raise ValueError(f"inspect() takes one of {', '.join(INSPECT_KINDS)}, got {what!r}")
        if what == "graph":
            return str(self.graph)
        if what == "schedule":
            lines = [self.program.fusion]
            lines += [f"{d['kernel']:<18} {d['stage']:<16} {d['rule']:<12} {d['config']}"
                      for d in self.decisions]
            return "\n".join(lines)
        if what == "manifest":
            return json.dumps(self._manifest(), indent=1)
        if what == "source":
            if not self.texts.get("source"):
                self.texts["source"] = self._rt.inspect_source("asm")
            return self.texts["source"]
        if what not in self.texts:
            raise ArtifactError(f"this module carries no {what} text")
        return self.texts[what]

    def __repr__(self):
        return (f"<mhagen.Module {self.graph.name} on {self.target.name} x{self.in_shape} "
                f"-> {self.out_shape}, weights {'bound' if self._bound else 'not bound'}>")

    # -- save / load ---------------------------------------------------------------------
    def _manifest(self, weight_table=None, files=None):
        import tvm

        import mhagen
        t = self.target
        return {
            "format": MODULE_FORMAT, "version": MODULE_VERSION,
            "mhagen_version": mhagen.__version__, "tvm_version": tvm.__version__,
            "target": {"name": t.name, "tvm": t.tvm_target_dict(), "arch": t.arch,
                       "cores": t.cores, "vector_bits": t.vector_bits,
                       "vector_registers": t.vector_registers, "cpu_class": t.cpu_class,
                       "cpu": t.cpu, "l1d_kib": t.l1d_kib, "l2_kib": t.l2_kib,
                       "l3_kib": t.l3_kib, "features": list(t.required_features()),
                       "all_features": list(t.features)},
            "graph": json.loads(self.graph.to_json()),
            "shapes": {"batch": self.batch, "seq_len": self.seq_len,
                       "input": list(self.in_shape), "output": list(self.out_shape),
                       "dtype": "float32"},
            "fuse": self.fuse,
            "tuning": self.tuning_records,
            "program": self.program.describe(),
            "weights": weight_table,
            "schedule": self.decisions,
            "files": files or {},
        }

    def save(self, path) -> Path:
        """Write the module to directory `path` (created); returns the path."""
        from mhagen.cross import export_options  # the cross g++ for another arch
        options = export_options(self.target) if self._executable is not None else {}
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self._executable is not None:
            self._executable.export_library(str(path / "kernel.so"), **options)
        elif self.library_path is not None:  # a loaded module: its library, copied as is
            if Path(self.library_path).resolve() != (path / "kernel.so").resolve():
                shutil.copyfile(self.library_path, path / "kernel.so")
        else:
            raise ArtifactError("this module has no library to save")
        self.inspect("source")
        for what in TEXT_FILES:
            (path / f"{what}.txt").write_text(self.texts.get(what, ""))
        table = params = None
        if self.weights is not None:
            table = _write_tensors(path / "weights.bin",
                                   {n: self.weights[n] for n in sorted(self.weights)})
            params = _write_tensors(path / "params.bin",
                                    {n: t.numpy() for n, t in self._bound.items()})
        else:
            for name in ("weights.bin", "params.bin"):
                if (path / name).exists():
                    os.remove(path / name)
        names = ["kernel.so", "weights.bin", "params.bin"] + [f"{w}.txt" for w in TEXT_FILES]
        files = {n: sha256_file(path / n) for n in names if (path / n).exists()}
        manifest = self._manifest(table, files)
        manifest["params"] = params
        from mhagen.artifact import finish  # content hash; C API (mha.h, libmha.so, lib/)
        finish(path, manifest)
        (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return path


def _write_tensors(path, arrays: dict) -> list:
    """Arrays back to back, little-endian, no header; returns the table for the manifest."""
    table, offset = [], 0
    with open(path, "wb") as f:
        for name, arr in arrays.items():
            dtype = {"float32": "<f4", "int32": "<i4"}[str(arr.dtype)]
            data = np.ascontiguousarray(arr, dtype=dtype).tobytes()
            f.write(data)
            table.append({"name": name, "shape": list(arr.shape), "dtype": str(arr.dtype),
                          "offset": offset, "nbytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            offset += len(data)
    return table


def load(path) -> Module:
    """Load a directory written by Module.save(); checks format, target and checksums."""
    import tvm

    from mhagen.ir.graph import Graph
    from mhagen.target import Target

    path = Path(path)
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
    if man.get("version") != MODULE_VERSION:
        raise ArtifactError(f"{path} has module format version {man.get('version')}; this mhagen "
                            f"reads version {MODULE_VERSION}: rebuild it with this mhagen")
    try:
        files, tinfo = man["files"], man["target"]
        graph = Graph.from_json(man["graph"])
        shapes = man["shapes"]
    except KeyError as err:
        raise ArtifactError(f"{mpath} lacks {err}; rebuild the module") from None
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"{path}: {name} is missing; copy the whole directory")
        if sha256_file(f) != digest:
            raise ArtifactError(f"{path}: {name} is corrupted (checksum mismatch); rebuild or "
                                "copy it again")
    if "kernel.so" not in files:
        raise ArtifactError(f"{path}: the manifest lists no kernel.so; rebuild the module")
    if tinfo["arch"] != host_arch():
        raise ArtifactError(f"{path} holds {tinfo['arch']} code (target {tinfo['name']}); this "
                            f"machine is {host_arch()}: run it on a {tinfo['arch']} machine")
    from mhagen.target import host_features
    missing = sorted(set(tinfo.get("features", [])) - set(host_features()))
    if missing:
        raise ArtifactError(f"{path} needs CPU features {missing} that this machine lacks; "
                            "rebuild it here with --target x86")
    from mhagen.artifact import check_content_hash
    check_content_hash(man, path)  # any other edit of manifest.json
    from mhagen.target import DEFAULT_CACHES, vector_registers
    features = tuple(tinfo.get("all_features", []))
    target = Target(tinfo["name"], tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                for k, v in tinfo["tvm"].items())),
                    tinfo["arch"], tinfo["cores"], tinfo["vector_bits"], features,
                    vector_registers=tinfo.get("vector_registers")
                    or vector_registers(tinfo["arch"], features), cpu=tinfo.get("cpu", ""),
                    **{k: int(tinfo.get(k, v)) for k, v in DEFAULT_CACHES.items()})
    weights = None
    if man.get("weights"):
        raw = (path / "weights.bin").read_bytes()
        weights = {}
        for e in man["weights"]:
            chunk = raw[e["offset"]:e["offset"] + e["nbytes"]]
            if len(chunk) != e["nbytes"] or hashlib.sha256(chunk).hexdigest() != e["sha256"]:
                raise ArtifactError(f"{path}: weight {e['name']!r} in weights.bin is truncated or "
                                    "corrupted; rebuild the module")
            weights[e["name"]] = np.frombuffer(chunk, dtype="<f4").reshape(e["shape"]).copy()
    from mhagen.lower import lower
    fuse = bool(man.get("fuse", True))
    from mhagen.tuning.records import Database, Tuning
    used = Tuning([Database(records=man.get("tuning") or [])])
    program = lower(graph, shapes["batch"], shapes["seq_len"], target, fuse=fuse, tuning=used)
    if program.describe() != man.get("program"):
        raise ArtifactError(f"{path} was built by a different mhagen (its kernels and buffers "
                            "differ from what this version lowers); rebuild it")
    rt = tvm.runtime.load_module(str(path / "kernel.so"))
    texts = {w: (path / f"{w}.txt").read_text() for w in TEXT_FILES
             if (path / f"{w}.txt").is_file()}
    return Module(graph, target, shapes["batch"], shapes["seq_len"], program, rt,
                  weights=weights, texts=texts, decisions=man.get("schedule", []), fuse=fuse,
                  tuning_records=man.get("tuning"), library_path=str(path / "kernel.so"))
