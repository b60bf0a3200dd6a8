"""The `mhagen` command line: build, run, inspect, bench, tune, export-onnx, import-onnx.

Errors in options or layers print one line `mhagen CMD: error: ...` and exit with status 2.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from inspect import signature
from pathlib import Path

import mhagen
from mhagen.artifact.describe import damaged_files, describe
from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError, MhagenError
from mhagen.inspection import INSPECT_KINDS
from mhagen.ir.kinds import SUPPORTED_DTYPES
from mhagen.kvcache import KVCache, cache_shape
from mhagen.module import Module
from mhagen.onnx.cli import add_parsers
from mhagen.records.database import describe_record
from mhagen.runtime import num_threads, set_num_threads
from mhagen.targets import preset_names
from mhagen.tolerances import judged_as, tolerance
from mhagen.extras import require_tuning_dependencies
from mhagen.version import version_text


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Fail(Exception):
    pass


def _layer_options(p):
    g = p.add_argument_group("layer")
    g.add_argument("--graph", type=Path, help="a graph JSON file (instead of the options below)")
    g.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    g.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    g.add_argument("--head-dim", type=int, help="width per head (default d_model / heads)")
    g.add_argument("--kv-heads", type=int, help="K/V heads for grouped/multi-query attention")
    g.add_argument("--causal", action="store_true", help="causal mask")
    g.add_argument("--no-bias", action="store_true", help="projections without bias")
    g.add_argument("--scale", type=float, metavar="S",
                   help="the factor on the scores Q K^T (default 1/sqrt(head_dim); T5: 1.0)")
    g.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES,
                   help="storage of x, the output and the weights (compute: float32, or "
                        "bfloat16 on AMX tiles or AVX-512 BF16 pairs)")
    g.add_argument("--kv-cache", type=int, metavar="N",
                   help="a decoding layer with a K/V cache of N tokens (--seq-len is then the "
                        "new tokens per call; checked on a half-full cache, timed on a full "
                        "one)")
    g.add_argument("--cache-dtype", choices=SUPPORTED_DTYPES,
                   help="what the K/V cache stores (--kv-cache; default float32)")
    g.add_argument("--cross", action="store_true",
                   help="cross-attention: keys and values from a second input, the context "
                        "(its length: --kv-seq-len)")
    g.add_argument("--kv-dim", type=int, help="the context's width (--cross; default d_model)")


def _target_option(p):
    p.add_argument("--target", default="x86", metavar="PRESET",
                   help=f"target preset: {', '.join(preset_names())} (default x86: this "
                        "machine's CPU)")


def _shape_options(p, seed_help=None):
    """Target, shape and fusion options; seed_help: what --seed seeds (None: no --seed)."""
    _target_option(p)
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--max-seq-len", type=int, metavar="N",
                   help="one module for every sequence length up to N (symbolic shapes); "
                        "--seq-len is then the length it is checked and timed at")
    p.add_argument("--kv-seq-len", type=int, metavar="T",
                   help="the context's length of a cross-attention layer (--cross)")
    _kv_block_size_option(p, "a decoding layer (--kv-cache) reading a paged K/V cache of "
                             "blocks of B tokens (a multiple of 16); checked and timed on a "
                             "pool whose blocks are shuffled")
    if seed_help:
        p.add_argument("--seed", type=int, default=0, help=f"seed of {seed_help} (default 0)")
    p.add_argument("--no-fuse", action="store_true",
                   help="compile node by node (no fused QKV GEMM / attention kernels)")


def _kv_block_size_option(p, text):
    p.add_argument("--kv-block-size", type=int, metavar="B", help=text)


def _layer(args):
    if args.graph:
        try:
            return mhagen.Graph.from_json(args.graph.read_text())
        except OSError as err:
            raise InputError(f"cannot read {args.graph}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise InputError(f"{args.graph} is not a graph JSON file (it is not text); "
                             "write one with layer.to_json()") from None
    return mhagen.mha(args.d_model, args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
                      causal=args.causal, bias=not args.no_bias,
                      scale=getattr(args, "scale", None), kv_cache=getattr(args, "kv_cache", None),
                      cross=getattr(args, "cross", False), kv_dim=getattr(args, "kv_dim", None),
                      dtype=getattr(args, "dtype", "float32"),
                      cache_dtype=getattr(args, "cache_dtype", None))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mhagen", description="A compiler for multi-head attention layers.")
    p.add_argument("--version", action="version", version=version_text(),
                   help="print mhagen's and TVM's versions")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    p.commands = sub.choices     # to report unknown flags in the command's own name

    b = sub.add_parser("build", help="compile a layer, check it against the reference, time it",
                       description="Compile a layer for a target, compare it with the float64 "
                                   "numpy reference, report the median latency; --out saves "
                                   "it (for mhagen run, mhagen.load and the C API).")
    _layer_options(b)
    _shape_options(b, seed_help="the random input (and of the weights, without --weights)")
    b.add_argument("--weights", type=Path, metavar="FILE",
                   help="the layer's weights: a .safetensors or .npz of name -> array (as "
                        "import-onnx --out and mhagen.save_weights write), checked against "
                        "the layer (default: random, from --seed)")
    b.add_argument("--records", type=Path, metavar="DB",
                   help="the tuning database to use (written by mhagen tune --db DB), "
                        "instead of the user's database and the shipped records")
    b.add_argument("--out", type=Path, metavar="DIR",
                   help="save the compiled module to this directory")
    b.add_argument("--no-c-api", action="store_true",
                   help="with --out: leave out the C API (mha.h, libmha.so); a faster save, "
                        "for mhagen run and mhagen.load")
    b.add_argument("--self-contained", action="store_true",
                   help="with --out: copy TVM's runtime libraries into DIR/lib, so the C API "
                        "runs where mhagen is not installed")
    b.add_argument("--repeat", type=int, default=5, help="timing repeats (median is reported)")

    r = sub.add_parser("run", help="run a saved module on inputs from files; print its latency",
                       description="Load a module saved by build --out (its files checked "
                                   "against the manifest), run it on the arrays of --inputs, "
                                   "print the output's shape and the median latency; "
                                   "--outputs saves the output.")
    r.add_argument("artifact", type=Path, metavar="ARTIFACT",
                   help="a directory written by build --out")
    r.add_argument("--inputs", type=Path, metavar="FILE",
                   help="a .npy holding x, or a .npz of the module's inputs by name: "
                        f"{', '.join(_RUN_INPUTS)} (the cache arrays of a decoding layer: "
                        "default an empty cache)")
    r.add_argument("--outputs", type=Path, metavar="FILE.npz",
                   help="write the output y here (and, for a decoding layer, the cache after "
                        "the call: k_cache, v_cache, cache_lens)")
    r.add_argument("--repeat", type=int, default=5, help="timing repeats (median is reported)")

    i = sub.add_parser("inspect", help="print a module's graph, TE, TIR, source or manifest",
                       description="Show one stage of a saved module (DIR), or of a layer "
                                   "built from the options (without DIR).")
    i.add_argument("module", nargs="?", type=Path, metavar="DIR",
                   help="a directory written by build --out")
    i.add_argument("--what", default="graph",
                   help=f"one of {', '.join(INSPECT_KINDS)} (default graph); manifest also "
                        "checks every file of DIR against its sha256")
    _layer_options(i)
    _shape_options(i)
    i.set_defaults(layer_flags=_flags(i, exclude={"module", "what", "help"}))
    n = sub.add_parser("bench", help="time one layer on a target: latency and GFLOP/s",
                       description="Build a layer (checked against the reference) and time it "
                                   "at each thread count; prints median latency and GFLOP/s.")
    _layer_options(n)
    _shape_options(n, seed_help="the random weights and input")
    n.add_argument("--records", type=Path, metavar="DB",
                   help="the tuning database to use (written by mhagen tune --db DB)")
    n.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 .. cores)")
    n.add_argument("--repeat", type=int, default=7, help="timing repeats (median is reported)")
    t = sub.add_parser("tune", help="autotune a layer's kernels with TVM MetaSchedule",
                       description="Tune the kernels of a layer for a target at the given "
                                   "shapes; records go to the tuning database that builds "
                                   "consult. Ctrl-C stops and keeps what was measured; a "
                                   "re-run resumes. Needs the tuning extra: pip install "
                                   "'mhagen[tune]'.")
    _layer_options(t)
    _target_option(t)
    t.add_argument("--shapes", nargs="+",
                   help="BATCHxSEQ shapes to tune (default 1x128; with --kv-cache 1x1, a "
                        "decode step of one new token)")
    t.add_argument("--trials", type=int, default=64,
                   help="MetaSchedule trials per GEMM kernel (and at most that many attention "
                        "template configs)")
    t.add_argument("--time-budget", type=float, help="a limit in seconds for the whole run (every kernel): no trial starts that would pass it")
    t.add_argument("--db", type=Path, help="records file (default: the user database)")
    t.add_argument("--work-dir", type=Path, help="MetaSchedule databases (to resume)")
    t.add_argument("--rpc-tracker", help="HOST:PORT of a TVM RPC tracker (remote measuring)")
    t.add_argument("--device-key", help="device key registered with the tracker")
    t.add_argument("--kernels", nargs="+", help="only these kernels (e.g. qkv_projection)")
    t.add_argument("--packed", action="store_true",
                   help="with --kv-cache: tune the build for any number of new tokens "
                        "(build --max-seq-len SEQ: each BATCHxSEQ is its batch and maximum), "
                        "timed on a call of every row adding SEQ tokens")
    _kv_block_size_option(t, "with --kv-cache: tune the build reading a paged K/V cache of "
                             "blocks of B tokens (build --kv-block-size B), timed on a pool "
                             "whose blocks are shuffled")
    t.add_argument("--no-fuse", action="store_true", help="tune the unfused kernel")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of MetaSchedule's random search (default 0)")

    for name, handler in add_parsers(sub, _layer_options, _layer).items():
        sub.choices[name].set_defaults(handler=handler)
    return p


def _flags(p, exclude) -> list:
    """(dest, flag, default) of a parser's options but `exclude`: inspect DIR refuses them."""
    return [(a.dest, a.option_strings[0], a.default) for a in p._actions
            if a.option_strings and a.dest not in exclude]


