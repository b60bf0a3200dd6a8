"""Graph-to-graph passes (no TVM). run_passes() applies them in order and says what it did."""
from mhagen.passes.fuse_attention import FusionResult, fuse_attention


def run_passes(graph, fuse: bool = True) -> FusionResult:
    """The optimised graph; with fuse=False (or an unrecognised graph) the graph unchanged."""
    if not fuse:
        return FusionResult(graph, False, "not fused: fusion disabled (fuse=False)")
    return fuse_attention(graph)


__all__ = ["FusionResult", "fuse_attention", "run_passes"]
