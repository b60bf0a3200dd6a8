"""build(): graph -> verify -> passes -> lower (TE / templates) -> schedule rules ->
tvm.compile (one library, one function per kernel) -> Module."""
from __future__ import annotations

import time

import tvm

from mhagen.checks import positive_int
from mhagen.core_module import CoreModule
from mhagen.errors import GraphError
from mhagen.ir.graph import Graph
from mhagen.lower import lower
from mhagen.lower.core import lower_core
from mhagen.maps import maps_graph
from mhagen.module import BuildInfo, Module
from mhagen.records.database import Database, Tuning
from mhagen.schedules import schedule_kernel
from mhagen.schedules.cpu.core import core_rule
from mhagen.target import resolve


def compile_program(program, backend, tuning=None):
    """Schedule every kernel (consulting `tuning` records) and compile them into one library
    for the backend's target; returns (executable, texts, decisions, device code). A backend
    with device code (CUDA) compiles it here too (its DeviceCode; texts["source"]: CUDA
    source, PTX, ptxas report); else the device code is None."""
    target = backend.target
    funcs, decisions = {}, []
    for kernel in program.compiled:   # a symbolic build's packed kernels too
        func, dec = schedule_kernel(kernel, target, record=_record(program, kernel, tuning),
                                    backend=backend)
        funcs[kernel.name] = func.with_attr("global_symbol", kernel.name)
        decisions += [d.__dict__ for d in dec]
    funcs.update(backend.storage_casts(program))
    mod = tvm.IRModule(funcs)
    executable = tvm.compile(mod, target=target.tvm)
    texts = {"te": program.te_text, "tir": mod.script()}
    device = backend.compile_device(executable, mod, program)
    if device is not None:
        texts["source"] = "\n".join([device.source, device.ptx, device.ptxas_report])
    return executable, texts, decisions, device


def _record(program, kernel, tuning):
    """The tuning record of one kernel, or None. Symbolic-length GEMMs take none: their
    traces were recorded on fixed shapes, the rules apply."""
    if not tuning or not program.tunable or (program.symbolic and kernel.template is None):
        return None
    return tuning.lookup(program.key(kernel.name))


def resolve_tuning(tuning, target):
    """"auto" (user database, then shipped records), None (defaults only), a database path,
    or a Tuning object."""
    if isinstance(tuning, Tuning):
        return tuning
    if tuning == "auto":
        return Tuning.default(target)
    if tuning is None or tuning == "none":
        return Tuning.none()
    return Tuning([Database.load(tuning, missing_ok=False)])


def build(layer: Graph, target="x86", *, batch: int | None = 1, seq_len: int | None = 128,
          weights=None, fuse: bool = True, tuning="auto", max_batch: int | None = None,
          max_seq_len: int | None = None, kv_seq_len: int | None = None,
          max_kv_seq_len: int | None = None, kv_block_size: int | None = None):
    """Compile `layer` for `target` (a preset name, "host", or a Target) into a Module.

    batch, seq_len: the input shape [batch, seq_len, d_model] the kernels are built for.
    seq_len=None with max_seq_len=N (and/or batch=None with max_batch=B): one module for every
    length 1..N (batch 1..B); the kernels take the call's lengths at run time (TVM symbolic
    shapes), buffers are allocated at the maximum, block tables hold for every length.
    Such builds use the default GEMM schedules, and the attention config tuned for the
    maximum shape when a record has it.
    kv_seq_len: the context's length of a cross-attention layer (mhagen.mha(..., cross=True));
    required for them (or kv_seq_len=None with max_kv_seq_len=T: any context length up to
    T), refused for others.
    kv_block_size: a decoding layer (kv_cache=) for a paged cache, mhagen.PagedKVCache, of
    blocks of that many tokens (a multiple of 16): module.new_paged_cache(num_blocks)."""
    if not isinstance(layer, Graph):
        raise GraphError(f"build() takes a mhagen graph (mhagen.mha(...) or a Graph), got "
                         f"{type(layer).__name__}")
    if len(layer.inputs) != 1 and not (len(layer.inputs) == 2 and layer.context_input):
        raise GraphError(f"build() compiles graphs with one input [batch, seq, d_model] (and "
                         f"a cross-attention layer's context); {layer.name!r} has "
                         f"{len(layer.inputs)}")
    cross = layer.context_input is not None
    if not cross and (kv_seq_len is not None or max_kv_seq_len is not None):
        raise GraphError(f"kv_seq_len is the context's length of a cross-attention layer; "
                         f"{layer.name!r} has one input: drop kv_seq_len / max_kv_seq_len")
    if cross and kv_seq_len is None and max_kv_seq_len is None:
        raise GraphError(f"{layer.name!r} is a cross-attention layer: give kv_seq_len=T, "
                         "the context's length (command line: --kv-seq-len T)")
    dims = {"batch": (batch, max_batch), "seq_len": (seq_len, max_seq_len)}
    if cross:
        dims["kv_seq_len"] = (kv_seq_len, max_kv_seq_len)
    sizes, symbolic = {}, {}
    for name, (fixed, most) in dims.items():
        if fixed is None and most is None:
            raise GraphError(f"{name}=None builds for every {name} up to max_{name}: give "
                             f"max_{name}=N too")
        if fixed is not None and most is not None:
            raise GraphError(f"max_{name} goes with {name}=None (a symbolic length); got "
                             f"{name}={fixed!r} and max_{name}={most!r}: drop one")
        sizes[name] = positive_int(name if fixed is not None else f"max_{name}",
                                   fixed if fixed is not None else most)
        symbolic[{"batch": "batch", "seq_len": "seq"}.get(name, "kv_seq")] = fixed is None
    batch, seq_len, kv_seq_len = sizes["batch"], sizes["seq_len"], sizes.get("kv_seq_len")
    symbolic = symbolic if any(symbolic.values()) else None
    t = resolve(target)
    start = time.perf_counter()
    backend = t.backend()
    tuning = resolve_tuning(tuning, t)
    program = lower(layer, batch, seq_len, t, fuse=fuse, tuning=tuning, symbolic=symbolic,
                    kv_seq_len=kv_seq_len, backend=backend, kv_block_size=kv_block_size)
    executable, texts, decisions, device = compile_program(program, backend, tuning)
    tuned = {d["kernel"] for d in decisions if d["source"] == "tuned"}
    used = [tuning.lookup(program.key(k)) for k in sorted(tuned)]
    info = BuildInfo(fuse=fuse, texts=texts, decisions=decisions, tuning_records=used,
                     compile_seconds=time.perf_counter() - start, executable=executable,
                     device_code=device)
    return Module(layer, t, batch, seq_len, program, executable.mod, weights=weights, info=info,
                  kv_seq_len=kv_seq_len, compile_maps=compile_maps)


