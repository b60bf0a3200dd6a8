"""mhagen.from_torch and mhagen.torch.MultiheadAttention against torch's own modules
(nn.MultiheadAttention, nn.TransformerEncoderLayer): batch_first either way, cross-attention
from kdim == vdim, key padding masks (bool and float), causal masks, bias or none, float32
and bfloat16; the custom op kept as one node by torch.compile(fullgraph=True) and
torch.export; refusals, each with its reason."""
import gc

import numpy as np
import pytest

import mhagen
from mhagen import InputError
from mhagen.tolerances import assert_close

torch = pytest.importorskip("torch", reason="torch is a test dependency (pip install -e .[test])")
import mhagen.torch as mt  # noqa: E402 - after torch is known to be there


def torch_mha(embed_dim, heads, *, seed=0, **kwargs):
    """A torch module in eval mode with biases that count (torch starts them at zero)."""
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(embed_dim, heads, **kwargs).eval()
    with torch.no_grad():
        if m.in_proj_bias is not None:
            m.in_proj_bias.uniform_(-0.5, 0.5)
            m.out_proj.bias.uniform_(-0.5, 0.5)
    return m


def randn(*shape, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)
                            .astype(np.float32)).clone()


def close(got, expected, dtype="float32"):
    """got within the table's tolerance of torch's float32 answer (both float32: two
    roundings, well inside 1e-5 + 2e-5 * max for these sizes)."""
    assert_close(got.detach().float().numpy(), expected.detach().float().numpy(), dtype)


@pytest.fixture(scope="module")
def self_attn():
    """head_dim 40 (80 wide, 2 heads), key padding, any batch 1..2 and length 1..97: one
    build for every shape below."""
    m = torch_mha(80, 2, batch_first=True)
    drop = mt.MultiheadAttention(m, key_padding=True, batch=None, max_batch=2,
                                 seq_len=None, max_seq_len=97)
    return m, drop


@pytest.mark.parametrize("batch, seq", [(2, 97), (1, 1), (2, 13)])
@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_matches_torch(self_attn, batch, seq, batch_first):
    m, drop = self_attn
    wrapped = mt.MultiheadAttention(drop.module, batch_first=batch_first)
    x = randn(batch, seq, 80, seed=seq)
    given = x if batch_first else x.transpose(0, 1).contiguous()
    with torch.inference_mode():
        expected, _ = m(x, x, x, need_weights=False)
        got, weights = wrapped(given, given, given)
    assert weights is None
    assert got.shape == given.shape
    close(got if batch_first else got.transpose(0, 1), expected)


def test_key_padding_mask_bool_and_float(self_attn):
    m, drop = self_attn
    x = randn(2, 97, 80, seed=3)
    mask = torch.zeros(2, 97, dtype=torch.bool)
    mask[1, 40:] = True
    additive = torch.zeros(2, 97).masked_fill(mask, float("-inf"))
    with torch.inference_mode():
        expected, _ = m(x, x, x, key_padding_mask=mask, need_weights=False)
        for given in (mask, additive):
            got, _ = drop(x, x, x, key_padding_mask=given)
            close(got, expected)
        # the mask matters: without it row 1 differs
        assert (drop(x, x, x)[0][1] - expected[1]).abs().max() > 1e-2
    assert mhagen.kv_lens_from_mask(mask).tolist() == [97, 40]


def test_unbatched_input(self_attn):
    m, drop = self_attn
    x = randn(9, 80, seed=4)
    mask = torch.tensor([False] * 6 + [True] * 3)
    with torch.inference_mode():
        expected, _ = m(x, x, x, key_padding_mask=mask, need_weights=False)
        got, _ = drop(x, x, x, key_padding_mask=mask)
    assert got.shape == (9, 80)
    close(got, expected)


@pytest.fixture(scope="module")
def cross():
    """kdim == vdim = 48 != embed_dim 64: cross-attention, any context length 1..20."""
    m = torch_mha(64, 2, kdim=48, vdim=48, batch_first=True)
    return m, mt.MultiheadAttention(m, batch=2, seq_len=10, kv_seq_len=None,
                                    max_kv_seq_len=20)


