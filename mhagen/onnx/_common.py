"""Shared pieces of mhagen.onnx: the error type, lazy `onnx` import, onnxruntime sessions,
node attributes, grouped K/V heads."""
from __future__ import annotations

from mhagen.errors import MhagenError
from mhagen.ir.heads import kv_head_map


class OnnxError(MhagenError, ValueError):
    """An ONNX export or import problem: the message names the layer option or the ONNX node,
    says what is wrong and how to get around it."""


def need_onnx():
    """The `onnx` package (a dependency of mhagen), imported on first use."""
    try:
        import onnx
    except ImportError:  # pragma: no cover - onnx is a declared dependency
        raise OnnxError("mhagen.onnx needs the `onnx` package: pip install onnx") from None
    return onnx


def ort_session(model, *, optimize: bool = False):
    """An onnxruntime CPU session of `model` (a ModelProto) and its output names.

    Models above the 2 GB protobuf limit go through a temporary file with external data.
    `optimize=False` disables graph rewrites so that intermediate tensors stay as written.
    """
    try:
        import onnxruntime as ort
    except ImportError:
        raise OnnxError("running ONNX models needs onnxruntime: pip install onnxruntime") from None
    so = ort.SessionOptions()
    so.log_severity_level = 4
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        data = model.SerializeToString()
    except ValueError:  # larger than 2 GB: write it out with external data
        import os
        import tempfile
        onnx = need_onnx()
        tmp = tempfile.mkdtemp(prefix="mhagen-onnx-")
        path = os.path.join(tmp, "model.onnx")
        onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data")
        data = path
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return sess


def node_attrs(node) -> dict:
    """An ONNX node's attributes as {name: python value}."""
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def has_onnxruntime() -> bool:
    """Whether onnxruntime can be imported (it is optional for importing)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def fewest_kv_heads(n_heads: int, same_kv) -> int:
    """The fewest K/V heads (a divisor of n_heads) such that, under mhagen's grouping rule,
    every query head h reads the same K/V as the first query head of its group:
    ``same_kv(h, first)`` says whether heads h and first read the same K and V."""
    for kv in (k for k in range(1, n_heads + 1) if n_heads % k == 0):
        first = first_query_heads(n_heads, kv)
        if all(same_kv(h, first[j]) for h, j in enumerate(kv_head_map(n_heads, kv))):
            return kv
    return n_heads


def first_query_heads(n_heads: int, kv_heads: int) -> list:
    """For each K/V head, the first query head that reads it."""
    head_map = kv_head_map(n_heads, kv_heads)
    return [head_map.index(j) for j in range(kv_heads)]
