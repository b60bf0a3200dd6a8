"""The graph IR and the DSL: mha() options, printing, JSON round trip, the builder API, and
every error path (GraphError / TypeError with a message that says how to fix it)."""
import collections
import copy
import json
import math
import random

import numpy as np
import pytest

import mhagen
from mhagen import GraphError
from mhagen.ir import expr as ex
from mhagen.ir.graph import Graph, Node
from mhagen.passes import run_passes


def kinds(g):
    return [n.kind for n in g.nodes]


# -- mha(): defaults and options ---------------------------------------------------------------
def test_mha_defaults():
    g = mhagen.mha()
    assert g.name == "mha"
    assert g.dtype == "float32"
    assert g.options == {"d_model": 512, "num_heads": 8, "head_dim": 64, "kv_heads": 8,
                         "causal": False, "bias": True}
    assert g.inputs[0].attrs["shape"] == ["batch", "seq", 512]
    assert kinds(g).count("head_projection") == 8 * 3
    assert kinds(g).count("softmax") == 8
    assert "mask" not in kinds(g)
    shapes = g.shapes(batch=2, seq=5)
    assert shapes[g.output] == [2, 5, 512]
    assert shapes["s0"] == [2, 5, 5]
    assert shapes["concat"] == [2, 5, 512]
    assert math.isclose(g.node("scaled0").attrs["factor"], 1 / 8)
    assert {s.name: s.shape for s in g.weight_specs()} == {
        "w_q": (8, 512, 64), "w_k": (8, 512, 64), "w_v": (8, 512, 64), "w_o": (512, 512),
        "b_q": (8, 64), "b_k": (8, 64), "b_v": (8, 64), "b_o": (512,)}


def test_mha_head_dim_explicit():
    g = mhagen.mha(d_model=64, num_heads=4, head_dim=40)
    assert g.options["head_dim"] == 40
    assert g.shapes()["q0"] == ["batch", "seq", 40]
    assert g.shapes()["concat"] == ["batch", "seq", 160]
    assert g.shapes()[g.output] == ["batch", "seq", 64]
    assert math.isclose(g.node("scaled0").attrs["factor"], 1 / math.sqrt(40))
    specs = {s.name: s.shape for s in g.weight_specs()}
    assert specs["w_q"] == (4, 64, 40) and specs["w_o"] == (160, 64)


@pytest.mark.parametrize("kv_heads, expected_kv", [(2, [0, 0, 0, 0, 1, 1, 1, 1]),
                                                   (1, [0] * 8), (8, list(range(8)))],
                         ids=["grouped-2", "multi-query", "full"])
def test_mha_kv_heads(kv_heads, expected_kv):
    g = mhagen.mha(d_model=64, num_heads=8, kv_heads=kv_heads)
    assert g.options["kv_heads"] == kv_heads
    specs = {s.name: s.shape for s in g.weight_specs()}
    assert specs["w_k"] == (kv_heads, 64, 8) and specs["w_v"] == (kv_heads, 64, 8)
    assert specs["w_q"] == (8, 64, 8)
    assert [g.node(f"s{h}").inputs[1] for h in range(8)] == [f"k{i}" for i in expected_kv]
    assert [g.node(f"o{h}").inputs[1] for h in range(8)] == [f"v{i}" for i in expected_kv]


def test_mha_causal():
    g = mhagen.mha(d_model=32, num_heads=2, causal=True)
    assert g.options["causal"] is True
    masks = [n for n in g.nodes if n.kind == "mask"]
    assert [m.attrs["head"] for m in masks] == [0, 1]
    assert all(m.attrs["mask"] == mhagen.causal() for m in masks)


def test_mha_no_bias():
    g = mhagen.mha(d_model=32, num_heads=2, bias=False)
    assert g.options["bias"] is False
    assert not any("bias" in n.attrs for n in g.nodes)
    assert sorted(s.name for s in g.weight_specs()) == ["w_k", "w_o", "w_q", "w_v"]


def test_mha_sliding_window_mask():
    window = mhagen.sliding_window(3)
    g = mhagen.mha(d_model=32, num_heads=2, mask=window)
    assert g.options["mask"] == repr(window)
    assert g.node("masked1").attrs["mask"] == window
    both = mhagen.mha(d_model=32, num_heads=2, causal=True, mask=window)
    assert both.node("masked0").attrs["mask"] == (mhagen.causal() & window)


def test_mha_name():
    assert mhagen.mha(32, 2, name="attn").name == "attn"


