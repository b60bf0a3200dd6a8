"""Fusion decisions (which graphs fuse, which fall back) and what the fused program is."""
import math

import numpy as np
import pytest

import mhagen
from mhagen.blockmask import FULL, PARTIAL, SKIP, block_table
from mhagen.lower import lower
from mhagen.passes import run_passes
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from tests.conftest import random_input

FUSING = {
    "plain": dict(d_model=64, num_heads=4),
    "causal-gqa": dict(d_model=64, num_heads=4, kv_heads=2, causal=True),
    "mqa-nobias-hd40": dict(d_model=80, num_heads=4, head_dim=40, kv_heads=1, bias=False),
    "sliding": dict(d_model=64, num_heads=2, mask=mhagen.sliding_window(3)),
}


@pytest.mark.parametrize("case", FUSING, ids=list(FUSING))
def test_standard_layers_fuse_and_keep_their_function(case):
    layer = mhagen.mha(**FUSING[case])
    result = run_passes(layer)
    assert result.fused, result.reason
    kinds = [n.kind for n in result.graph.nodes]
    assert kinds == ["input", "qkv_projection", "attention", "output_projection"]
    w = layer.init_weights(seed=3)
    x = random_input(layer, 2, 11).astype(np.float64)
    np.testing.assert_allclose(result.graph.reference(x, w), layer.reference(x, w), atol=1e-12)


def _two_heads(scales=(0.5, 0.5), masks=(None, None), mask_heads=(0, 1)):
    """A 2-head graph written node by node, with per-head scale and mask choices."""
    g = mhagen.Graph("custom")
    x = g.input("x", d_model=16)
    outs = []
    for h in range(2):
        q = g.head_projection(x, "w_q", h, 8)
        k = g.head_projection(x, "w_k", h, 8)
        v = g.head_projection(x, "w_v", h, 8)
        s = g.scores(q, k)
        if scales[h] is not None:
            s = g.scale(s, scales[h])
        if masks[h] is not None:
            s = g.mask(s, masks[h], head=mask_heads[h])
        outs.append(g.weighted_sum(g.softmax(s), v))
    g.set_output(g.output_projection(g.concat_heads(outs), "w_o", 16))
    return g


FALLBACKS = {
    "different-scales": (_two_heads(scales=(0.5, 0.25)), "different scales"),
    "one-head-unscaled": (_two_heads(scales=(0.5, None)), "different scales"),
    "different-masks": (_two_heads(masks=(mhagen.causal(), None)), "different masks"),
    "mask-head-mismatch": (_two_heads(masks=(mhagen.causal(), mhagen.causal()),
                                      mask_heads=(1, 0)), "is for head 1"),
}


@pytest.mark.parametrize("case", FALLBACKS, ids=list(FALLBACKS))
def test_unrecognised_graphs_fall_back_and_stay_correct(case):
    layer, why = FALLBACKS[case]
    result = run_passes(layer)
    assert not result.fused and why in result.reason
    w = layer.init_weights(seed=4)
    x = random_input(layer, 2, 10)
    module = mhagen.build(layer, batch=2, seq_len=10, weights=w)
    assert module.program.fusion.startswith("not fused")
    assert [k.name for k in module.program.kernels] == ["main"]
    assert_close(module(x), layer.reference(x, w))


def test_same_scale_two_heads_fuse():
    assert run_passes(_two_heads()).fused


def test_extra_nodes_block_fusion():
    layer = mhagen.mha(32, 2)
    layer.add("softmax", ("s0",), "dangling")  # a reader outside the pattern
    result = run_passes(layer)
    assert not result.fused and "more than one reader" in result.reason


def test_fused_program_never_builds_the_score_matrix():
    seq, heads = 2048, 8
    program = lower(mhagen.mha(512, heads, causal=True), 1, seq, resolve("x86"))
    assert [k.name for k in program.kernels] == ["qkv_projection", "attention",
                                                 "output_projection"]
    largest = max(math.prod(b.shape) for b in program.buffers.values())
    assert largest < heads * seq * seq / 8, "a buffer as large as the score matrix exists"
    for b in program.buffers.values():
        assert list(b.shape).count(seq) < 2, f"{b.name} {b.shape} looks like [S, S]"


def test_causal_block_table_skips_the_upper_half():
    table = block_table(mhagen.causal(), 1, 8, 1024, 64, 128)
    assert table.shape == (1, 1, 16, 8)          # no dependence on batch or head
    skipped = (table == SKIP).mean()
    assert 0.40 < skipped < 0.5
    assert (table[0, 0, :, 0] != SKIP).all()     # every query sees key block 0
    assert table[0, 0, 15, 7] == PARTIAL and table[0, 0, 15, 0] == FULL


def test_block_table_marks_the_padded_last_block_partial():
    table = block_table(None, 1, 1, 200, 64, 128)
    assert (table[..., 0] == FULL).all() and (table[..., 1] == PARTIAL).all()


def test_head_dependent_mask_gets_a_table_per_head():
    mask = (mhagen.kv_idx <= mhagen.q_idx) | (mhagen.ir.head > 0)
    table = block_table(mask, 2, 4, 256, 64, 64)
    assert table.shape == (1, 4, 4, 4)
    assert (table[0, 1:] == FULL).all() and (table[0, 0] == SKIP).sum() == 6


# -- graphs that hold the fused kinds (the fusion pass's output, saved and loaded) ------------
SAVED_FUSED = {
    "gqa-hd40-rotary": dict(d_model=80, num_heads=4, head_dim=40, kv_heads=2, rotary=True),
    "padding-causal": dict(d_model=32, num_heads=2, key_padding=True, causal=True),
    "cross-alibi": dict(d_model=32, num_heads=2, cross=True, score_mod=mhagen.alibi(2)),
}


