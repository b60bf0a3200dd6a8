"""mhagen: a compiler for multi-head attention layers (graph DSL -> TVM TE -> compiled code).

Importing mhagen does not import TVM: build and tune do (the compiler), on first use; load
and calling a module use TVM's runtime library only (mhagen/runtime.py).
"""
from mhagen.runtime import prepare_tvm_threads

prepare_tvm_threads()   # TVM sizes its thread pool once: set TVM_NUM_THREADS before it starts

# isort: split
from mhagen.artifact.load import LoadedArtifact, read_artifact
from mhagen.dsl import mha
from mhagen.errors import ArtifactError, GraphError, InputError, MhagenError, TargetError
from mhagen.ir import (Graph, alibi, batch, causal, combine, exp, head, kv_idx, kv_len, maximum,
                       minimum, q_idx, q_len, relative_bias, rotary, score, sliding_window,
                       softcap, table, tanh, verify, where)
from mhagen.arrays import aligned_empty
from mhagen.kvcache import KVCache
from mhagen.paged_cache import PagedKVCache
from mhagen.module import Module
from mhagen.onnx import export_onnx, import_onnx
from mhagen.tolerances import TOLERANCES, max_error
from mhagen.torch import from_torch, kv_lens_from_mask
from mhagen.extras import require_tuning_dependencies
from mhagen.version import __version__
from mhagen.weights import load_weights, save_weights, weights_from_torch


def build(layer, target="x86", *, batch=1, seq_len=128, weights=None, **options):
    """Compile `layer` for `target` at [batch, seq_len]; returns a callable mhagen.module.Module."""
    from mhagen.compile import build as _build
    return _build(layer, target, batch=batch, seq_len=seq_len, weights=weights, **options)


def tune(layer, target="x86", **options):
    """Autotune `layer`'s kernels with TVM MetaSchedule; see mhagen.tuning.search.tune.
    Needs the tuning extra: pip install 'mhagen[tune]'."""
    require_tuning_dependencies()
    from mhagen.tuning.search import tune as _tune
    return _tune(layer, target, **options)


def load(path):
    """Load a module saved with Module.save(path): needs the TVM runtime only, not the
    compiler (see mhagen/artifact/load.py); attention_maps() then compiles with build().
    A CUDA artifact runs through its own C API (no TVM; needs an NVIDIA GPU)."""
    loaded = read_artifact(path)
    if not isinstance(loaded, LoadedArtifact):   # a CUDA artifact: its own module class
        return loaded
    return Module.from_artifact(loaded, compile_maps=_compile_maps)


def _compile_maps(graph, target, batch, seq_len):
    """The compiler's attention-maps build, imported on first use (a loaded module runs
    without the compiler)."""
    from mhagen.compile import compile_maps
    return compile_maps(graph, target, batch, seq_len)


__all__ = ["__version__", "ArtifactError", "Graph", "GraphError", "InputError", "KVCache",
           "PagedKVCache",
           "MhagenError",
           "TOLERANCES", "TargetError", "aligned_empty", "alibi", "batch", "build", "causal",
           "combine", "exp", "export_onnx", "from_torch", "head", "import_onnx", "kv_idx",
           "kv_len", "kv_lens_from_mask", "load",
           "max_error", "maximum", "mha", "minimum", "q_idx", "q_len", "relative_bias",
           "rotary", "score", "sliding_window", "softcap", "table", "tanh", "tune", "verify",
           "weights_from_torch", "where", "load_weights", "save_weights"]