# -- printing ------------------------------------------------------------------------------------
def test_print_shows_kinds_shapes_and_attrs():
    text = str(mhagen.mha(d_model=64, num_heads=4, causal=True))
    lines = text.splitlines()
    assert lines[0].startswith("graph mha(") and "num_heads=4" in lines[0]
    assert "invalid" not in text
    for kind in ("input", "head_projection", "scores", "scale", "mask", "softmax",
                 "weighted_sum", "concat_heads", "output_projection"):
        assert f"= {kind}(" in text, kind
    assert "-> [batch, seq, 64]" in text
    assert "-> [batch, seq, 16]" in text
    assert "-> [batch, seq, seq]" in text
    assert "weight=w_q[3]" in text and "bias=b_q[3]" in text
    assert "factor=0.25" in text
    assert "(kv_idx <= q_idx)" in text
    assert lines[-1] == "  return %y"
    # one line per node, plus header and return
    assert len(lines) == 35 + 2


def test_print_invalid_graph_says_why():
    g = Graph("broken")
    x = g.input("x", d_model=16)
    g.scores(x, "nope")
    text = str(g)
    assert "# invalid:" in text and "'nope'" in text
    assert "%x" in text


def test_repr_is_short():
    r = repr(mhagen.mha(d_model=32, num_heads=2))
    assert r.startswith("<Graph mha(") and r.endswith(" nodes>") and "\n" not in r


# -- JSON round trip -----------------------------------------------------------------------------
ROUND_TRIP = {
    "default": lambda: mhagen.mha(d_model=32, num_heads=4),
    "causal": lambda: mhagen.mha(d_model=32, num_heads=4, causal=True),
    "sliding-window": lambda: mhagen.mha(d_model=32, num_heads=4, mask=mhagen.sliding_window(3)),
    "causal+window": lambda: mhagen.mha(32, 4, causal=True, mask=mhagen.sliding_window(5)),
    "grouped-no-bias": lambda: mhagen.mha(d_model=32, num_heads=4, kv_heads=2, bias=False),
    "all-mask-vars": lambda: mhagen.mha(
        d_model=32, num_heads=4,
        mask=(ex.head.eq(0) | (ex.batch.ne(1) & (mhagen.kv_idx * 2 >= mhagen.q_idx - 1)))
        & (mhagen.kv_idx < ex.kv_len) & (mhagen.q_idx <= ex.q_len + -1) & (3 > mhagen.kv_idx)),
}


@pytest.mark.parametrize("make", ROUND_TRIP.values(), ids=ROUND_TRIP.keys())
def test_json_round_trip(make):
    g = make()
    text = g.to_json()
    back = Graph.from_json(text)
    assert back == g
    assert back.to_json() == text
    assert [(n.name, n.kind, n.inputs, n.attrs) for n in back.nodes] == \
        [(n.name, n.kind, n.inputs, n.attrs) for n in g.nodes]
    assert back.output == g.output and back.options == g.options
    for n in back.nodes:
        if n.kind == "mask":
            assert isinstance(n.attrs["mask"], ex.Expr)
            assert repr(n.attrs["mask"]) == repr(g.node(n.name).attrs["mask"])
    # also from an already parsed dict
    assert Graph.from_json(json.loads(text)) == g


def test_json_round_trip_computes_the_same():
    g = ROUND_TRIP["all-mask-vars"]()
    back = Graph.from_json(g.to_json())
    w = g.init_weights(3)
    x = np.random.default_rng(0).standard_normal((2, 6, 32))
    np.testing.assert_array_equal(back.reference(x, w), g.reference(x, w))


def test_graph_equality_sees_mask_differences():
    a = mhagen.mha(32, 4, mask=mhagen.sliding_window(3))
    b = mhagen.mha(32, 4, mask=mhagen.sliding_window(4))
    assert a != b
    assert a == mhagen.mha(32, 4, mask=mhagen.sliding_window(3))


# -- the builder API -----------------------------------------------------------------------------
def build_by_hand(d_model=16, heads=2, bias=True, mask=None):
    """mha(d_model, heads) node by node, with other node names than mha() uses."""
    d = d_model // heads
    g = Graph("by_hand")
    x = g.input("x", d_model=d_model)
    outs = []
    for h in range(heads):
        def proj(w):
            return g.head_projection(x, f"w_{w}", head=h, out_features=d,
                                     bias=f"b_{w}" if bias else None)
        q, k, v = proj("q"), proj("k"), proj("v")
        s = g.scale(g.scores(q, k), 1 / math.sqrt(d))
        if mask is not None:
            s = g.mask(s, mask, head=h)
        outs.append(g.weighted_sum(g.softmax(s), v))
    c = g.concat_heads(outs)
    g.set_output(g.output_projection(c, "w_o", out_features=d_model,
                                      bias="b_o" if bias else None, name="out"))
    return g


@pytest.mark.parametrize("bias, mask", [(True, None), (False, None),
                                        (True, mhagen.sliding_window(2))],
                         ids=["bias", "no-bias", "sliding-window"])