def _saved_fused(layer):
    return mhagen.Graph.from_json(run_passes(layer).graph.to_json())


@pytest.mark.parametrize("fuse", [True, False], ids=["fuse", "unfused"])
@pytest.mark.parametrize("case", SAVED_FUSED, ids=list(SAVED_FUSED))
def test_a_saved_fused_graph_builds_and_computes_its_function(case, fuse):
    """lower() expands the fused kinds into the builder form (ir/unfuse.py): the fusion
    pass then fuses it again, or fuse=False compiles it node by node."""
    layer = mhagen.mha(**SAVED_FUSED[case])
    saved = _saved_fused(layer)
    assert {"qkv_projection", "attention"} <= {n.kind for n in saved.nodes}
    w = layer.init_weights(seed=5)
    x = random_input(layer, 2, 97)
    kw, call = {}, {}
    if layer.context_input is not None:
        kw["kv_seq_len"] = 13
        call["context"] = np.random.default_rng(1).standard_normal((2, 13, 32)).astype(
            np.float32)
    if layer.lengths_input is not None:
        call["kv_lens"] = np.array([97, 40], np.int32)
    module = mhagen.build(saved, batch=2, seq_len=97, weights=w, fuse=fuse, **kw)
    names = [k.name for k in module.program.kernels]
    if fuse:
        assert module.program.fusion.startswith("fused") and "attention" in names
    else:
        assert names == ["main"]
    assert_close(module(x, **call), saved.reference(x, w, **call))
    if fuse and layer.context_input is None:   # maps from its head-by-head form
        lens = {"kv_lens": call["kv_lens"]} if "kv_lens" in call else {}
        own = mhagen.build(layer, batch=2, seq_len=97, weights=w)
        np.testing.assert_array_equal(module.attention_maps(x, **lens),
                                      own.attention_maps(x, **lens))


@pytest.mark.parametrize("options", [dict(causal=True), dict(kv_heads=2, kv_cache=20),
                                     dict(cross=True), dict(rotary=True, key_padding=True)],
                         ids=["causal", "gqa-decoding", "cross", "rotary-padding"])
def test_a_saved_fused_graph_counts_the_flops_of_its_layer(options):
    """GFLOP/s reports (Module.flops, the CLI) of a graph holding the fused kinds."""
    from mhagen.cost import graph_flops
    layer = mhagen.mha(64, 4, **options)
    dims = layer.dims(2, 9, 5)
    assert graph_flops(_saved_fused(layer), **dims) == graph_flops(layer, **dims) > 0


def test_a_saved_fused_decoding_layer_builds_and_fills_its_cache():
    layer = mhagen.mha(32, 4, kv_heads=2, kv_cache=16, rotary=True, cache_dtype="bfloat16")
    w = layer.init_weights(seed=6)
    module = mhagen.build(_saved_fused(layer), batch=2, seq_len=3, weights=w)
    assert module.program.fusion.startswith("fused")
    cache = module.new_cache()
    cache.lens[...] = [0, 9]
    expected = cache.copy()
    x = random_input(layer, 2, 3)
    assert_close(module(x, cache=cache), layer.reference(x, w, cache=expected), "bfloat16")
    assert_close(cache.k, expected.k, "bfloat16")
    assert cache.lens.tolist() == expected.lens.tolist() == [3, 12]


def _edit_attention(layer, **attrs):
    g = _saved_fused(layer)
    next(n for n in g.nodes if n.kind == "attention").attrs.update(attrs)
    return g


@pytest.mark.parametrize("graph, fragments", [
    (_edit_attention(mhagen.mha(16, 2), q_offsets=[1, 8]),
     ["the Q of head 0", "columns 1..8 of 'qkv'", "start a segment"]),
    (_edit_attention(mhagen.mha(16, 2, causal=True), head_dim=4),
     ["the Q of head 0", "head_dim 4"]),
    (_edit_attention(mhagen.mha(16, 2, key_padding=True, causal=True), mask=None),
     ["reads 'kv_lens' but has no mask", "kv_idx < kv_len"]),
], ids=["offset-inside-a-segment", "head_dim-not-the-segment-width", "lengths-without-mask"])
def test_a_fused_graph_the_kernels_cannot_lay_out_is_refused(graph, fragments):
    mhagen.verify(graph)     # a valid graph (the reference computes it) ...
    with pytest.raises(mhagen.GraphError) as info:
        mhagen.build(graph, batch=1, seq_len=4)    # ... that does not compile, and says why
    for fragment in fragments:
        assert fragment in str(info.value)


def test_nodes_the_output_does_not_read_and_a_zero_scale_build():
    """TVM drops the stages nothing reads (a head left out of the concat; scores times 0,
    which it folds): the schedule skips them."""
    g = mhagen.Graph("dead")
    x = g.input("x", d_model=16)
    outs = []
    for h, factor in enumerate((0.0, 0.5)):
        q, k, v = (g.head_projection(x, f"w_{r}", h, 8) for r in "qkv")
        outs.append(g.weighted_sum(g.softmax(g.scale(g.scores(q, k), factor)), v))
    g.set_output(g.output_projection(g.concat_heads(outs[:1]), "w_o", 16))
    assert not run_passes(g).fused
    w = g.init_weights(seed=7)
    x = random_input(g, 2, 9)
    assert_close(mhagen.build(g, batch=2, seq_len=9, weights=w)(x), g.reference(x, w))
