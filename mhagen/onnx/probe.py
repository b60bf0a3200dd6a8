"""Running an ONNX model on probe inputs, with chosen intermediate tensors exposed.

Backends: onnxruntime when it is installed (fast; needed for com.microsoft operators), else
onnx's own numpy reference evaluator (``onnx.reference``), so that importing a model whose
weights sit in initializers needs no onnxruntime. ``run_nodes`` evaluates a few nodes on
given values (the weight reader traces index tensors through layout ops with it).
"""
from __future__ import annotations

import numpy as np

from mhagen.onnx._common import OnnxError, has_onnxruntime, need_onnx, ort_session

FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}


def is_float3(inp):
    """Whether a graph input is a rank-3 floating-point tensor ([batch, seq, D])."""
    t = inp.type.tensor_type
    return t.elem_type in FLOAT_TYPES and len(t.shape.dim) == 3


class Prober:
    """Runs model index `m` on random float inputs (and `sample_inputs` for the others) and
    returns {tensor name: value} for `names`, the model inputs and the constants among them.

    `sample_inputs` is a dict {input name: array} or a list of such dicts, used in turn.
    """

    def __init__(self, m, names, sample_inputs):
        onnx = need_onnx()
        from onnx import numpy_helper
        self.m = m
        self.samples = _sample_list(sample_inputs)
        self.runs = 0
        self.consts = {n: numpy_helper.to_array(m.inits[n]) for n in names if n in m.inits}
        inputs = {i.name for i in m.inputs}
        self.fetch = [n for n in dict.fromkeys(names) if n not in self.consts and n not in inputs]
        proto = onnx.ModelProto()
        proto.CopyFrom(m.proto)
        have = {o.name for o in proto.graph.output}
        for n in self.fetch:
            if n not in have:
                proto.graph.output.append(onnx.ValueInfoProto(name=n))
        self.backend = "onnxruntime" if has_onnxruntime() else "onnx.reference"
        try:
            self._run = _ort_runner(proto) if self.backend == "onnxruntime" else \
                _reference_runner(proto)
        except OnnxError:
            raise
        except Exception as err:  # an invalid model: the backends raise their own types
            raise OnnxError(f"{self.backend} cannot load the model ({_first_line(err)}); "
                            "onnx.checker.check_model(model, full_check=True) says what is "
                            "wrong with it") from None

    def shapes(self, batch, seq, swap=False):
        """Input shapes: dynamic axis 0/1 of rank-3 float inputs are batch/seq (swapped for
        seq-first models), other dynamic dims 1; dims with the same name agree."""
        assign, shapes = {}, {}
        for inp in sorted(self.m.inputs, key=lambda i: not is_float3(i)):
            dims = []
            for axis, d in enumerate(inp.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(d.dim_value)
                    continue
                key = d.dim_param or (inp.name, axis)
                if key not in assign:
                    seq_axis = (axis == 1) != swap
                    assign[key] = (seq if seq_axis else batch) if (
                        is_float3(inp) and axis in (0, 1)) else 1
                dims.append(assign[key])
            shapes[inp.name] = tuple(dims)
        return shapes

    def _next_sample(self, check):
        """The sample for the next run: the last one is held out for the self-check when
        there are several; the others are used in turn."""
        if not self.samples:
            return {}
        if check or len(self.samples) == 1:
            return self.samples[-1]
        self.runs += 1
        return self.samples[(self.runs - 1) % (len(self.samples) - 1)]

    def feeds(self, shapes, rng, check=False):
        """Model inputs for one run: random floats, a sample for the others."""
        sample = self._next_sample(check)
        feeds = {}
        for inp in self.m.inputs:
            elem = inp.type.tensor_type.elem_type
            if inp.name in sample and elem not in FLOAT_TYPES:
                feeds[inp.name] = np.asarray(sample[inp.name])
            elif elem in FLOAT_TYPES:
                feeds[inp.name] = rng.standard_normal(shapes[inp.name]).astype(FLOAT_TYPES[elem])
            else:
                raise OnnxError(f"model input {inp.name!r} is not floating point; pass "
                                f"sample_inputs={{{inp.name!r}: array}} to import_onnx")
        return feeds

    def run(self, shapes, rng, check=False):
        """{tensor: value} of one probe run (`check`: the self-check's run)."""
        feeds = self.feeds(shapes, rng, check)
        try:
            outs = self._run(self.fetch, feeds)
        except OnnxError:
            raise
        except Exception as err:  # the backends raise their own exception types
            given = {k: v.shape for k, v in feeds.items()}
            raise OnnxError(f"{self.backend} cannot run the model on inputs of shapes "
                            f"{given} ({_first_line(err)}); if the model only runs at the "
                            "sequence length it was exported with, pass that length as "
                            "seq_len=") from None
        vals = dict(self.consts)
        vals.update(feeds)
        vals.update(zip(self.fetch, outs))
        return vals


def _first_line(err) -> str:
    """A backend's error, first line, without onnxruntime's status prefixes."""
    msg = str(err).splitlines()[0] if str(err) else type(err).__name__
    return msg.split("Status Message:")[-1].split("was false.")[-1].strip()[:200]


def _sample_list(sample_inputs):
    if sample_inputs is None:
        return []
    if isinstance(sample_inputs, dict):
        return [sample_inputs]
    samples = list(sample_inputs)
    if not all(isinstance(s, dict) for s in samples):
        raise OnnxError("sample_inputs must be a dict {input name: array} or a list of them")
    return samples


def _ort_runner(proto):
    sess = ort_session(proto)
    return lambda fetch, feeds: sess.run(fetch, feeds)


def _reference_runner(proto):
    from onnx.reference import ReferenceEvaluator
    foreign = sorted({n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")})
    if foreign:
        raise OnnxError(f"the model uses operators of domain(s) {foreign}, which only "
                        "onnxruntime runs: pip install onnxruntime")
    evaluator = ReferenceEvaluator(proto)
    return lambda fetch, feeds: evaluator.run(fetch, feeds)


def run_nodes(m, nodes, values, outputs):
    """Evaluate `nodes` (in order) with onnx's reference evaluator; `values` gives every
    tensor they read that they do not produce. Returns [value of each of `outputs`]."""
    onnx = need_onnx()
    h = onnx.helper
    produced = {o for n in nodes for o in n.output if o}
    needed = list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in produced))
    graph = h.make_graph(list(nodes), "trace",
                         [onnx.ValueInfoProto(name=i) for i in needed],
                         [onnx.ValueInfoProto(name=o) for o in outputs])
    model = h.make_model(graph, opset_imports=list(m.proto.opset_import))
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(model).run(None, {i: values[i] for i in needed})