def test_builder_matches_mha(bias, mask):
    g = build_by_hand(bias=bias, mask=mask)
    assert g.output == "out"
    assert g.shapes(batch=2, seq=7)["out"] == [2, 7, 16]
    names = [n.name for n in g.nodes]
    assert "head_projection0" in names and "softmax1" in names  # fresh names per kind
    assert len(set(names)) == len(names)
    layer = mhagen.mha(d_model=16, num_heads=2, bias=bias, mask=mask)
    assert g.weight_specs() == layer.weight_specs()
    w = layer.init_weights(seed=1)
    x = np.random.default_rng(1).standard_normal((2, 7, 16)).astype(np.float32)
    np.testing.assert_allclose(g.reference(x, w), layer.reference(x, w), rtol=1e-12, atol=1e-12)


def test_builder_returns_names_and_node_lookup():
    g = Graph("t")
    assert g.input("inp", d_model=8) == "inp"
    p = g.head_projection("inp", "w_q", head=0, out_features=4, bias="b_q", name="q")
    assert p == "q"
    assert g.node("q").attrs == {"weight": "w_q", "head": 0, "out_features": 4, "bias": "b_q"}
    with pytest.raises(GraphError, match="has no node 'missing'"):
        g.node("missing")


def test_input_queries_see_nodes_added_after_them():
    """inputs / lengths_input / cache_lens_input keep an index by kind, rebuilt when the
    graph grows (a module call asks for them several times)."""
    g = Graph("t")
    g.input("x", d_model=8)
    assert [n.name for n in g.inputs] == ["x"] and g.lengths_input is None
    assert g.cache_lens_input is None
    g.lengths("kv_lens")
    g.cache_lens("pos")
    g.input("ctx", d_model=8)
    assert [n.name for n in g.inputs] == ["x", "ctx"]
    assert (g.lengths_input.name, g.cache_lens_input.name) == ("kv_lens", "pos")
    g.inputs.clear()   # a copy: the graph keeps its inputs
    assert len(g.inputs) == 2


def test_verify_binds_dims():
    g = mhagen.mha(32, 4)
    assert mhagen.verify(g, batch=3, seq=11)["p2"] == [3, 11, 11]
    with pytest.raises(GraphError, match=r"unknown dimension\(s\) \['sequence'\].*'seq'"):
        mhagen.verify(g, sequence=4)
    with pytest.raises(GraphError, match="seq=0 must be a positive integer"):
        mhagen.verify(g, seq=0)


# -- error paths ---------------------------------------------------------------------------------
def _graph(*steps, output=True, d_model=16, dtype="float32"):
    """A small graph: x -> q, k (width 8) -> scores; `steps` edit it before the output is set."""
    g = Graph("t", dtype=dtype)
    x = g.input("x", d_model=d_model)
    g.head_projection(x, "w_q", head=0, out_features=8, name="q")
    g.head_projection(x, "w_k", head=0, out_features=8, name="k")
    g.head_projection(x, "w_v", head=0, out_features=8, name="v")
    last = g.weighted_sum(g.softmax(g.scores("q", "k", name="s")), "v", name="o")
    for step in steps:
        last = step(g) or last
    if output:
        g.set_output(last)
    return g


def _mha_kw(**kw):
    return lambda: mhagen.mha(**kw)


def _verify(*steps, **kw):
    return lambda: mhagen.verify(_graph(*steps, **kw))


def _specs(*steps):
    return lambda: _graph(*steps).weight_specs()


def _from_json(data):
    return lambda: Graph.from_json(data if isinstance(data, str) else json.dumps(data))


def _good_json(**changes):
    data = json.loads(mhagen.mha(16, 2).to_json())
    data.update(changes)
    return data


def _bad_node_json(node):
    data = _good_json()
    data["nodes"].append(node)
    return data


def _add(kind, inputs=(), name=None, **attrs):
    return lambda g: g.add(kind, inputs, name, **attrs)


def _input_builder(**kw):
    def make():
        g = Graph("t")
        x = g.input("x", **kw)
        g.set_output(g.output_projection(x, "w_o", out_features=4))
        return mhagen.verify(g)
    return make


def _out_features_builder(value):
    def make():
        g = Graph("t")
        x = g.input("x", d_model=8)
        g.set_output(g.output_projection(x, "w_o", out_features=value))
        return mhagen.verify(g)
    return make


def _fused_json(kind, **attrs):
    """verify() of the fused graph of a 2-head layer with the attrs of its first `kind` node
    (qkv_projection or attention) changed."""
    def make():
        data = _fused_data()
        next(n for n in data["nodes"] if n["kind"] == kind)["attrs"].update(attrs)
        return mhagen.verify(Graph.from_json(json.dumps(data)))
    return make


def _fused_data(cross=False):
    return json.loads(run_passes(mhagen.mha(16, 2, cross=cross)).graph.to_json())