@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_from_kdim(cross, batch_first):
    m, drop = cross
    assert drop.module.graph.context_input is not None and drop.kdim == 48
    wrapped = mt.MultiheadAttention(drop.module, batch_first=batch_first)
    for kv_seq in (20, 7):
        q, ctx = randn(2, 10, 64, seed=5), randn(2, kv_seq, 48, seed=6)
        with torch.inference_mode():
            expected, _ = m(q, ctx, ctx, need_weights=False)
            if not batch_first:
                q, ctx = q.transpose(0, 1), ctx.transpose(0, 1)
            got, _ = wrapped(q, ctx, ctx)
        close(got if batch_first else got.transpose(0, 1), expected)


@pytest.fixture(scope="module")
def causal():
    """No bias, batch_first=False, built causal=True by from_torch."""
    m = torch_mha(64, 4, bias=False, batch_first=False)
    return m, mhagen.from_torch(m, causal=True, batch=2, seq_len=16)


def test_from_torch_returns_the_compiled_module_in_mhagens_layout(causal):
    m, module = causal
    assert isinstance(module, mhagen.Module) and module.graph.options["bias"] is False
    x = randn(2, 16, 64, seed=8)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    with torch.inference_mode():     # torch's batch_first=False layout: [seq, batch, E]
        t = x.transpose(0, 1)
        expected, _ = m(t, t, t, attn_mask=mask, need_weights=False)
    close(module(x), expected.transpose(0, 1))     # mhagen's layout: [batch, seq, E]


def test_causal_layer_takes_is_causal_or_the_causal_mask(causal):
    m, module = causal
    drop = mt.MultiheadAttention(module, batch_first=True)
    x = randn(2, 16, 64, seed=7)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)   # float, -inf above
    with torch.inference_mode():
        t = x.transpose(0, 1)
        expected = m(t, t, t, attn_mask=mask, need_weights=False)[0].transpose(0, 1)
        for kwargs in ({"is_causal": True}, {"attn_mask": mask},
                       {"attn_mask": mask.isinf()}, {"attn_mask": mask, "is_causal": True}):
            close(drop(x, x, x, **kwargs)[0], expected)
        with pytest.raises(InputError, match="built causal=True: pass is_causal=True"):
            drop(x, x, x)
        window = mask.clone()
        window[5, 0] = float("-inf")
        with pytest.raises(InputError, match="attn_mask is not the causal mask .*mask=..."):
            drop(x, x, x, attn_mask=window)


@pytest.fixture(scope="module")
def encoder():
    """A TransformerEncoderLayer and the drop-in of its self_attn (key padding, [2, 11])."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 2, dim_feedforward=96, batch_first=True).eval()
    return layer, mt.MultiheadAttention(layer, key_padding=True, batch=2, seq_len=11)


def test_transformer_encoder_layer_with_the_drop_in_attention(encoder):
    """The drop-in replaces an encoder layer's self_attn: the layer's own forward (norms,
    feed-forward, the float key padding mask it makes of a bool one) matches torch's."""
    layer, drop = encoder
    x = randn(2, 11, 64, seed=9)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, 8:] = True
    with torch.inference_mode():
        expected = layer(x, src_key_padding_mask=mask)
        attention_only, _ = layer.self_attn(x, x, x, key_padding_mask=mask, need_weights=False)
    original = layer.self_attn
    layer.self_attn = drop
    try:
        with torch.inference_mode():
            got = layer(x, src_key_padding_mask=mask)
            close(drop(x, x, x, key_padding_mask=mask)[0], attention_only)
        close(got, expected)
    finally:
        layer.self_attn = original


def test_bfloat16_module_builds_a_bfloat16_layer():
    m = torch_mha(64, 2, batch_first=True).to(torch.bfloat16)
    drop = mt.MultiheadAttention(m, batch=2, seq_len=8)
    assert drop.module.graph.dtype == "bfloat16"
    x = randn(2, 8, 64, seed=10).to(torch.bfloat16)
    reference = torch_mha(64, 2, batch_first=True)
    reference.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    with torch.inference_mode():
        got, _ = drop(x, x, x)
        expected, _ = reference(x.float(), x.float(), x.float(), need_weights=False)
    assert got.dtype == torch.bfloat16
    close(got, expected, "bfloat16")


