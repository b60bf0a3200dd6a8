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