def _cache(lens_kind="cache_lens", **changes):
    """verify() of the small graph with a cache node on K (`changes` to its arguments) that
    reads a node `cl` of lens_kind."""
    args = {**dict(x="k", lens="cl", cache="k_cache", head=0, max_len=8, name="kc"), **changes}
    return _verify(lambda g: getattr(g, lens_kind)("cl"), lambda g: g.cache(**args))


def _context(g):
    """A second input (batch and length of its own) and a head projected from it."""
    g.input("ctx", d_model=16, batch="batch2", seq="kv_seq")
    return g.head_projection("ctx", "w_c", head=0, out_features=8, name="kc")


ERRORS = [
    # (id, callable, message fragments)
    ("d_model-not-divisible", _mha_kw(d_model=500, num_heads=8),
     ["d_model=500", "num_heads=8", "496", "504", "head_dim="]),
    ("kv_heads-not-divisor", _mha_kw(d_model=64, num_heads=8, kv_heads=3),
     ["kv_heads=3", "num_heads=8", "[1, 2, 4, 8]"]),
    ("kv_heads-more-than-heads", _mha_kw(d_model=64, num_heads=8, kv_heads=16),
     ["kv_heads=16", "[1, 2, 4, 8]"]),
    ("d_model-zero", _mha_kw(d_model=0), ["d_model=0", "positive integer"]),
    ("d_model-negative", _mha_kw(d_model=-64), ["d_model=-64", "positive integer"]),
    ("d_model-bool", _mha_kw(d_model=True), ["d_model=True", "positive integer"]),
    ("d_model-float", _mha_kw(d_model=64.0), ["d_model=64.0", "positive integer"]),
    ("num_heads-zero", _mha_kw(d_model=64, num_heads=0), ["num_heads=0", "positive integer"]),
    ("num_heads-bool", _mha_kw(d_model=64, num_heads=True), ["num_heads=True", "positive"]),
    ("head_dim-negative", _mha_kw(d_model=64, num_heads=4, head_dim=-1),
     ["head_dim=-1", "positive integer"]),
    ("kv_heads-zero", _mha_kw(d_model=64, num_heads=4, kv_heads=0),
     ["kv_heads=0", "positive integer"]),
    ("kv_heads-bool", _mha_kw(d_model=64, num_heads=4, kv_heads=False),
     ["kv_heads=False", "positive integer"]),
    ("mask-not-boolean", _mha_kw(d_model=64, num_heads=4, mask=mhagen.q_idx - mhagen.kv_idx),
     ["boolean mask expression", "sliding_window"]),
    ("mask-not-expr", _mha_kw(d_model=64, num_heads=4, mask="causal"),
     ["boolean mask expression"]),
    ("input-misspelled", _verify(_add("softmax", ("ss",), "p2")),
     ["'p2'", "unknown node 'ss'", "check the spelling"]),
    ("input-defined-later", _verify(_add("softmax", ("later",), "p2"), _add("scale", ("s",),
                                                                            "later", factor=2.0)),
     ["'p2'", "unknown node 'later'", "defined later", "defined before"]),
    ("duplicate-name", lambda: _graph(_add("softmax", ("s",), "q")),
     ["'q'", "used twice", "its own name"]),
    ("unknown-kind", lambda: _graph(_add("relu", ("o",))),
     ["'relu'", "use one of", "head_projection"]),
    ("unknown-kind-in-nodes", _verify(lambda g: g.nodes.append(Node("r", "relu", ("o",)))),
     ["'relu'", "use one of", "softmax"]),
    ("missing-attr", _verify(_add("scale", ("s",), "sc")),
     ["'sc'", "lacks attribute", "'factor'"]),
    ("missing-mask-attrs", _verify(_add("mask", ("s",), "m")),
     ["'m'", "['mask', 'head']"]),
    ("unknown-attr", _verify(_add("softmax", ("s",), "p2", axis=-1)),
     ["'p2'", "unknown attribute", "'axis'", "allowed"]),
    ("wrong-arity", _verify(_add("scores", ("q",), "s2")),
     ["'s2'", "takes 2 input(s)", "got 1"]),
    ("concat-no-inputs", _verify(_add("concat_heads", (), "c")),
     ["'c'", "at least one input"]),
    ("no-output", _verify(output=False), ["no output", "set_output"]),
    ("output-not-a-node", _verify(lambda g: "nowhere"), ["'nowhere'", "set_output"]),
    ("input-not-3d", lambda: mhagen.verify(Graph.from_json(_good_json(nodes=[
        {"name": "x", "kind": "input", "inputs": [], "attrs": {"shape": ["b", "s", 4, 4]}}],
        output="x"))), ["'x'", "shape [batch, seq, d_model]", "['b', 's', 4, 4]"]),
    ("empty-graph", lambda: mhagen.verify(Graph("e")), ["empty", "mhagen.mha()"]),
    ("qk-width-mismatch", _verify(
        lambda g: g.head_projection("x", "w_k2", head=0, out_features=6, name="k6"),
        _add("scores", ("q", "k6"), "s2")),
     ["'s2'", "[batch, seq, 8]", "[batch, seq, 6]", "same head_dim"]),
    ("weighted-sum-mismatch", _verify(
        lambda g: g.output_projection("x", "w_t", out_features=8, name="t"),
        _add("weighted_sum", ("t", "v"), "ws")),
     ["'ws'", "share batch and key length"]),
    ("weight-reused-different-shape", _specs(
        lambda g: g.head_projection("x", "w_q", head=1, out_features=4, name="q4")),
     ["'w_q'", "different shapes", "'q'", "'q4'", "[16x8]", "[16x4]", "its own weight name"]),
    ("weight-reused-as-bias", _specs(
        lambda g: g.head_projection("x", "w_x", head=0, out_features=8, bias="w_q", name="q9")),
     ["'w_q'", "different shapes or roles", "its own weight name"]),
    ("weight-head-used-twice", _specs(
        lambda g: g.head_projection("x", "w_q", head=0, out_features=8, name="q_again")),
     ["'w_q'[0]", "two nodes", "its own index"]),
    ("head-index-gap", _specs(
        lambda g: g.head_projection("x", "w_q", head=2, out_features=8, name="q2")),
     ["'w_q'", "[0, 2]", "but not [1]", "0..1"]),
    ("head-negative", _verify(
        lambda g: g.head_projection("x", "w_n", head=-1, out_features=8, name="qn")),
     ["'qn'", "head must be an int >= 0"]),
    ("out_features-zero", _out_features_builder(0), ["out_features must be a positive int"]),
    ("out_features-bool", _out_features_builder(True), ["out_features must be a positive int"]),
    ("input-d_model-zero", _input_builder(d_model=0), ["dim 0", "positive int"]),
    ("input-d_model-negative", _input_builder(d_model=-3), ["dim -3", "positive int"]),
    ("input-d_model-bool", _input_builder(d_model=True), ["positive int"]),
    ("input-symbolic-d_model", lambda: mhagen.verify(Graph.from_json(_good_json(nodes=[
        {"name": "x", "kind": "input", "inputs": [], "attrs": {"shape": ["b", "s", "d"]}}],
        output="x"))), ["feature dim must be a number"]),
    ("input-bool-dim-json", lambda: mhagen.verify(Graph.from_json(_good_json(nodes=[
        {"name": "x", "kind": "input", "inputs": [], "attrs": {"shape": ["b", "s", True]}}],
        output="x"))), ["dim True", "positive int"]),
    ("huge-head-index", _specs(
        lambda g: g.head_projection("x", "w_q", head=10 ** 9, out_features=8, name="qh")),
     ["'w_q'", f"[0, {10 ** 9}]", "but not [1, 2, 3", "...]", "0..1"]),
    ("head-past-32-bit", _verify(lambda g: g.mask("s", mhagen.causal, head=10 ** 12, name="m")),
     ["mask 'm'", "head must be an int >= 0 (32-bit)", "1000000000000"]),
    ("concat-of-scores", _verify(_add("concat_heads", ("o", "s"), "c")),
     ["concat_heads 'c'", "'s' is [batch, seq, seq]", "[batch, seq, features] tensor"]),
    ("concat-seq-mismatch", _verify(_context, _add("concat_heads", ("o", "kc"), "c")),
     ["'c'", "'kc' is [batch2, kv_seq, 8]", "heads must share batch and seq"]),
    ("projection-of-scores", _verify(
        lambda g: g.output_projection("s", "w_o", out_features=16, name="y")),
     ["output_projection 'y'", "'s' is [batch, seq, seq]"]),
    ("weighted-sum-of-lengths", _verify(lambda g: g.lengths("lens"),
                                        _add("weighted_sum", ("s", "lens"), "ws")),
     ["weighted_sum 'ws'", "'lens' is [batch]", "[batch, seq, features]"]),
    ("scale-nan", _verify(_add("scale", ("s",), "sc", factor=float("nan"))),
     ["scale 'sc'", "finite number", "nan"]),
    ("scale-string", _verify(_add("scale", ("s",), "sc", factor="0.5")),
     ["scale 'sc'", "finite number", "'0.5'"]),
    ("softmax-of-lengths", _verify(lambda g: g.lengths("lens"), _add("softmax", ("lens",))),
     ["softmax", "takes scores [B, S, T]", "[batch]"]),
    ("mask-head-negative", _verify(lambda g: g.mask("s", mhagen.causal, head=-1, name="m")),
     ["mask 'm'", "head must be an int >= 0", "-1"]),
    ("mask-second-input-not-lengths", _verify(_add("mask", ("s", "q"), "m", mask=mhagen.causal,
                                                   head=0)),
     ["mask 'm'", "second input must be a lengths or cache_lens node", "head_projection"]),
    ("lengths-batch-mismatch", _verify(lambda g: g.lengths("lens", batch="other"),
                                       lambda g: g.mask("s", mhagen.causal, head=0, name="m",
                                                        lengths="lens")),
     ["mask 'm'", "lengths [other]", "must share the batch dim"]),
    ("lengths-batch-not-a-dim", _verify(lambda g: g.lengths("lens", batch=0)),
     ["lengths 'lens'", "batch must be the input's batch dim"]),
    ("score-mod-not-numeric", _verify(lambda g: g.score_mod("s", mhagen.causal, head=0,
                                                            name="sm")),
     ["score_mod 'sm'", "numeric expression of score", "softcap"]),
    ("rotary-of-lengths", _verify(lambda g: g.lengths("lens"), _add(
        "rotary", ("lens",), "r", base=10000.0, rotary_dim=None)),
     ["rotary 'r'", "one head [B, S, d]", "[batch]"]),
    ("rotary-of-scores", _verify(_add("rotary", ("s",), "r", base=10000.0, rotary_dim=2)),
     ["rotary 'r'", "one head [B, S, d]", "[batch, seq, seq]"]),
    ("cache-unknown-state", _cache(cache="q_cache"),
     ["cache 'kc'", "'k_cache' or 'v_cache'", "'q_cache'"]),
    ("cache-max_len-zero", _cache(max_len=0), ["cache 'kc'", "max_len must be an int >= 1", "0"]),
    ("cache-head-bool", _cache(head=True), ["cache 'kc'", "head must be an int >= 0", "True"]),
    ("cache-dtype", _cache(dtype="int8"), ["cache 'kc'", "dtype must be one of", "'int8'"]),
    ("cache-of-lengths", _cache(x="cl"), ["cache 'kc'", "one K or V head [B, S, d]", "[batch]"]),
    ("cache-without-cache-lens", _cache(lens_kind="lengths"),
     ["cache 'kc'", "must be a cache_lens node", "got a lengths"]),
    ("fused-head_dim-zero", _fused_json("attention", head_dim=0),
     ["attention 'attention'", "head_dim=0 must be a positive integer"]),
    ("fused-head_dim-float", _fused_json("attention", head_dim=2.5), ["head_dim=2.5"]),
    ("fused-offsets-bool", _fused_json("attention", q_offsets=[0, False]),
     ["q/k/v_offsets", "ints >= 0", "False"]),
    ("fused-offsets-not-a-list", _fused_json("attention", k_offsets=16),
     ["q/k/v_offsets", "one offset per head"]),
    ("fused-offsets-count", _fused_json("attention", v_offsets=[32]),
     ["q/k/v_offsets", "one offset per head"]),
    ("fused-offset-past-qkv", _fused_json("attention", v_offsets=[32, 44]),
     ["an offset + head_dim 8 exceeds", "(48, 48, 48)"]),
    ("fused-scale-inf", _fused_json("attention", scale=float("inf")),
     ["attention 'attention'", "scale must be a finite number", "inf"]),
    ("fused-cache-malformed", _fused_json("attention", cache={"max_len": 0}),
     ["cache must be {'max_len': N}", "cache_lens node as the second input"]),
    ("fused-cross-without-kv", lambda: mhagen.verify(Graph.from_json(json.dumps(
        _cross_without_kv()))), ["cross takes qkv and kv inputs"]),
    ("fused-segments-empty", _fused_json("qkv_projection", segments=[]),
     ["qkv_projection 'qkv'", "non-empty list of {weight, head, bias, width}"]),
    ("fused-segment-width-list", _fused_json("qkv_projection", segments=[
        {"weight": "w_q", "head": 0, "width": [8]}]), ["width a positive int", "[8]"]),
    ("fused-segment-head-float", _fused_json("qkv_projection", segments=[
        {"weight": "w_q", "head": 2.5, "width": 8}]), ["head an int >= 0", "2.5"]),
    ("dtype-unsupported", _verify(dtype="float64"), ["'float64'", "not supported", "float32"]),
    ("json-wrong-format", _from_json(_good_json(format="onnx")),
     ["not an mhagen graph", '"format": "mhagen.graph"']),
    ("json-not-an-object", _from_json([1, 2]), ["not an mhagen graph"]),
    ("json-wrong-version", _from_json(_good_json(version=2)),
     ["version 2", "reads version 1", "upgrade mhagen"]),
    ("json-no-version", _from_json(_good_json(version=None)), ["version None", "upgrade"]),
    ("json-not-json", _from_json('{"format": "mhagen.graph", "version": 1, "nodes": ['),
     ["JSON"]),
    ("json-node-without-kind", _from_json(_bad_node_json({"name": "z", "inputs": ["x"]})),
     ["bad node", "'kind'"]),
    ("json-node-not-an-object", _from_json(_bad_node_json(["softmax", "x"])),
     ["bad node", "'name', 'kind'"]),
    ("json-bad-mask-expr", _from_json(_bad_node_json(
        {"name": "m", "kind": "mask", "inputs": ["s0"],
         "attrs": {"head": 0, "mask": {"$expr": {"var": "i"}}}})),
     ["bad node", "unknown mask variable 'i'"]),
    ("json-node-attrs-a-number", _from_json(_bad_node_json(     # found by editing
        {"name": "z", "kind": "softmax", "inputs": ["s0"], "attrs": 0.5})),  # JSON at random
     ["bad node", "'attrs' must be an object"]),
    ("json-node-inputs-a-string", _from_json(_bad_node_json(
        {"name": "z", "kind": "softmax", "inputs": "s0", "attrs": {}})),
     ["bad node", "'inputs' must be a list of node names"]),
    ("json-nodes-an-object", _from_json(_good_json(nodes={"a": 1})),
     ["bad graph JSON", "'nodes' must be a list of nodes"]),
    ("json-options-a-list", _from_json(_good_json(options=[1])),
     ["bad graph JSON", "'options' must be an object"]),
    # found by editing graph JSON at random: TVM's folding refused x / 0 (InternalError),
    # and an index constant of -2^31 wrapped in the kernels' int32 (silently wrong)
    ("score-mod-divides-by-zero", lambda: mhagen.verify(
        mhagen.mha(16, 2, score_mod=mhagen.tanh(mhagen.score / (ex.Const(2.0) - 2.0)))),
     ["(score / (2.0 - 2.0)) divides by the constant 0"]),
    ("int32-index-at-build", lambda: mhagen.build(
        mhagen.mha(16, 2, mask=mhagen.kv_idx <= mhagen.q_idx + (2 ** 31 - 10)),
        batch=1, seq_len=16),
     ["(q_idx + 2147483638) ranges over [2147483638,", "at these sizes", "32-bit"]),
    ("int32-constant", _verify(lambda g: g.mask("s", mhagen.q_idx * 0 + 2 ** 40 > 1, head=0,
                                                name="m")),
     ["mask 'm'", "ranges over [1099511627776, 1099511627776]"]),
    ("output-is-the-input", lambda: mhagen.verify(Graph.from_json(json.dumps(
        _good_json(output="x")))),   # it had built TIR that TVM called ill-formed
     ["the graph output 'x' is an input", "set_output()"]),
    ("score-mod-plus-inf-table", lambda: mhagen.verify(mhagen.mha(16, 2, score_mod=(
        mhagen.score + mhagen.table([0.0, float("inf")], mhagen.kv_idx - mhagen.q_idx)))),
     ["can make a score +inf or NaN", "-inf to hide a key"]),
    ("score-mod-times-inf", lambda: mhagen.verify(mhagen.mha(16, 2, score_mod=(
        mhagen.score * float("-inf")))), ["(score * -inf) can make a score +inf or NaN"]),
    ("json-unknown-kind", _from_json(_bad_node_json({"name": "z", "kind": "gelu",
                                                     "inputs": ["x"], "attrs": {}})),
     ["'gelu'", "use one of"]),
    ("json-duplicate-name", _from_json(_bad_node_json({"name": "q0", "kind": "softmax",
                                                       "inputs": ["s0"], "attrs": {}})),
     ["'q0'", "used twice"]),
]


