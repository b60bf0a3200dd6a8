"""The `mhagen export-onnx` and `mhagen import-onnx` sub-commands.

Wired into mhagen/cli.py by `add_parsers(subparsers, layer_options, layer)` (the main
command line's layer options and the function that builds the layer from them), which
returns {command name: handler(args) -> exit status}. Handlers raise MhagenError subclasses for bad
options or models (the main program prints them as one line and exits with status 2).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mhagen.errors import InputError
from mhagen.kvcache import KVCache
from mhagen.onnx._common import ort_session
from mhagen.onnx.export import FORMS, MASK_MODES, MIN_OPSET, export_onnx
from mhagen.onnx.importer import import_onnx
from mhagen.tolerances import max_error, tolerance


def add_parsers(subparsers, layer_options, layer) -> dict:
    e = subparsers.add_parser(
        "export-onnx", help="write a layer as an ONNX model (plain ops or the Attention op)",
        description="Write a layer and its weights (random from --seed, or --weights) as an "
                    "ONNX model: --form decomposed (MatMul/Softmax/Where..., opset 17+, any "
                    "graph) or --form fused (the Attention operator, opset 23+, heads of one "
                    "structure). --check runs it in onnxruntime against the reference.")
    layer_options(e)
    e.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    e.add_argument("--form", choices=FORMS, default="decomposed",
                   help="decomposed (default: portable plain ops) or fused (Attention op)")
    e.add_argument("--weights", type=Path,
                   help="weights .npz (e.g. from import-onnx --out); default: random")
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
                    "graph JSON and weights (.npz) for `mhagen build --graph` and "
                    "`export-onnx --graph ... --weights ...`.")
    i.add_argument("model", type=Path, help="an .onnx file")
    i.add_argument("--seq-len", type=int, default=32,
                   help="sequence length to probe a dynamic sequence axis at (default 32)")
    i.add_argument("--batch", type=int, default=1,
                   help="batch size to probe a dynamic batch axis at (default 1)")
    i.add_argument("--out", type=Path, help="write <name>.json and <name>.npz here")
    i.add_argument("--show", action="store_true", help="print each graph node by node")
    return {"export-onnx": lambda args: _cmd_export(args, layer(args)),
            "import-onnx": _cmd_import}


def _load_weights(path):
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read weights {path}: {err}; pass an .npz of name -> array "
                         "(as import-onnx --out writes)") from None


def _cmd_export(args, layer) -> int:
    if args.weights:
        weights, origin = _load_weights(args.weights), f"from {args.weights}"
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


def _cmd_import(args) -> int:

    found = import_onnx(args.model, seq_len=args.seq_len, batch=args.batch)
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
