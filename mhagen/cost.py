"""Work counts of a graph, for GFLOP/s reports (no TVM)."""
from mhagen.ir.unfuse import unfuse


def graph_flops(graph, **dims) -> int:
    """2 flops per multiply-add of every projection, score and weighted sum (masked included;
    a graph holding the fused kinds: those of its head-by-head form)."""
    graph = unfuse(graph)
    shapes = graph.shapes(**dims)
    total = 0
    for n in graph.nodes:
        if n.kind in ("head_projection", "output_projection", "scores", "weighted_sum"):
            out = shapes[n.name]
            depth = shapes[n.inputs[0]][-1]
            total += 2 * out[0] * out[1] * out[2] * depth
    return int(total)
