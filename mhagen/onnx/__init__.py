"""ONNX export and import of mhagen layers.

    mhagen.onnx.export_onnx(layer, "m.onnx", weights=w)                   # decomposed ops
    mhagen.onnx.export_onnx(layer, "m.onnx", weights=w, form="fused")     # Attention op
    mhagen.onnx.export_onnx(decoder, "m.onnx", weights=w, form="gqa")     # GroupQueryAttention
    y = mhagen.onnx.gqa_step(session, cache, x, new_tokens)               # ... on a KVCache
    for graph, weights in mhagen.onnx.import_onnx("m.onnx"):              # find attention
        kernel = mhagen.build(graph, batch=1, seq_len=128, weights=weights)

Needs the `onnx` package (a dependency of mhagen). Importing reads the projection weights
exactly from the model's initializers (no onnxruntime needed); only layouts the reader cannot
follow fall back to a least-squares fit on onnxruntime runs (``found.weight_source``).
Neither this package nor `import mhagen` imports TVM, and `onnx` is imported on first use.
"""
from mhagen.onnx._common import OnnxError
from mhagen.onnx.export import export_onnx
from mhagen.onnx.export_gqa import gqa_binding, gqa_feeds, gqa_step
from mhagen.onnx.importer import ImportedAttention, import_onnx

__all__ = ["ImportedAttention", "OnnxError", "export_onnx", "gqa_binding", "gqa_feeds",
           "gqa_step", "import_onnx"]