def build_core(core, target="x86", *, weights=None,
               max_batch: int | None = None, max_seq_len: int | None = None,
               max_kv_seq_len: int | None = None, lazy: bool = False, **unknown):
    """Compile an attention core (mhagen.attention_core) for `target` into a CoreModule
    (mhagen/core_module.py): kernels for single queries (decoding steps), for prompts
    (q_len == kv_len, up to max_seq_len: the prefill template's block table, default 4096)
    and for any other q_len, all for every batch and kv_len. max_batch, max_seq_len
    (q_len), max_kv_seq_len: limits the calls are checked against, when given. lazy: each
    kernel compiled on its first call instead (what mhagen.hf's interface does: a model
    that only decodes or only encodes compiles one or two). A core has no weights; it runs
    its templates' default configs (no tuning records)."""
    if weights is not None:
        raise GraphError("an attention core has no weights (q, k and v come projected): "
                         "drop weights=")
    if unknown:
        raise GraphError(f"build() of an attention core takes max_batch, max_seq_len, "
                         f"max_kv_seq_len and lazy (every batch and length runs); got "
                         f"{', '.join(sorted(unknown))}")
    limits = {name: positive_int(name, value) for name, value in
              (("max_batch", max_batch), ("max_seq_len", max_seq_len),
               ("max_kv_seq_len", max_kv_seq_len)) if value is not None}
    t = resolve(target)
    start = time.perf_counter()
    backend = t.backend()
    rule = core_rule(backend)
    program = lower_core(core, rule, backend, limits.get("max_batch", 64),
                         limits.get("max_seq_len", 4096),
                         limits.get("max_kv_seq_len", limits.get("max_seq_len", 4096)))

    def scheduled(kernel):
        func = backend.finalize(rule.build(kernel.workload, kernel.config, t))
        backend.verify(kernel, func)
        return func.with_attr("global_symbol", kernel.name)

    def compile_kernel(kernel, texts):
        mod = tvm.IRModule({kernel.name: scheduled(kernel)})
        texts[kernel.name] = mod.script()
        return tvm.compile(mod, target=t.tvm).mod[kernel.name]

    if lazy:
        return CoreModule(core, t, program, limits=limits, compile_kernel=compile_kernel,
                          compile_seconds=time.perf_counter() - start)
    mod = tvm.IRModule({k.name: scheduled(k) for k in program.kernels})
    library = tvm.compile(mod, target=t.tvm).mod
    return CoreModule(core, t, program, library, texts={"tir": mod.script()},
                      compile_seconds=time.perf_counter() - start, limits=limits)


def compile_maps(graph: Graph, target, batch: int, seq_len: int) -> Module:
    """The attention-maps module of `graph` at [batch, seq_len] (mhagen/maps.py: its
    unfused program up to every head's softmax), for Module.attention_maps."""
    return build(maps_graph(graph, batch, seq_len), target, batch=batch, seq_len=seq_len,
                 fuse=False)
