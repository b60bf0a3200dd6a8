"""Module: a compiled layer you call with numpy arrays (the call API and its input checks).

Built by mhagen.build (mhagen/compile.py) or made of a read artifact by mhagen.load
(Module.from_artifact; mhagen/artifact/load.py reads it); the arrays the kernels take and the
runtime arguments live in mhagen/staging.py, the storage dtype's conversions in
mhagen/storage.py, inspection in mhagen/inspection.py, saving in mhagen/artifact/save.py.
Calling a module needs only tvm-ffi and TVM's runtime library (mhagen/runtime.py), never the
compiler.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mhagen import inspection, runtime
from mhagen.artifact.save import save_module
from mhagen.cost import graph_flops
from mhagen.dtypes import name_of, numpy_dtype
from mhagen.errors import ArtifactError, InputError, TargetError
from mhagen.inputs import answered, argument, shared
from mhagen.decode_call import PreparedDecode, decode_arguments
from mhagen.kvcache import KVCache, cache_shape, check_room
from mhagen.paged_cache import PagedKVCache
from mhagen.maps import head_softmaxes
from mhagen.program import multiplies
from mhagen.call_checks import (check_cache, check_context, check_input, check_length_range,
                              check_lengths)
from mhagen.staging import Staging, aligned_copy, deliver
from mhagen.storage import StorageCasts
from mhagen.weights import check_weights

@dataclass
class BuildInfo:
    """How a module was made: what inspection, saving and the CLI report."""
    fuse: bool = True
    texts: dict = field(default_factory=dict)      # te, tir, source (assembly)
    decisions: list = field(default_factory=list)  # schedule decisions per stage
    tuning_records: list = field(default_factory=list)
    compile_seconds: float | None = None
    executable: object = None    # tvm Executable of a fresh build (export_library saves it)
    device_code: object = None   # GPU builds: the device code compiled at build time
                                 # (schedules/cuda/nvcc.py DeviceCode: fatbin, PTX, ptxas report)
    library_path: str | None = None  # kernel.so of a loaded module


class Module:
    """A layer compiled for one target and one input shape [batch, seq_len, d_model], or,
    built with seq_len=None (batch=None), for every shape up to [batch, seq_len, d_model]
    (`symbolic`: then batch and seq_len are the maxima, and each call's x sets the shape).

    `module(x)` runs it on a numpy array x of the layer's dtype (float32 by default; see
    mhagen/dtypes.py: a half-precision layer also takes float32, rounded on the way in,
    and then returns float32; on CPUs its library converts both, schedules/casts.py) and
    returns a new array; a torch CPU tensor or DLPack array of those dtypes is read in its
    own memory as well, and a torch x gets a torch tensor back (over the answer's memory);
    other inputs (lists, float64 or integer arrays) are converted to float32 first, or
    refused (mhagen/inputs.py: the input policy);
    `module(x, out=y)` writes into y instead (as numpy ufuncs do: no allocation per call);
    `module(x, weights=w)` uses other weights for that call (same names and shapes).
    compile_maps: the compiler's function that builds the attention-maps module
    (mhagen.compile.compile_maps), given by build() and mhagen.load() so that running a
    module needs no compiler; without it attention_maps() is refused.
    A Module owns its temporaries, so calls from several threads are serialised by a lock
    (correct, one at a time); for parallel calls give each thread its own module.
    """

    def __init__(self, graph, target, batch, seq_len, program, library, *, weights=None,
                 info: BuildInfo | None = None, kv_seq_len: int | None = None,
                 compile_maps=None):
        self.graph, self.target = graph, target
        self.batch, self.seq_len = batch, seq_len
        self.kv_seq_len = kv_seq_len        # a cross-attention layer's context length
        self.program = program
        self.library = library
        self.info = info or BuildInfo()
        # Code for another architecture (a cross build) or for CPU features this machine
        # lacks (an AVX-512 build on an AVX2 host) is saved, never called: the first would
        # start LLVM's JIT, which refuses a foreign architecture, the second dies of SIGILL.
        self.cannot_run = target.cannot_run()
        self.d_model = graph.inputs[0].attrs["shape"][2]
        self.out_shape = tuple(graph.shapes(**graph.dims(batch, seq_len, kv_seq_len))[
            graph.output])
        self._cache_spec = cache_shape(graph)     # a decoding layer's cache, else None
        self._cache_dtype = self._cache_spec and numpy_dtype(self._cache_spec["dtype"])
        self.symbolic = program.symbolic           # {"batch": bool, "seq": bool, ...} or None
        self.dtype = numpy_dtype(graph.dtype)      # storage of x, out and the weights
        # the graph's optional inputs, looked up once: a call checks each
        self._lengths_node = graph.lengths_input
        self._cache_lens_node = graph.cache_lens_input
        self._context_node = graph.context_input
        # decoding forms (mhagen/decode_call.py): rows of their own token counts packed
        # (seq_len=None builds), a paged cache (built with kv_block_size=)
        self._packed = "cu_seqlens" in program.buffers
        self._paged = "block_tables" in program.buffers
        self.kv_block_size = program.buffers["k_cache"].shape[2] if self._paged else None
        self.storage = StorageCasts(library, self.dtype)     # the storage dtype's conversions
        self.staging = Staging(graph, program, library, self.dtype, self.out_shape[2])
        self._lock = threading.Lock()
        self._compile_maps = compile_maps
        self._maps = None            # the attention-maps module, compiled on first use
        self._maps_for = None        # the weights it holds
        self.weights = self._params = None
        if weights is not None:
            self.bind(weights)

    @classmethod
    def from_artifact(cls, loaded, *, compile_maps=None) -> "Module":
        """The module of a read artifact (mhagen.artifact.load.LoadedArtifact), its weights
        bound with the params as stored (no repacking)."""
        man, shapes, program = loaded.manifest, loaded.shapes, loaded.program
        info = BuildInfo(fuse=bool(man.get("fuse", True)), texts=loaded.texts,
                         decisions=man.get("schedule") or [],
                         tuning_records=man.get("tuning") or [],
                         library_path=str(loaded.kernel_path))
        try:
            module = cls(loaded.graph, loaded.target, shapes["batch"], shapes["seq_len"],
                         program, loaded.library, info=info,
                         kv_seq_len=shapes.get("kv_seq_len"), compile_maps=compile_maps)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            # the content hash holds, so the manifest was written like this (by hand or a tool)
            raise ArtifactError(f"{loaded.path}/manifest.json is malformed "
                                f"({type(err).__name__}: {str(err)[:300]}); rebuild the "
                                "module") from None
        if loaded.weights is not None:
            try:
                module.bind(loaded.weights,
                            params={b.name: aligned_copy(loaded.params[b.name], b)
                                    for b in program.role("param")})
            except InputError as err:    # the manifest's weight table and graph disagree
                raise ArtifactError(f"{loaded.path}: the weights do not fit the manifest's "
                                    f"graph ({err}); rebuild the module") from None
        return module

    @property
    def decisions(self) -> list:
        """The schedule decisions per stage (BuildInfo.decisions)."""
        return self.info.decisions

    @property
    def tuning_records(self) -> list:
        """The tuning records the build used (BuildInfo.tuning_records)."""
        return self.info.tuning_records

    @property
    def compile_seconds(self) -> float | None:
        """How long the build took (BuildInfo.compile_seconds; None: a loaded module)."""
        return self.info.compile_seconds

    @property
    def precision(self) -> str | None:
        """How a half-precision module computes on its target (None: a float32 layer)."""
        packs = {b.name: b.pack or {} for b in self.program.buffers.values()}
        tiles = [n for n, p in packs.items() if p.get("amx")]
        paired = [n for n, p in packs.items() if p.get("pairs") and not p.get("amx")]
        attention = next((multiplies(k) for k in self.program.kernels
                          if k.name == "attention"), None)
        return self.target.backend().precision_path(self.graph.dtype, paired,
                                                              attention, tiles)

    @property
    def bound_params(self) -> dict | None:
        """The bound weights repacked for the kernels (name -> array), None before bind."""
        return self._params

    @property
    def in_shape(self):
        return (self.batch, self.seq_len, self.d_model)

    def bind(self, weights, *, params=None) -> "Module":
        """Bind weights: checked, repacked for the kernels once. `params` (a loaded
        artifact's packed params, weights.safetensors) are taken as they are instead of repacking."""
        self.weights = check_weights(self.graph, weights, dtype=self.dtype)
        self._params = params if params is not None else self.staging.pack(self.weights)
        return self

    def __call__(self, x, weights=None, *, out=None, kv_lens=None, cache=None,
                 context=None, cu_seqlens=None, seqs=None) -> np.ndarray:
        """kv_lens: per-batch key lengths (int, [batch]) of a layer built with key padding.
        cache: the mhagen.KVCache of a decoding layer (mhagen.mha(..., kv_cache=N)); x holds
        the new tokens, whose K/V rows the call writes into the cache before attending;
        cache.lens then advances by seq_len. context: the keys' and values' input of a
        cross-attention layer, [batch, kv_seq_len, kv_dim].
        Decoding modules built with seq_len=None: cu_seqlens (int, [rows + 1]) gives each
        cache row its own number of new tokens, x [1, total, d_model] holding them packed
        (the output likewise); built with kv_block_size=: cache a mhagen.PagedKVCache and
        seqs its sequences the call's rows are (mhagen/decode_call.py)."""
        if self._packed or self._paged:
            return self._call_decoding(x, weights, out, cache, cu_seqlens, seqs)
        if cu_seqlens is not None or seqs is not None:
            raise InputError("cu_seqlens= and seqs= are for decoding modules built with "
                             "seq_len=None (each row's own new tokens) or kv_block_size= "
                             "(a paged cache)")
        with self._lock:
            given = x
            x, returns = self._check_x(x)
            buffers, dims = self._buffers(x, weights, kv_lens, cache, context)
            result, target = self.staging.output_array(out, dims, returns)
            buffers[self.staging.output.name] = runtime.tensor(target)
            self.staging.run(buffers)
            if cache is not None:
                cache.lens += dims["seq"]
            return answered(self.storage.deliver(result, target), given, out)

    def prepare(self, x, *, out=None, kv_lens=None, cache=None, context=None,
                cu_seqlens=None, seqs=None) -> "Call":
        """Bind one call's arrays once and get a callable that runs the kernels on them with
        almost no Python work (ONNX Runtime's I/O binding, a CUDA graph): for decode loops,
        where module(x, cache=...) spends 20-80 us of Python per call. Between runs write the
        next input into x (and kv_lens, context) in place; each run of a decoding call
        advances cache.lens by seq_len, as module(x, cache=...) does. x (and context) must be
        64-byte aligned arrays of the module's dtype (mhagen.aligned_empty; torch CPU tensors
        and DLPack arrays too, through their memory), so the kernels read them where they
        are, and kv_lens a numpy integer array or integer tensor: nothing is converted here
        (mhagen/inputs.py: a copy would not see the next run's values); the output is
        `out`, or one array made here (a torch tensor over it where x is a tensor),
        returned by every run. The weights are those bound now: a later bind() makes runs raise."""
        reads = ("prepare() reads it in place every run: mhagen.aligned_empty(shape, "
                 f"{name_of(self.dtype)!r})")
        given = x     # torch tensors and DLPack arrays: bound through a view of their memory
        x = argument(x, "x", dtype=self.dtype, in_place=reads, aligned=True)
        if context is not None:
            context = argument(context, "context", dtype=self.dtype, in_place=reads,
                               aligned=True)
        if kv_lens is not None:
            kv_lens = shared(kv_lens, "kv_lens")
        if kv_lens is not None and not (isinstance(kv_lens, np.ndarray)
                                        and np.issubdtype(kv_lens.dtype, np.integer)):
            raise InputError("kv_lens must be a numpy integer array (prepare() reads it anew "
                             "every run: change it in place; an integer CPU tensor too), got "
                             f"{getattr(kv_lens, 'dtype', type(kv_lens).__name__)}")
        if self._packed or self._paged:
            return self._prepare_decoding(x, out, cache, cu_seqlens, seqs)
        with self._lock:
            x, _ = self._check_x(x)
            buffers, dims = self._buffers(x, None, kv_lens, cache, context)
            result, target = self.staging.output_array(out, dims, self.dtype)
            buffers[self.staging.output.name] = runtime.tensor(target)
        # (the module's staging array, the caller's array, its check) for the lengths the
        # kernels read, copied and checked every run
        staged = []
        if kv_lens is not None:
            staged.append((self.staging.staged(self.program.buffers[self._lengths_node.name],
                                               dims)[0], kv_lens,
                           lambda lens: check_length_range(lens, dims["kv_seq"])))
        if cache is not None:
            staged.append((self.staging.staged(
                self.program.buffers[self._cache_lens_node.name], None)[0], cache.lens,
                           lambda lens: check_room(lens, x.shape[1], cache.max_len)))
        return Call(self, [(self.library[k.name], [buffers[a] for a in k.args])
                           for k in self.program.kernels], staged, cache, x.shape[1], result,
                    target, answered(result, given, out))

    def new_cache(self) -> KVCache:
        """An empty K/V cache for this decoding module's batch (see mhagen/kvcache.py)."""
        if self._paged:
            raise InputError("this module reads a paged cache (built with kv_block_size="
                             f"{self.kv_block_size}): module.new_paged_cache(num_blocks)")
        return KVCache.empty(self, self.batch)

    def new_paged_cache(self, num_blocks: int) -> PagedKVCache:
        """An empty pool of num_blocks blocks for this module (built with kv_block_size=;
        see mhagen/paged_cache.py)."""
        if not self._paged:
            raise InputError("this module reads a contiguous KVCache (module.new_cache()); "
                             "build with kv_block_size=16 for a paged one")
        return PagedKVCache.for_module(self, num_blocks)

    def _call_decoding(self, x, weights, out, cache, cu_seqlens, seqs):
        """A packed or paged decoding module's call (mhagen/decode_call.py)."""
        with self._lock:
            buffers, dims, args, returns = self._decoding_buffers(x, weights, cache,
                                                                  cu_seqlens, seqs)
            kernel_shape = (dims["batch"], dims["seq"], self.out_shape[2])
            if isinstance(out, np.ndarray) and out.shape == args.out_shape \
                    and out.flags.c_contiguous:
                out = out.reshape(kernel_shape)    # a view: the kernels' [1, total] rows
            result, target = self.staging.output_array(out, dims, returns)
            buffers[self.staging.output.name] = runtime.tensor(target)
            self.staging.run(buffers)
            args.advance()
            return self.storage.deliver(result, target).reshape(args.out_shape)

    def _decoding_buffers(self, x, weights, cache, cu_seqlens, seqs, stage=True):
        """(the kernels' arguments, the call's dims, its DecodeArgs, the dtype it answers
        in) of a packed or paged decoding call, every argument checked first; stage: then
        make room in a paged cache and fill the lengths, offsets and block tables."""
        if self.cannot_run is not None:
            raise TargetError(f"cannot call this module: {self.cannot_run} (it can still be "
                              "saved and run where it fits)")
        args = decode_arguments(self, x, cache, cu_seqlens, seqs)
        params = self._params_for(weights)
        returns = args.x.dtype
        x = self.storage.deferred("x", args.x)
        dims = self.program.call_dims(args.batch, args.seq)
        buffers = self.staging.arguments(params, x, dims, self.storage)
        if stage:
            buffers.update(args.stage(self))
        return buffers, dims, args, returns

    def _prepare_decoding(self, x, out, cache, cu_seqlens, seqs) -> PreparedDecode:
        """prepare() of a packed or paged decoding module: x (checked by prepare) is read in
        place every run, with the rows' counts given now."""
        with self._lock:
            buffers, dims, args, _ = self._decoding_buffers(x, None, cache, cu_seqlens, seqs,
                                                            stage=False)
            buffers.update(args.tensors(self))
            kernel_shape = (dims["batch"], dims["seq"], self.out_shape[2])
            if isinstance(out, np.ndarray) and out.shape == args.out_shape \
                    and out.flags.c_contiguous:
                out = out.reshape(kernel_shape)
            result, target = self.staging.output_array(out, dims, self.dtype)
            buffers[self.staging.output.name] = runtime.tensor(target)
        return PreparedDecode(self, [(self.library[k.name], [buffers[a] for a in k.args])
                                     for k in self.program.kernels], args, result, target)

    def _params_for(self, weights):
        """The kernels' params: of `weights` (checked, packed) or the bound ones."""
        if weights is not None:
            return self.staging.pack(check_weights(self.graph, weights, dtype=self.dtype))
        if self._params is not None:
            return self._params
        raise InputError("no weights: pass weights= to mhagen.build(), call "
                         "module.bind(weights), or call module(x, weights=...)")

    def _buffers(self, x, weights, kv_lens=None, cache=None, context=None):
        """(the kernels' arguments by name: Staging.arguments; the call's dims:
        Program.call_dims), the call's other inputs checked. x: checked by _check_x."""
        if self.cannot_run is not None:
            raise TargetError(f"cannot call this module: {self.cannot_run} (it can still be "
                              "saved and run where it fits)")
        batch, seq = x.shape[:2]
        # each check also refuses an argument the layer takes none of
        if context is not None or self._context_node is not None:
            context = self._check_context(context, batch)
        kv_seq = seq if context is None else context.shape[1]
        dims = self.program.call_dims(batch, seq, kv_seq)
        lens = None
        if kv_lens is not None or self._lengths_node is not None:
            lens = check_lengths(self.graph, kv_lens, batch, kv_seq)
        if cache is not None or self._cache_lens_node is not None:
            cache = check_cache(self.graph, cache, batch, seq, self._cache_dtype,
                                self._cache_spec)
        params = self._params_for(weights)
        buffers = self.staging.arguments(params, x, dims, self.storage, lens, cache, context)
        return buffers, dims

    def _check_x(self, x):
        """(x as the kernels take it, the dtype the call answers in): x in the layer's
        dtype as it is, anything else converted to float32 (mhagen/inputs.py) and then, for
        a half layer, rounded into storage (StorageCasts.deferred), the answer then in float32."""
        if type(x) is np.ndarray and x.dtype == self.dtype and x.shape == self.in_shape:
            return x, self.dtype
        x = check_input(self.graph, x, self.storage.takes)
        if self.symbolic:
            self._check_symbolic_x(x)
        elif x.shape != self.in_shape:
            raise InputError(f"x has shape {x.shape}, but this module was built for "
                             f"{self.in_shape} (batch, seq_len, d_model); rebuild with "
                             f"mhagen.build(layer, batch={x.shape[0]}, seq_len={x.shape[1]})")
        return self.storage.deferred("x", x), x.dtype

    def _check_context(self, context, batch):
        """A cross-attention layer's context, checked: float32 [batch, kv_seq_len, kv_dim]."""
        context = check_context(self.graph, context, batch, self.storage.takes)
        if context is None:
            return None
        want = (batch, self.kv_seq_len, self.graph.context_input.attrs["shape"][2])
        if self.symbolic and self.symbolic.get("kv_seq"):
            if not 1 <= context.shape[1] <= self.kv_seq_len:
                raise InputError(f"context has kv_seq_len {context.shape[1]}; this module runs "
                                 f"kv_seq_len 1..{self.kv_seq_len} (rebuild with "
                                 f"max_kv_seq_len={context.shape[1]})")
            want = want[:1] + context.shape[1:2] + want[2:]
        if context.shape != want:
            raise InputError(f"context has shape {context.shape}, but this module was built "
                             f"for {want} (batch, kv_seq_len, kv_dim); rebuild with "
                             f"mhagen.build(layer, ..., kv_seq_len={context.shape[1]})")
        return np.ascontiguousarray(self.storage.deferred("context", context))

    def _check_symbolic_x(self, x):
        names = ("batch", "seq_len")
        for axis, (name, key) in enumerate(zip(names, ("batch", "seq"))):
            most = self.in_shape[axis]
            if self.symbolic[key] and not 1 <= x.shape[axis] <= most:
                raise InputError(f"x has {name} {x.shape[axis]}; this module runs {name} 1.."
                                 f"{most} (rebuild with max_{name}={x.shape[axis]})")
            if not self.symbolic[key] and x.shape[axis] != most:
                raise InputError(f"x has {name} {x.shape[axis]}; this module was built for "
                                 f"{name}={most} (rebuild with {name}=None, "
                                 f"max_{name}=N for any)")
        if x.shape[2] != self.d_model:
            raise InputError(f"x has d_model {x.shape[2]}, this module takes {self.d_model}")

    def latency(self, x=None, *, number: int = 10, repeat: int = 5, min_repeat_ms: int = 50,
                kv_lens=None, cache=None, context=None, seqs=None):
        """Median seconds per call (kernels only, weights bound) over `repeat` runs of at
        least `number` calls and `min_repeat_ms` each (key padding: full lengths unless
        kv_lens is given; decoding: every call appends at the same place of `cache`, by
        default a cache full up to its last seq_len rows, for a paged module a pool of
        batch such sequences, or `seqs` of the paged cache given; cross-attention: a random
        context unless given)."""
        rng = np.random.default_rng(0)
        if x is None:
            x = rng.standard_normal(self.in_shape).astype(np.float32).astype(self.dtype)
        x = check_input(self.graph, x, self.storage.takes)
        node = self.graph.context_input
        if context is None and node is not None:
            context = rng.standard_normal((x.shape[0], self.kv_seq_len,
                                           node.attrs["shape"][2])).astype(np.float32
                                                                           ).astype(self.dtype)
        if kv_lens is None and self.graph.lengths_input is not None:
            kv_lens = np.full(x.shape[0], x.shape[1] if node is None else self.kv_seq_len,
                              np.int32)
        if cache is None and self._paged:   # every row's sequence at max_len - seq_len
            cache = self.new_paged_cache(self.batch * -(-self._cache_spec["max_len"]
                                                        // self.kv_block_size))
            seqs = [cache.add() for _ in range(self.batch)]
            held = [self._cache_spec["max_len"] - self.seq_len] * self.batch
            cache.reserve(seqs, held)
            cache.advance(seqs, held)
        elif cache is None and self.graph.cache_lens_input is not None:
            cache = self.new_cache()
            cache.lens[...] = cache.max_len - self.seq_len
        with self._lock:
            return self._latency(x, number, repeat, min_repeat_ms, kv_lens, cache, context,
                                 seqs)

    def _latency(self, x, number, repeat, min_repeat_ms, kv_lens, cache, context, seqs=None):
        if self._packed or self._paged:
            buffers, dims, _, _ = self._decoding_buffers(x, None, cache, None, seqs)
        else:
            x, _ = self._check_x(x)
            buffers, dims = self._buffers(x, None, kv_lens, cache, context)
        staging = self.staging
        buffers[staging.output.name] = runtime.tensor(staging.view(staging.output, dims))
        staging.run(buffers)
        results = []
        for _ in range(repeat):
            n, start = 0, time.perf_counter()
            while n < number or (time.perf_counter() - start) * 1e3 < min_repeat_ms:
                staging.run(buffers)
                n += 1
            results.append((time.perf_counter() - start) / n)
        return float(np.median(results))

    def attention_maps(self, x, *, kv_lens=None) -> np.ndarray:
        """Every head's attention probabilities for input x: float32 [batch, heads, seq, seq]
        (rows: queries, columns: keys; masked keys 0). Compiled on first use as a second,
        unfused program of the same layer (mhagen/maps.py): needs the compiler then.
        A torch tensor x gets a torch tensor (over the maps' memory)."""
        given = x
        if self.weights is None:
            raise InputError("no weights: bind them (module.bind(weights)) before asking "
                             "for attention maps")
        x = check_input(self.graph, x, self.storage.takes)
        batch, seq = self.batch, self.seq_len
        if self.symbolic:     # maps for the call's shape (one unfused build per shape)
            batch, seq = x.shape[:2]
        if self._maps is None or self._maps.in_shape[:2] != (batch, seq):
            if self._compile_maps is None:
                raise InputError("attention maps need the compiler: use a module from "
                                 "mhagen.build() or mhagen.load()")
            self._maps = self._compile_maps(self.graph, self.target, batch, seq)
            self._maps_for = None
        if self._maps_for is not self.weights:   # first use, or weights bound since
            names = {s.name for s in self._maps.graph.weight_specs()}
            self._maps.bind({k: v for k, v in self.weights.items() if k in names})
            self._maps_for = self.weights
        heads = len(head_softmaxes(self.graph))
        if self.dtype != np.float32:   # the half layer's own rounded x, in float32
            x = self.storage.stored("x", x).astype(np.float32)
        p = self._maps(x, kv_lens=kv_lens)
        b, s, _ = p.shape
        return answered(np.ascontiguousarray(p.reshape(b, s, heads, -1).transpose(0, 2, 1, 3)),
                        given)

    def flops(self, batch=None, seq_len=None) -> int:
        """Floating-point operations of one call (2 per multiply-add of every matmul), at the
        built shape or (symbolic builds) at batch x seq_len."""
        return graph_flops(self.graph, **self.graph.dims(batch or self.batch,
                                                          seq_len or self.seq_len,
                                                          self.kv_seq_len))

    def inspect(self, what: str = "graph") -> str:
        """One stage as text: graph, te, tir (scheduled), source (assembly), schedule, manifest."""
        return inspection.inspect(self, what)

    def save(self, path, *, c_api=True, self_contained=False):
        """Write the module to directory `path` (created); returns the path. c_api=False
        skips the C API (mha.h, libmha.so); self_contained=True copies TVM's runtime
        libraries into lib/ instead of linking mhagen's cache. See mhagen/artifact/save.py."""
        return save_module(self, path, c_api=c_api, self_contained=self_contained)

    def __repr__(self):
        shape = self.in_shape
        if self.symbolic:   # (1..B, 1..S, D): the axes each call sets
            shape = "(" + ", ".join(f"1..{n}" if self.symbolic.get(k) else str(n) for n, k in
                                    zip(shape, ("batch", "seq", "d_model"))) + ")"
        return (f"<mhagen.Module {self.graph.name} on {self.target.name} x{shape} "
                f"-> {self.out_shape[2]} features, weights "
                f"{'bound' if self._params else 'not bound'}>")


class Call:
    """One call of a module with its arrays bound (Module.prepare): call it to run."""

    def __init__(self, module, kernels, staged, cache, seq, result, target, answer):
        self.module, self.kernels, self.staged, self.cache = module, kernels, staged, cache
        self.params, self.seq, self.result, self.target = module._params, seq, result, target
        self.answer = answer     # what each run returns: result, or out= / a tensor over it

    def __call__(self):
        m = self.module
        if m._params is not self.params:
            raise InputError("the module's weights were bound again after prepare(): "
                             "prepare the call again")
        with m._lock:
            for staging, source, check in self.staged:
                staging[...] = source
                check(staging)
            for func, args in self.kernels:
                func(*args)
            if self.cache is not None:
                self.cache.lens += self.seq
            deliver(self.result, self.target)
            return self.answer