@pytest.fixture(scope="module")
def small(encoder):
    """(a torch nn.MultiheadAttention, its drop-in): the encoder layer's, [2, 11, 64]."""
    return encoder[0].self_attn, encoder[1]


def test_torch_compile_keeps_the_op_as_one_node(small):
    m, drop = small
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x):
        return drop(x, x, x)[0] * 2 + 1

    compiled = torch.compile(block, backend=record, fullgraph=True)
    x = randn(2, 11, 64, seed=11)
    with torch.inference_mode():
        got = compiled(x)
        expected = m(x, x, x, need_weights=False)[0] * 2 + 1
    close(got, expected)
    [gm] = graphs
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.mhagen.multihead_attention) == 1, gm.graph


def test_torch_export_keeps_the_op_as_one_node(small):
    m, drop = small

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = drop

        def forward(self, x):
            return self.attention(x, x, x)[0] + x

    x = randn(2, 11, 64, seed=12)
    exported = torch.export.export(Block(), (x,))
    ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.mhagen.multihead_attention.default) == 1, exported.graph
    with torch.inference_mode():
        expected = m(x, x, x, need_weights=False)[0] + x
        close(exported.module()(x), expected)


def test_the_op_passes_torchs_opcheck(small):
    """torch.library.opcheck: schema, fake implementation against the real one (shape,
    dtype), AOT dispatch; with a key padding mask, and a bfloat16 x (a float32 layer
    answers it in float32)."""
    m, drop = small
    x = randn(2, 11, 64, seed=15)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 7:] = True
    for args in ((x, None, mask, None, drop.handle),
                 (x.to(torch.bfloat16), None, None, None, drop.handle)):
        result = torch.library.opcheck(torch.ops.mhagen.multihead_attention.default, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_a_freed_module_handle_is_refused(small):
    drop = mt.MultiheadAttention(small[1].module)
    handle = drop.handle
    del drop
    gc.collect()
    with pytest.raises(InputError, match=f"no mhagen module has handle {handle}"):
        torch.ops.mhagen.multihead_attention(torch.zeros(2, 11, 64), None, None, None, handle)


def test_weights_from_torch_reads_kdim_projections():
    m = torch_mha(16, 2, kdim=8, vdim=8, batch_first=True)
    w = mhagen.weights_from_torch(m)
    assert w["w_k"].shape == (2, 8, 8) and w["w_q"].shape == (2, 16, 8)
    np.testing.assert_array_equal(w["w_k"][1], m.k_proj_weight.detach().numpy()[8:16].T)
    np.testing.assert_array_equal(w["w_v"][0], m.v_proj_weight.detach().numpy()[0:8].T)
    np.testing.assert_array_equal(w["w_q"][1], m.q_proj_weight.detach().numpy()[8:16].T)
    np.testing.assert_array_equal(w["b_k"][1], m.in_proj_bias.detach().numpy()[24:32])
    graph, same = mt.layer_from_torch(m)
    assert graph.options["cross"] and graph.options["kv_dim"] == 8
    assert all(np.array_equal(same[k], w[k]) for k in w)


@pytest.mark.parametrize("mask, lens", [
    ([[False, False, True], [False, False, False]], [2, 3]),
    (np.array([[0.0, float("-inf"), float("-inf")]]), [1]),
    (torch.ones(2, 4, dtype=torch.bool), [0, 0]),
])
def test_kv_lens_from_mask(mask, lens):
    got = mhagen.kv_lens_from_mask(mask)
    assert got.dtype == np.int32 and got.tolist() == lens


@pytest.mark.parametrize("mask, message", [
    ([[True, False, False]], "row 0 is not right padding: it ignores key 0 but sees key 2; "
                             ".*pad the sequences on the right"),
    ([[False, False], [False, True], [True, False]], "row 2 is not right padding"),
    ([False, True], r"must be \[batch, kv_seq\] .* got shape \(2,\)"),
    (np.array([[0.0, 1.0]]), "additive mask holding 1.0; mhagen ignores keys, it does not "
                             "weigh them"),
    (np.array([[0, 1]]), "holds integers"),
])
def test_kv_lens_from_mask_refusals(mask, message):
    with pytest.raises(InputError, match=message):
        mhagen.kv_lens_from_mask(mask)


def _partial_bias():
    m = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    m.out_proj.bias = None
    return m


@pytest.mark.parametrize("make, options, message", [
    (lambda: torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=12), {},
     "kdim=8 and vdim=12 differ: mhagen's cross-attention reads keys and values from one"),
    (lambda: torch.nn.MultiheadAttention(16, 2, add_bias_kv=True), {}, "add_bias_kv"),
    (lambda: torch.nn.MultiheadAttention(16, 2, add_zero_attn=True), {}, "add_zero_attn"),
    (lambda: torch.nn.TransformerDecoderLayer(16, 2), {},
     "pass the decoder layer's self_attn or its multihead_attn"),
    (lambda: torch.nn.Linear(16, 16), {}, "from_torch takes a torch.nn.MultiheadAttention"),
    (_partial_bias, {}, "bias on only some projections"),
    (lambda: torch.nn.MultiheadAttention(16, 2), {"num_heads": 4},
     "num_heads come from the torch module"),
    (lambda: torch.nn.MultiheadAttention(16, 2), {"weights": {}},
     "takes the weights from the module: drop weights="),
    (lambda: torch.nn.MultiheadAttention(16, 2), {"sequence_length": 4},
     r"unknown option\(s\) \['sequence_length'\]"),
    (lambda: torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=8), {"cross": False},
     "kdim=8 differs from embed_dim=16: it is a cross-attention layer"),
], ids=["kdim-vdim", "add_bias_kv", "add_zero_attn", "decoder-layer", "linear",
        "partial-bias", "fixed-option", "weights", "unknown-option", "cross-false"])
