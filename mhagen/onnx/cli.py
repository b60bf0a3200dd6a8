"""The `mhagen export-onnx` and `mhagen import-onnx` sub-commands.

Wired into mhagen/cli.py by `add_parsers(subparsers, layer_options, layer)` (the main
command line's layer options and the function that builds the layer from them), which
returns {command name: handler(args) -> exit status}. Handlers raise MhagenError subclasses for bad
options or models (the main program prints them as one line and exits with status 2).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mhagen.errors import InputError
from mhagen.kvcache import KVCache
from mhagen.onnx._common import OnnxError, ort_session
from mhagen.onnx.export import FORMS, MASK_MODES, MIN_OPSET, export_onnx
from mhagen.onnx.export_gqa import gqa_step
from mhagen.onnx.fit import VARIED_INPUTS_HINT
from mhagen.onnx.importer import _load as load_model
from mhagen.onnx.importer import import_onnx
from mhagen.onnx.probe import FLOAT_TYPES
from mhagen.tolerances import judged_as, max_error, tolerance
from mhagen.weights import load_weights

# the importer's advice names import_onnx()'s keywords: on the command line, its flags
_VARIED_SAMPLES = ("give more varied samples: repeat --sample-input NAME=FILE.npy with other "
                   "arrays (e.g. several batches of different token ids), so the probe rows "
                   "span the layer input")
_CLI_WORDS = [
    (r"sample_inputs=\{'([^']*)': array\} to import_onnx", r"--sample-input \1=FILE.npy"),
    (r"\bsample_inputs=?", "--sample-input"),
    (r"\bseq_len=(\d+)", r"--seq-len \1"),
    (r"\bseq_len=", "--seq-len"),
    (r"\ba seq_len\b", "a --seq-len"),
    (r"\bbatch=", "--batch "),
]


def add_parsers(subparsers, layer_options, layer) -> dict:
    e = subparsers.add_parser(
        "export-onnx", help="write a layer as an ONNX model (plain ops or the Attention op)",
        description="Write a layer and its weights (random from --seed, or --weights) as an "
                    "ONNX model: --form decomposed (MatMul/Softmax/Where..., opset 17+, any "
                    "graph), --form fused (the Attention operator, opset 23+, heads of one "
                    "structure) or --form gqa (a decoding layer, --kv-cache N, as onnxruntime's "
                    "com.microsoft.GroupQueryAttention: a cache length per batch row). --check "
                    "runs it in onnxruntime against the reference.")
    layer_options(e)
    e.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    e.add_argument("--form", choices=FORMS, default="decomposed",
                   help="decomposed (default: portable plain ops), fused (Attention op) or "
                        "gqa (decoding layers: GroupQueryAttention)")
    e.add_argument("--weights", type=Path, metavar="FILE",
                   help="the layer's weights: a .safetensors or .npz of name -> array (e.g. "
                        "from import-onnx --out), checked against the layer; default: random")
    e.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    e.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    e.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    e.add_argument("--dynamic-batch", action="store_true", help="symbolic batch axis")
    e.add_argument("--kv-seq-len", type=int, metavar="T",
                   help="the context's length of a cross-attention layer (--cross)")
    e.add_argument("--dynamic-seq", action="store_true",
                   help="symbolic sequence axis (and the context's, with --cross)")
    e.add_argument("--opset", type=int,
                   help=f"ONNX opset (default {MIN_OPSET['decomposed']} decomposed, "
                        f"{MIN_OPSET['fused']} fused)")
    e.add_argument("--masks", choices=MASK_MODES, default="auto",
                   help="masks as constant tensors or computed from Range ops (default: auto, "
                        "constant unless an axis is dynamic)")
    e.add_argument("--external-data", action="store_true",
                   help="weights in <out>.data (automatic above 2 GB)")
    e.add_argument("--check", action="store_true",
                   help="run the model in onnxruntime and compare with the float64 reference")

    i = subparsers.add_parser(
        "import-onnx", help="find attention in an ONNX model; print or save mhagen graphs",
        description="Find attention layers (the Attention operator, com.microsoft."
                    "MultiHeadAttention, or MatMul-Softmax-MatMul as PyTorch exports "
                    "nn.MultiheadAttention) and print each as a mhagen graph; --out saves the "
                    "graph JSON and weights (.npz) for `mhagen build --graph G.json --weights "
                    "G.npz` and `export-onnx --graph ... --weights ...`.")
    i.add_argument("model", type=Path, help="an .onnx file")
    i.add_argument("--seq-len", type=int, default=32,
                   help="sequence length to probe a dynamic sequence axis at (default 32)")
    i.add_argument("--batch", type=int, default=1,
                   help="batch size to probe a dynamic batch axis at (default 1)")
    i.add_argument("--sample-input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="the values of a model input that is not floating point (token ids, "
                        "e.g. input_ids=ids.npy); float inputs are random. Repeat it for "
                        "each such input, and repeat a NAME with other files for several "
                        "samples (a model whose weights must be fitted needs varied ones)")
    i.add_argument("--out", type=Path, metavar="DIR",
                   help="write <name>.json and <name>.npz here")
    i.add_argument("--show", action="store_true", help="print each graph node by node")
    return {"export-onnx": lambda args: _cmd_export(args, layer(args)),
            "import-onnx": _cmd_import}


def _cmd_export(args, layer) -> int:
    if args.weights:
        weights, origin = load_weights(args.weights, layer), f"from {args.weights}"
    else:
        weights, origin = layer.init_weights(args.seed), f"random, seed {args.seed}"
    path = export_onnx(layer, args.out, weights, form=args.form, batch=args.batch,
                       seq_len=args.seq_len, dynamic_batch=args.dynamic_batch,
                       dynamic_seq=args.dynamic_seq, opset=args.opset, masks=args.masks,
                       external_data=True if args.external_data else None,
                       kv_seq_len=args.kv_seq_len)
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    data = path.with_name(path.name + ".data")
    dims = ["batch" if args.dynamic_batch else args.batch,
            "seq" if args.dynamic_seq else args.seq_len]
    print(f"wrote {path}" + (f" (+ {data.name})" if data.exists() else "") +
          f": {layer!r}\n  {args.form} form, opset {model.opset_import[0].version}, "
          f"{len(model.graph.node)} nodes, {len(model.graph.initializer)} initializers, "
          f"weights {origin}; input x [{dims[0]}, {dims[1]}, "
          f"{layer.inputs[0].attrs['shape'][2]}] -> y")
    if not args.check:
        return 0
    x = np.random.default_rng(args.seed).standard_normal(
        (args.batch, args.seq_len, layer.inputs[0].attrs["shape"][2])).astype(np.float32)
    if args.form == "gqa":
        return _check_gqa(layer, weights, path, x, args.seed)
    feeds, cache, context = {"x": x}, None, None
    if layer.context_input is not None:   # cross-attention: a random context
        context = np.random.default_rng(args.seed + 2).standard_normal(
            (args.batch, args.kv_seq_len or args.seq_len,
             layer.context_input.attrs["shape"][2])).astype(np.float32)
        feeds["context"] = context
    if layer.cache_lens_input is not None:   # a random past of up to 8 tokens per row
        cache = KVCache.empty(layer, args.batch, np.float64)
        past = min(8, cache.max_len - args.seq_len)
        rng = np.random.default_rng(args.seed + 1)
        cache.k[...] = rng.standard_normal(cache.k.shape)
        cache.v[...] = rng.standard_normal(cache.v.shape)
        cache.lens[...] = past
        feeds.update(past_key=cache.k[:, :, :past].astype(np.float32),
                     past_value=cache.v[:, :, :past].astype(np.float32))
    y = ort_session(onnx.load(str(path)), optimize=True).run(None, feeds)[0]
    expected = layer.reference(x, weights, cache=cache, context=context)
    err, tol = max_error(y, expected), tolerance(expected)
    ok = bool(np.all(np.isfinite(y))) and err <= tol
    print(f"onnxruntime vs float64 reference: max error {err:.2e} (tolerance {tol:.1e}) "
          f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def _check_gqa(layer, weights, path, x, seed) -> int:
    """--check of the gqa form: one call of x's tokens in every row on a random cache whose
    rows hold different numbers of tokens (row b: up to 8 - b), run in place (gqa_step),
    against the reference of each row."""
    import onnx
    batch, seq = x.shape[:2]
    model = onnx.load(str(path))
    cache = KVCache.empty(layer, batch)
    rng = np.random.default_rng(seed + 1)
    cache.k[...] = rng.standard_normal(cache.k.shape)
    cache.v[...] = rng.standard_normal(cache.v.shape)
    past = min(8, cache.max_len - seq)
    per_row = "query_seqlens" in [i.name for i in model.graph.input]
    if per_row or seq == 1 or batch == 1:
        cache.lens[...] = [max(0, past - b) for b in range(batch)]
    # else (a non-causal layer, several rows of several tokens): on an empty cache only
    lens = cache.lens.tolist()
    ref = KVCache.from_arrays(cache.k.astype(np.float64), cache.v.astype(np.float64), lens)
    y = gqa_step(ort_session(model, optimize=True), cache, x)
    expected = np.concatenate([layer.reference(x[b:b + 1], weights, cache=KVCache(
        ref.k[b:b + 1], ref.v[b:b + 1], ref.lens[b:b + 1])) for b in range(batch)])
    err, tol = max_error(y, expected), tolerance(expected, judged_as(layer))
    ok = bool(np.all(np.isfinite(y))) and err <= tol
    print(f"onnxruntime (GroupQueryAttention, cached tokens per row {lens}) vs float64 "
          f"reference: max error {err:.2e} (tolerance {tol:.1e}) {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def _sample_inputs(specs, graph):
    """import_onnx()'s sample_inputs from --sample-input NAME=FILE.npy flags: one dict, or
    a list of them when a name is repeated (the k-th file of each name in sample k; a name
    given once is in every sample). Names must be the non-float inputs of `graph`."""
    if not specs:
        return None
    feeds = {i.name: i for i in graph.input}
    for init in graph.initializer:
        feeds.pop(init.name, None)
    floats = {n for n, i in feeds.items() if i.type.tensor_type.elem_type in FLOAT_TYPES}
    by_name = {}
    for spec in specs:
        name, eq, file = spec.partition("=")
        if not eq or not name or not file:
            raise InputError(f"--sample-input takes NAME=FILE.npy (e.g. input_ids=ids.npy), "
                             f"not {spec!r}")
        if name not in feeds:
            raise InputError(f"--sample-input {spec}: the model has no input {name!r}; its "
                             f"inputs: {', '.join(feeds) or 'none'}")
        if name in floats:
            raise InputError(f"--sample-input {spec}: {name!r} is a floating-point input, "
                             "probed with random values; give samples of the others only")
        try:
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise InputError(f"--sample-input {spec}: cannot read {file} as a .npy "
                             f"({str(err).splitlines()[0][:200]})") from None
        if not isinstance(array, np.ndarray):
            raise InputError(f"--sample-input {spec}: {file} is an .npz; give one .npy array")
        by_name.setdefault(name, []).append(array)
    count = max(len(arrays) for arrays in by_name.values())
    uneven = [n for n, arrays in by_name.items() if len(arrays) not in (1, count)]
    if uneven:
        raise InputError(f"--sample-input: {', '.join(uneven)} given "
                         f"{', '.join(str(len(by_name[n])) for n in uneven)} times, others "
                         f"{count}: give each name once or as many times as the others")
    samples = [{n: arrays[k % len(arrays)] for n, arrays in by_name.items()}
               for k in range(count)]
    return samples[0] if count == 1 else samples


def _in_cli_words(message: str) -> str:
    message = message.replace(VARIED_INPUTS_HINT, _VARIED_SAMPLES)
    for pattern, flag in _CLI_WORDS:
        message = re.sub(pattern, flag, message)
    return message


def _cmd_import(args) -> int:
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise InputError(f"--out {args.out} is a file: give a directory for the graphs")
    try:
        model = load_model(args.model)
        found = import_onnx(model, seq_len=args.seq_len, batch=args.batch,
                            sample_inputs=_sample_inputs(args.sample_input, model.graph))
    except OnnxError as err:
        raise OnnxError(_in_cli_words(str(err))) from None
    print(f"{args.model}: {len(found)} attention layer{'s' if len(found) != 1 else ''}")
    for k, item in enumerate(found):
        print(f"[{k}] {item}")
        if args.show:
            print(item.graph)
        if args.out:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in item.graph.name)
            stem = args.out / (safe or f"attention{k}")
            try:
                args.out.mkdir(parents=True, exist_ok=True)
                Path(f"{stem}.json").write_text(item.graph.to_json())
                np.savez(f"{stem}.npz", **item.weights)
            except OSError as err:
                raise InputError(f"cannot write to {args.out}: {err.strerror or err}") from None
            print(f"  wrote {stem}.json, {stem}.npz")
    return 0