def _shape_arg(text):
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise _Fail(f"--shapes takes BATCHxSEQ like 1x128, not {text!r}") from None
    if batch < 1 or seq < 1:
        raise _Fail(f"--shapes {text!r}: batch and seq must be >= 1")
    return batch, seq


def _cmd_tune(args):
    require_tuning_dependencies()
    layer = _layer(args)
    default = "1x1" if getattr(args, "kv_cache", None) else "1x128"
    shapes = [_shape_arg(s) for s in args.shapes or [default]]
    if args.trials < 1:
        raise _Fail("--trials must be >= 1")
    rpc = None
    if args.rpc_tracker or args.device_key:
        if not (args.rpc_tracker and args.device_key):
            raise _Fail("--rpc-tracker and --device-key go together")
        host, _, port = args.rpc_tracker.rpartition(":")
        if not host or not port.isdigit():
            raise _Fail(f"--rpc-tracker takes HOST:PORT, not {args.rpc_tracker!r}")
        rpc = (host, int(port), args.device_key)
    _check_paged(args, layer)
    if args.packed and layer.cache_lens_input is None:
        raise _Fail("--packed tunes a decoding layer's build for any number of new tokens: "
                    "give --kv-cache N too")
    form = {"packed": True} if args.packed else {}
    if args.kv_block_size is not None:
        form["kv_block_size"] = args.kv_block_size
    report = mhagen.tune(layer, args.target, shapes=shapes, trials=args.trials,
                         time_budget=args.time_budget, database=args.db,
                         work_dir=args.work_dir, rpc=rpc, fuse=not args.no_fuse,
                         kernels=args.kernels, seed=args.seed, **form)
    print(report.table())
    print(report.summary())
    if report.stopped_by == "Ctrl-C":
        print("mhagen tune: interrupted", file=sys.stderr)
        return 130
    return 0