def test_from_torch_refusals(make, options, message):
    with pytest.raises(InputError, match=message):
        mhagen.from_torch(make(), batch=1, seq_len=4, **options)


def test_forward_refusals(small, causal):
    m, drop = small
    x = randn(2, 11, 64, seed=13)
    other = x.clone()
    mask = torch.tensor([[True] + [False] * 15] * 2)
    no_padding = mt.MultiheadAttention(causal[1])
    xc = randn(2, 16, 64, seed=13)
    with torch.inference_mode():
        for call, message in [
            (lambda: drop(x, x, x, need_weights=True), "need_weights=True: mhagen's fused "
                                                       "kernels never form"),
            (lambda: drop(x, other, other), "self-attention layer: pass the query tensor "
                                            "itself as key and value"),
            (lambda: drop(x, x, x, is_causal=True), "built without causal=True"),
            (lambda: no_padding(xc, xc, xc, key_padding_mask=mask, is_causal=True),
             "needs a layer built with key padding"),
            (lambda: drop(x, x, x, attn_mask=torch.ones(11, 11, dtype=torch.bool).triu(1)),
             "attn_mask is not the empty mask this layer was built with .causal=False."),
        ]:
            with pytest.raises(InputError, match=message):
                call()
    needs = x.clone().requires_grad_()
    with pytest.raises(InputError, match="mhagen is inference-only"):
        drop(needs, needs, needs)


def test_drop_in_refusals(self_attn, cross):
    m, drop = self_attn
    x = randn(1, 5, 80, seed=14)
    with torch.inference_mode():
        with pytest.raises(InputError, match="row 0 is not right padding"):
            drop(x, x, x, key_padding_mask=torch.tensor([[True, False, False, False, False]]))
        q, ctx = torch.zeros(2, 10, 64), torch.zeros(2, 3, 48)
        with pytest.raises(InputError, match="one context: pass the same tensor as key and "
                                             "value"):
            cross[1](q, ctx, ctx.clone())
    with pytest.raises(InputError, match="decoding layer .* takes a mhagen.KVCache"):
        mt.MultiheadAttention(torch_mha(16, 2), kv_cache=4, causal=True, batch=1, seq_len=1)