def _cross_without_kv():
    data = _fused_data(cross=True)
    attention = next(n for n in data["nodes"] if n["kind"] == "attention")
    attention["inputs"] = attention["inputs"][:1]
    return data


@pytest.mark.parametrize("make, fragments", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_graph_errors(make, fragments):
    with pytest.raises(GraphError) as info:
        make()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_graph_error_is_a_value_error():
    assert issubclass(GraphError, ValueError) and issubclass(GraphError, mhagen.MhagenError)


# -- mask expressions in graphs --------------------------------------------------------------------
def test_mask_node_with_non_boolean_mask_rejected():
    g = _graph(lambda g: g.mask("s", mhagen.q_idx + 1, head=0, name="m"))
    with pytest.raises(GraphError, match="'m': mask must be a boolean expression of integers"):
        mhagen.verify(g)


# -- edited graphs ---------------------------------------------------------------------------------
ODD_VALUES = [None, True, False, -1, 0, 2.5, "abc", "", [], [1], {}, {"a": 1}, float("nan"),
              10 ** 12]


def _mutants(seed, count):
    """Graph JSON of standard layers (builder and fused forms) with one attribute, one item
    of a list or dict attribute, or the inputs of one node replaced."""
    rng = random.Random(seed)
    layers = [mhagen.mha(16, 2, causal=True), mhagen.mha(32, 4, kv_heads=2, rotary=True),
              mhagen.mha(16, 2, kv_cache=8, score_mod=mhagen.alibi(2)),
              mhagen.mha(16, 2, cross=True, key_padding=True, causal=True)]
    sources = [json.loads(g.to_json()) for layer in layers
               for g in (layer, run_passes(layer).graph)]
    for _ in range(count):
        data = copy.deepcopy(rng.choice(sources))
        node = rng.choice(data["nodes"])
        attrs = node["attrs"]
        if attrs and rng.random() < 0.7:
            key = rng.choice(list(attrs))
            inner = attrs[key]
            if isinstance(inner, list) and inner and isinstance(inner[0], dict):
                inner = rng.choice(inner)        # a qkv segment
            if isinstance(inner, dict) and inner and rng.random() < 0.6:
                inner[rng.choice(list(inner))] = rng.choice(ODD_VALUES)
            elif isinstance(inner, list) and inner and rng.random() < 0.6:
                inner[rng.randrange(len(inner))] = rng.choice(ODD_VALUES)
            else:
                attrs[key] = rng.choice(ODD_VALUES)
        else:
            names = [n["name"] for n in data["nodes"]]
            node["inputs"] = rng.sample(names, rng.randrange(3))
        yield data


def test_edited_graphs_verify_or_raise_a_graph_error():
    """Nothing else escapes verify() (no TypeError, IndexError, MemoryError) whatever one
    edit does to a graph's JSON."""
    outcomes = collections.Counter()
    for data in _mutants(seed=0, count=1500):
        try:
            mhagen.verify(Graph.from_json(json.dumps(data)))
            outcomes["valid"] += 1
        except GraphError:
            outcomes["refused"] += 1
    assert outcomes["valid"] > 100 and outcomes["refused"] > 500, outcomes


def _tree_edits(seed, count):
    """Graph JSON of layers whose heads carry expressions (tables, where, softcap) with one
    value anywhere in the tree changed: a number moved, a list's items swapped, a key or item
    dropped or duplicated, or a value of another type."""
    rng = random.Random(seed)
    table = np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)
    layers = [mhagen.mha(16, 2, score_mod=mhagen.relative_bias(table, max_distance=8)),
              mhagen.mha(16, 2, causal=True, score_mod=[mhagen.alibi(2), mhagen.softcap(3.0)]),
              mhagen.mha(16, 2, kv_heads=1, mask=mhagen.sliding_window(3),
                         score_mod=mhagen.where(mhagen.kv_idx < 2, mhagen.score + 1.0,
                                                mhagen.score))]
    sources = [json.loads(layer.to_json()) for layer in layers]

    def paths(node, at=()):
        yield at
        items = node.items() if isinstance(node, dict) else (
            enumerate(node) if isinstance(node, list) else ())
        for k, v in items:
            yield from paths(v, at + (k,))

    while count:
        data = copy.deepcopy(rng.choice(sources))
        at = rng.choice([p for p in paths(data) if p])
        parent = data
        for k in at[:-1]:
            parent = parent[k]
        key, value = at[-1], parent[at[-1]]
        edit = rng.choice(["number", "swap", "drop", "duplicate", "odd"])
        if edit == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[key] = rng.choice([value + 1, value - 1, -value, 2 * value, value + 0.5])
        elif edit == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = rng.randrange(len(parent))
            parent[key], parent[other] = parent[other], parent[key]
        elif edit == "drop":
            del parent[key]
        elif edit == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))
        elif edit == "odd":
            parent[key] = rng.choice(ODD_VALUES)
        else:
            continue
        count -= 1
        yield data


def test_fusion_keeps_what_edited_graphs_compute():
    """Any one edit of a graph's JSON verifies or raises a GraphError, and where the edited
    graph fuses, the fused graph's reference is the edited graph's: the fusion pass never
    merges heads that compute differently (it compared tables by their repr, which shows
    only their length, and fused heads with other table values into head 0's)."""
    outcomes = collections.Counter()
    x = np.random.default_rng(0).standard_normal((1, 9, 16)).astype(np.float32)
    for data in _tree_edits(seed=1, count=1000):
        try:
            g = Graph.from_json(json.dumps(data))
            mhagen.verify(g)
        except GraphError:
            outcomes["refused"] += 1
            continue
        fused = run_passes(g)
        outcomes["fused" if fused.fused else "not fused"] += 1
        if fused.fused:
            w = g.init_weights(0)
            np.testing.assert_allclose(fused.graph.reference(x, w), g.reference(x, w),
                                       rtol=0, atol=1e-12, err_msg=json.dumps(data)[:300])
    assert outcomes["fused"] > 50 and outcomes["not fused"] > 10 and outcomes["refused"] > 100, \
        outcomes