def _schedule_summary(module) -> str:
    by_kernel = {}
    for d in module.decisions:
        by_kernel.setdefault(d["kernel"], set()).add(d.get("source", "default"))
    return ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in by_kernel.items())


def _build_checked(args, layer):
    """Build `layer` from CLI args with the weights of --weights or random ones; (module,
    max error, tolerance)."""
    import numpy as np

    if getattr(args, "repeat", 1) < 1:
        raise _Fail(f"--repeat must be >= 1, got {args.repeat}")
    tuning = _records(args)
    weights_file = getattr(args, "weights", None)
    if weights_file is not None:
        try:
            weights = mhagen.load_weights(weights_file, layer)
        except InputError as err:
            raise InputError(f"--weights {weights_file}: {err}") from None
    else:
        weights = layer.init_weights(args.seed)
    _check_paged(args, layer)
    module = mhagen.build(layer, args.target, weights=weights, fuse=not args.no_fuse,
                          **tuning, **_shape(args))
    args.timed = {}     # latency()'s cache: its default, or a paged module's pool
    if not module.target.runs_here():
        return module, None, None
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch, args.seq_len, module.d_model)).astype(np.float32)
    context = None
    if layer.context_input is not None:   # cross-attention: a random context
        context = rng.standard_normal((args.batch, module.kv_seq_len,
                                       layer.context_input.attrs["shape"][2])).astype(np.float32)
    cache = reference_cache = seqs = None
    if getattr(args, "kv_block_size", None):   # a random, half-full pool, blocks shuffled
        max_len = cache_shape(layer)["max_len"]
        cache, seqs = _random_paged_pool(module, (max_len - args.seq_len) // 2, rng)
        reference_cache = cache.to_contiguous(seqs, np.float64)   # the same tokens
        pool, timed_seqs = _random_paged_pool(module, max_len - args.seq_len, rng)
        args.timed = {"cache": pool, "seqs": timed_seqs}    # timed on a full one
    elif layer.cache_lens_input is not None:    # a decoding layer: a random, half-full cache
        cache = module.new_cache()
        cache.k[...] = rng.standard_normal(cache.k.shape)
        cache.v[...] = rng.standard_normal(cache.v.shape)
        cache.lens[...] = (cache.max_len - args.seq_len) // 2
        reference_cache = cache.copy()
    expected = layer.reference(x, weights, cache=reference_cache, context=context)
    args.x, args.context = x, context    # what latency and GFLOP/s are measured at
    y = module(x, cache=cache, context=context, **({"seqs": seqs} if seqs else {}))
    return module, mhagen.max_error(y, expected), tolerance(expected, judged_as(layer))


def _check_paged(args, layer) -> None:
    """--kv-block-size needs a decoding layer (refused before anything is built)."""
    if getattr(args, "kv_block_size", None) is not None and layer.cache_lens_input is None:
        raise _Fail(f"--kv-block-size {args.kv_block_size} reads a decoding layer's paged "
                    "K/V cache: give --kv-cache N too (or a graph with a cache)")


def _random_paged_pool(module, held, rng):
    """(pool, seqs): a paged cache of the module's batch sequences of `held` random tokens
    each, with room for every sequence up to max_len, its blocks handed out in a random
    order (each sequence's blocks scattered over the pool, as after a server has run a
    while)."""
    pool = module.new_paged_cache(module.batch * -(-cache_shape(module.graph)["max_len"]
                                                  // module.kv_block_size))
    placeholders = [pool.add() for _ in range(pool.num_blocks)]
    pool.reserve(placeholders, [1] * len(placeholders))
    for seq in rng.permutation(placeholders):     # the free list now in a random order
        pool.free(int(seq))
    seqs = [pool.add() for _ in range(module.batch)]
    pool.reserve(seqs, [held] * len(seqs))
    pool.k[...] = rng.standard_normal(pool.k.shape)
    pool.v[...] = rng.standard_normal(pool.v.shape)
    pool.advance(seqs, [held] * len(seqs))
    return pool, seqs


def _records(args) -> dict:
    """build()'s tuning= from --records DB (none given: the default lookup)."""
    db = getattr(args, "records", None)
    if db is None:
        return {}
    if not db.is_file():
        raise _Fail(f"--records {db}: no tuning database there" +
                    (" (a directory)" if db.is_dir() else "") +
                    f"; write one with mhagen tune --db {db}")
    return {"tuning": str(db)}


def _save_options(args) -> dict:
    """Module.save()'s keywords for the flags given (only those: a save without them keeps
    its defaults); checked before anything is built."""
    flags = {"c_api": ("--no-c-api", False), "self_contained": ("--self-contained", True)}
    wanted = {name: value for name, (_, value) in flags.items()
              if getattr(args, name if name != "c_api" else "no_c_api")}
    given = " and ".join(flags[name][0] for name in wanted)
    if wanted and not args.out:
        raise _Fail(f"{given} says how to save the module: give --out DIR too")
    if any(name not in signature(Module.save).parameters for name in wanted):
        raise _Fail(f"{given}: this mhagen's Module.save() has no such option")
    return wanted


def _check_writable_dir(path: Path, flag: str) -> None:
    """Refuse a directory path that is a file, or lies under one, before any work."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"is under {p}, a file"
                raise _Fail(f"{flag} {path} {where}: give a directory path (one that does not "
                            "exist yet, or a directory)")
            return


def _shape(args) -> dict:
    """build()'s shape options from --batch, --seq-len, --max-seq-len and --kv-block-size."""
    most = getattr(args, "max_seq_len", None)
    kv = {"kv_seq_len": args.kv_seq_len} if getattr(args, "kv_seq_len", None) else {}
    if getattr(args, "kv_block_size", None) is not None:
        kv["kv_block_size"] = args.kv_block_size
    if most is None:
        return {"batch": args.batch, "seq_len": args.seq_len, **kv}
    if not 1 <= args.seq_len <= most:
        raise _Fail(f"--seq-len {args.seq_len} is outside 1..--max-seq-len {most}: give the "
                    "length to check and time the module at (--seq-len) within it")
    return {"batch": args.batch, "seq_len": None, "max_seq_len": most, **kv}


def _cmd_bench(args):
    layer = _layer(args)
    module, err, tol = _build_checked(args, layer)
    if err is None:
        raise _Fail(f"target {args.target} cannot run on this machine ({module.cannot_run}); "
                    "bench needs a runnable target")
    if err > tol:
        print(f"mhagen bench: error: result is off by {err:.2e} (> {tol:.1e}); not timing",
              file=sys.stderr)
        return 1
    available = num_threads()
    threads = args.threads or list(range(1, available + 1))
    bad = [t for t in threads if t < 1 or t > available]
    if bad:
        raise _Fail(f"--threads {bad} outside 1..{available} (set TVM_NUM_THREADS for more)")
    print(f"{layer!r}\n{module.program.fusion}; {module.target.describe()}; input "
          f"{module.in_shape}; max error {err:.1e}")
    print(f"{'threads':>7} {'median ms':>10} {'GFLOP/s':>9}")
    for t in threads:
        set_num_threads(t)
        seconds = module.latency(args.x, repeat=args.repeat, context=args.context, **args.timed)
        print(f"{t:>7} {seconds * 1e3:>10.3f} "
              f"{module.flops(*args.x.shape[:2]) / seconds / 1e9:>9.1f}")
    set_num_threads(available)
    return 0


def _cmd_build(args):
    save_options = _save_options(args)
    if args.out:
        _check_writable_dir(args.out, "--out")
    layer = _layer(args)
    module, err, tol = _build_checked(args, layer)
    origin = f"from {args.weights}" if args.weights else f"random (seed {args.seed})"
    print(f"built {layer!r}\n  {module.program.fusion}\n  for {module.target.describe()}\n"
          f"  input {_input_text(module)} in {module.compile_seconds:.1f} s\n"
          f"  weights: {origin}\n"
          f"  schedules: {_schedule_summary(module)}" +
          (f" (tuning database {args.records})" if args.records else ""))
    if module.precision:
        print(f"  precision: {module.precision}")
    for record in module.tuning_records:
        print(f"  record {describe_record(record)}")
    if err is not None:
        print(f"max error vs float64 reference: {err:.2e} (tolerance {tol:.1e}) "
              f"{'ok' if err <= tol else 'FAILED'}")
        if err > tol:   # a wrong result is never saved
            print("mhagen build: error: the result is outside the tolerance; nothing written",
                  file=sys.stderr)
            return 1
    if args.out:
        out = module.save(args.out, **save_options)
        gpu = module.target.device != "cpu"
        runtime_libs = "lib/ (TVM runtime), " if (out / "lib").is_dir() else ""
        c_api = ("mha.h + libmha.so (C API" + (", CUDA driver" if gpu else "") + "), " +
                 runtime_libs) if (out / "mha.h").exists() else ""
        weights = "weights.safetensors, " if (out / "weights.safetensors").exists() else ""
        print(f"wrote {out}/ ({'kernels.fatbin' if gpu else 'kernel.so'}, manifest.json, "
              f"{weights}{c_api}te/tir/source text)")
    if err is None:
        print(f"not run: {module.cannot_run}")
        return 0
    seconds = module.latency(args.x, repeat=args.repeat, context=args.context, **args.timed)
    where = (f"; a step of {args.seq_len} new token(s) on a full cache of {layer.options['kv_cache']}"
             if layer.cache_lens_input is not None else "")
    if module.symbolic:
        where = f" at input {args.x.shape}"
    if args.timed:
        where += f"; a paged cache of blocks of {module.kv_block_size}, shuffled"
    print(f"median latency: {seconds * 1e3:.3f} ms  "
          f"({module.flops(*args.x.shape[:2]) / seconds / 1e9:.1f} GFLOP/s{where})")
    return 0


def _input_text(module) -> str:
    b, s, d = module.in_shape
    return f"(batch {b}, any seq_len 1..{s}, {d})" if module.symbolic else str(module.in_shape)


def _cmd_inspect(args):
    if args.what not in INSPECT_KINDS:
        raise _Fail(f"--what must be one of {', '.join(INSPECT_KINDS)}, not {args.what!r}")
    given = [flag for dest, flag, default in args.layer_flags if getattr(args, dest) != default]
    if args.module is not None and given:
        raise _Fail(f"{' '.join(given)}: inspect {args.module} shows the module saved there; "
                    "layer and shape options describe a layer to build instead (drop DIR "
                    "or the options)")
    if args.module is not None and args.what == "manifest":
        print(describe(args.module))   # exit status 1: a file is missing or damaged
        return 1 if args.module.is_dir() and damaged_files(args.module) else 0
    if args.module is not None:
        module = mhagen.load(args.module)
    elif args.what == "graph":
        print(_layer(args))
        return 0
    else:
        layer = _layer(args)
        _check_paged(args, layer)
        module = mhagen.build(layer, args.target, fuse=not args.no_fuse, **_shape(args))
    print(module.inspect(args.what))
    return 0


# what a .npz given to `mhagen run` may hold: the module call's arrays, and a decoding
# layer's cache as three arrays
_RUN_INPUTS = ("x", "context", "kv_lens", "k_cache", "v_cache", "cache_lens")
_CACHE_ARRAYS = ("k_cache", "v_cache", "cache_lens")


def _read_arrays(path: Path, flag: str) -> dict:
    """{name: array} of a .npz, or {"x": array} of a .npy (told apart by their content)."""
    import numpy as np

    if not path.is_file():
        raise _Fail(f"{flag} {path}: no such file" + (" (a directory)" if path.is_dir()
                                                      else ""))
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.ndarray):
            return {"x": data}
        with data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as err:   # (ValueError: also an array of Python objects)
        raise _Fail(f"{flag} {path} is not a .npy or .npz file numpy can read "
                    f"({str(err).splitlines()[0][:200]})") from None


def _run_arguments(module, arrays: dict, path: Path) -> dict:
    """The module call's keyword arguments from the arrays of --inputs; refuses names the
    module takes none of and missing ones, naming both."""
    import numpy as np

    graph = module.graph
    takes = {"x": True, "context": graph.context_input is not None,
             "kv_lens": graph.lengths_input is not None}
    decoding = graph.cache_lens_input is not None
    takes.update((name, decoding) for name in _CACHE_ARRAYS)
    accepted = [name for name, ok in takes.items() if ok]
    unknown = sorted(set(arrays) - set(accepted))
    if unknown:
        why = {"context": "it is not a cross-attention layer", "kv_lens": "it pads no keys",
               "k_cache": "it keeps no K/V cache", "v_cache": "it keeps no K/V cache",
               "cache_lens": "it keeps no K/V cache"}
        reasons = "; ".join(f"{n} ({why[n]})" if n in why else n for n in unknown)
        raise _Fail(f"--inputs {path} holds arrays this module takes none of: {reasons}; "
                    f"it takes {', '.join(accepted)}")
    required = [n for n in ("x", "context", "kv_lens") if takes[n]]
    missing = [n for n in required if n not in arrays]
    if missing:
        form = ("a .npz with arrays " + ", ".join(required)) if len(required) > 1 else \
            "a .npy of x, or a .npz with an array x"
        raise _Fail(f"--inputs {path} lacks {', '.join(missing)}: this module takes {form}")
    call = {name: arrays[name] for name in ("x", "context", "kv_lens") if name in arrays}
    given = [n for n in _CACHE_ARRAYS if n in arrays]
    if decoding and given and len(given) < 3:
        raise _Fail(f"--inputs {path} holds {', '.join(given)} but not "
                    f"{', '.join(n for n in _CACHE_ARRAYS if n not in given)}: give the "
                    "cache as all three arrays, or none of them (an empty cache)")
    if decoding:
        batch = np.shape(arrays["x"])[0] if np.ndim(arrays["x"]) == 3 else module.batch
        if given:
            spec = cache_shape(graph)
            want = np.dtype(numpy_dtype(spec["dtype"]))
            expected = (batch, spec["kv_heads"], spec["max_len"], spec["head_dim"])
            for name in ("k_cache", "v_cache"):
                a = arrays[name]
                if a.dtype != want:
                    raise _Fail(f"{name} is {a.dtype}; this module's cache holds "
                                f"{want.name}: save it as {want.name}")
                if a.shape != expected:
                    raise _Fail(f"{name} has shape {a.shape}; this module's cache is "
                                f"{expected} [batch, kv_heads, max_len, head_dim]")
            lens = arrays["cache_lens"]
            if not np.issubdtype(lens.dtype, np.integer):
                raise _Fail(f"cache_lens is {lens.dtype}; give the tokens cached per batch row "
                            "as integers")
            call["cache"] = KVCache.from_arrays(arrays["k_cache"], arrays["v_cache"], lens)
        else:
            call["cache"] = KVCache.empty(module, batch)
    return call


def _cmd_run(args):
    import numpy as np

    if args.inputs is None:
        raise _Fail("give the input: --inputs x.npy (the layer's input x) or --inputs "
                    "inputs.npz (x and the module's other inputs by name)")
    if args.repeat < 1:
        raise _Fail(f"--repeat must be >= 1, got {args.repeat}")
    if args.outputs is not None and (args.outputs.suffix != ".npz" or args.outputs.is_dir()):
        raise _Fail(f"--outputs {args.outputs}: give a file path ending in .npz")
    arrays = _read_arrays(args.inputs, "--inputs")
    module = mhagen.load(args.artifact)
    if getattr(module, "cannot_run", None):
        raise _Fail(f"cannot run {args.artifact} here: {module.cannot_run}")
    call = _run_arguments(module, arrays, args.inputs)
    beyond = [name for name in call if name not in signature(module.__call__).parameters]
    if beyond:   # a CUDA artifact's module: x and kv_lens only
        raise _Fail(f"{args.artifact} takes no {', '.join(beyond)} from Python: run it "
                    "through its C API (mha.h)")
    cache = call.get("cache")
    before = cache.copy() if cache is not None else None   # timing appends where this call did
    y = module(**call)
    print(f"ran {args.artifact}: {module!r}")
    print(f"  y {tuple(y.shape)} {y.dtype}" +
          (f"; cache now holds {cache.lens.tolist()} tokens per row" if cache is not None
           else ""))
    if args.outputs is not None:
        # bfloat16 (ml_dtypes) is no dtype .npz readers know: written as float32
        saved = {"y": y if y.dtype.kind == "f" else y.astype(np.float32)}
        if cache is not None:
            saved.update(k_cache=cache.k, v_cache=cache.v, cache_lens=cache.lens)
        np.savez(args.outputs, **saved)
        print(f"  wrote {args.outputs} ({', '.join(saved)})")
    if not hasattr(module, "latency"):   # a CUDA artifact's module: calls only
        print("latency: not measured (this module has no kernel timer)")
        return 0
    if cache is not None:
        call["cache"] = before
    seconds = module.latency(repeat=args.repeat, **call)
    print(f"median latency: {seconds * 1e3:.3f} ms over {args.repeat} repeats")
    return 0


def main(argv=None) -> int:
    p = parser()
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    cmd = getattr(args, "handler", None) or {
        "build": _cmd_build, "run": _cmd_run, "inspect": _cmd_inspect, "bench": _cmd_bench,
        "tune": _cmd_tune}[args.command]
    try:
        with warnings.catch_warnings():   # (restores showwarning on the way out)
            warnings.showwarning = lambda message, *where, **_: print(
                f"mhagen {args.command}: warning: {message}", file=sys.stderr)
            return cmd(args)
    except (MhagenError, _Fail) as err:
        print(f"mhagen {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C outside tune's own handling (which keeps records)
        print(f"mhagen {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as err:   # e.g. --out in a directory that cannot be written
        where = f" {err.filename}" if err.filename else ""
        print(f"mhagen {args.command}: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
