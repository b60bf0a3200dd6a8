"""Packed variable-length calls (module(x, cu_seqlens=...)): the tokens of several sequences
one after the other, each attending as if alone. Checked against the float64 reference of
the packed call and against each sequence's own call of the same module (bit for bit: the
GEMMs' rows and the attention's tiles are each sequence's own), for lengths 0, 1, block
edges and the maximum; cross-attention with cu_seqlens_k; masks, score modifiers and RoPE
per sequence; bad offsets refused before anything is written."""
import numpy as np
import pytest

import mhagen
from mhagen.packed import tile_table, token_positions
from mhagen.tolerances import assert_close

D = 64
MAX_SEQ, MAX_BATCH = 97, 3


def _build(layer, target="x86", **kw):
    w = layer.init_weights(seed=1)
    options = dict(batch=None, max_batch=MAX_BATCH, seq_len=None, max_seq_len=MAX_SEQ,
                   tuning=None, weights=w)
    options.update(kw)
    return mhagen.build(layer, target, **options), w


def _packed(lens, width=D, seed=0):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = np.random.default_rng(seed).standard_normal((1, int(cu[-1]), width)).astype(np.float32)
    return x, cu


def _alone(module, x, cu, extra=lambda a, b: {}):
    """Each non-empty sequence through the module's own padded call (extra(a, b): its other
    arguments), side by side."""
    outs = [module(x[:, a:b], **extra(a, b)) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    return np.concatenate(outs, axis=1)


@pytest.fixture(scope="module")
def causal():
    """Causal grouped K/V heads with RoPE and ALiBi: every per-position feature at once."""
    layer = mhagen.mha(D, 4, kv_heads=2, causal=True, rotary=True, score_mod=mhagen.alibi(4))
    return layer, *_build(layer)


# lengths 0 and 1, the query tile's edges (32: the default tile here), the maximum
LENGTHS = {
    "ragged": [0, 1, 97, 31, 32, 33, 1, 0],
    "maximum": [MAX_SEQ] * MAX_BATCH,
    "one": [5],
    "empty-ends": [0, 64, 0],
}


@pytest.mark.parametrize("lens", LENGTHS.values(), ids=LENGTHS.keys())
def test_packed_equals_each_sequence_alone(causal, lens):
    layer, module, w = causal
    assert [k.name for k in module.program.packed] == [
        "qkv_projection", "rotary_varlen", "attention_varlen", "output_projection"]
    x, cu = _packed(lens, seed=len(lens))
    y = module(x, cu_seqlens=cu)
    assert y.shape == x.shape
    assert_close(y, layer.reference(x, w, cu_seqlens=cu))
    np.testing.assert_array_equal(y, _alone(module, x, cu))


def test_packed_on_the_avx2_class():
    """The AVX2 class's tiles (6-key S^T tiles, query tiles of 16 or 32): the same."""
    layer = mhagen.mha(D, 4, kv_heads=2, causal=True, rotary=True, score_mod=mhagen.alibi(4))
    module, w = _build(layer, target="x86-avx2")
    x, cu = _packed(LENGTHS["ragged"], seed=2)
    y = module(x, cu_seqlens=cu)
    assert_close(y, layer.reference(x, w, cu_seqlens=cu))
    np.testing.assert_array_equal(y, _alone(module, x, cu))


def test_the_tile_table_never_crosses_a_sequence():
    """Each sequence's query tiles, in the padded kernel's order (0, n-1, 1, ...), keys its
    own; positions count from each sequence's start."""
    cu = np.array([0, 3, 3, 70, 71])
    table = tile_table(cu, cu, 32)
    assert table.tolist() == [[0, 3, 0, 3, 0],
                              [3, 67, 3, 67, 0], [3, 67, 3, 67, 2], [3, 67, 3, 67, 1],
                              [70, 1, 70, 1, 0]]
    assert token_positions(cu).tolist() == [0, 1, 2, *range(67), 0]
    assert tile_table([0, 0], [0, 0], 32).shape == (0, 5)


def test_no_tokens_at_all(causal):
    layer, module, w = causal
    x, cu = _packed([0, 0])
    out = np.full((1, 0, D), 7, np.float32)
    assert module(x, cu_seqlens=cu, out=out) is out
    assert layer.reference(x, w, cu_seqlens=cu).shape == (1, 0, D)


@pytest.mark.parametrize("kind", ["window-key-padding", "bfloat16"])
def test_masks_padding_layers_and_half_precision_per_sequence(kind):
    """A sliding window counts from each sequence's start and a key-padding layer's kv_len
    is each sequence's own length (a packed call has no padding); a bfloat16 layer."""
    layer = {"window-key-padding": mhagen.mha(D, 2, key_padding=True,
                                              mask=mhagen.sliding_window(8)),
             "bfloat16": mhagen.mha(D, 2, causal=True, dtype="bfloat16")}[kind]
    module, w = _build(layer, max_seq_len=64)
    x, cu = _packed([17, 0, 64, 1, 40], seed=3)
    y = module(x, cu_seqlens=cu)
    assert_close(y, layer.reference(x, w, cu_seqlens=cu), layer.dtype)
    lens = (lambda a, b: {"kv_lens": [b - a]}) if kind != "bfloat16" else (lambda a, b: {})
    np.testing.assert_array_equal(y, _alone(module, x, cu, lens))


def test_cross_attention_with_cu_seqlens_k():
    """Queries of sequence i attend to its own context rows cu_seqlens_k[i]:[i+1]; an empty
    sequence may have context rows, context lengths up to the build's."""
    layer = mhagen.mha(D, 4, kv_heads=2, cross=True, kv_dim=48)
    module, w = _build(layer, max_seq_len=48, kv_seq_len=None, max_kv_seq_len=40)
    x, cu = _packed([5, 0, 48, 1], seed=4)
    context, cu_k = _packed([3, 9, 40, 1], width=48, seed=5)
    y = module(x, cu_seqlens=cu, context=context, cu_seqlens_k=cu_k)
    assert_close(y, layer.reference(x, w, cu_seqlens=cu, context=context, cu_seqlens_k=cu_k))
    alone = [module(x[:, a:b], context=context[:, c:e])
             for a, b, c, e in zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:]) if b > a]
    np.testing.assert_array_equal(y, np.concatenate(alone, axis=1))
    with pytest.raises(mhagen.InputError, match="sequence 1 has queries but no context"):
        module(x[:, :6], cu_seqlens=[0, 5, 6], context=context[:, :3],
               cu_seqlens_k=[0, 3, 3])
    with pytest.raises(mhagen.InputError, match="takes context= .* and cu_seqlens_k="):
        module(x, cu_seqlens=cu, context=context)
    with pytest.raises(mhagen.InputError, match="sequence 2 .* 41 context rows"):
        module(x, cu_seqlens=cu, context=np.zeros((1, 54, 48), np.float32),
               cu_seqlens_k=[0, 3, 9, 50, 54])


BAD = [
    ({"cu_seqlens": [0, 40, 30, 97]}, "must never decrease: entry 2 \\(30\\)"),
    ({"cu_seqlens": [0, 40, 96]}, "must start at 0 and end at 97"),
    ({"cu_seqlens": [1, 40, 97]}, "must start at 0"),
    ({"cu_seqlens": [[0, 97]]}, "1-D list of offsets"),
    ({"cu_seqlens": [0.5, 97]}, "cu_seqlens"),
    ({"cu_seqlens": [0, 97], "kv_lens": [97]}, "has no padding"),
    ({"cu_seqlens": [0, 97], "cu_seqlens_k": [0, 97]}, "self-attention sequence attends"),
    ({"cu_seqlens_k": [0, 97]}, "goes with cu_seqlens"),
]


@pytest.mark.parametrize("kw,match", BAD)
def test_bad_offsets_are_refused_before_anything_is_written(causal, kw, match):
    layer, module, w = causal
    x, _ = _packed([97])
    out = np.full((1, 97, D), 7, np.float32)
    with pytest.raises(mhagen.InputError, match=match):
        module(x, out=out, **kw)
    assert (out == 7).all()
    if "cu_seqlens" in kw:    # the reference refuses the same
        with pytest.raises(mhagen.InputError, match=match):
            layer.reference(x, w, **kw)


def test_sizes_beyond_the_build_are_refused(causal):
    """Each sequence at most max_seq_len, all at most max_batch x max_seq_len tokens;
    x [1, total, d_model]."""
    layer, module, w = causal
    x, cu = _packed([98])
    with pytest.raises(mhagen.InputError, match="sequence 0 .* 98 tokens .* max_seq_len=98"):
        module(x, cu_seqlens=cu)
    x, cu = _packed([97, 97, 97, 1])
    with pytest.raises(mhagen.InputError, match="holds 292 tokens; this module packs at most "
                                                "291"):
        module(x, cu_seqlens=cu)
    with pytest.raises(mhagen.InputError, match=r"x is \[1, total_tokens, 64\]"):
        module(np.zeros((2, 5, D), np.float32), cu_seqlens=[0, 5])


def test_layers_and_builds_that_take_no_packed_calls():
    plain = mhagen.mha(D, 2)
    exact = mhagen.build(plain, "x86", batch=1, seq_len=8, tuning=None,
                         weights=plain.init_weights(0))
    assert exact.program.packed is None
    with pytest.raises(mhagen.InputError, match="built for any length.*seq_len=None"):
        exact(np.zeros((1, 8, D), np.float32), cu_seqlens=[0, 3, 8])
    per_batch = mhagen.mha(D, 2, mask=mhagen.kv_idx <= mhagen.q_idx + mhagen.batch)
    with pytest.raises(mhagen.InputError, match="reads `batch`"):
        per_batch.reference(np.zeros((1, 8, D)), per_batch.init_weights(0), cu_seqlens=[0, 8])
    # a decoding layer's cu_seqlens are its cache rows' new tokens (test_decode_varlen.py):
    # not a packed prefill call, so a cache is needed and cu_seqlens_k is refused
    step = mhagen.mha(D, 2, kv_cache=16)
    with pytest.raises(mhagen.InputError, match="KVCache or PagedKVCache"):
        step.reference(np.zeros((1, 8, D)), step.init_weights(0), cu_seqlens=[0, 8])
    with pytest.raises(mhagen.InputError, match="cu_seqlens_k= is a packed cross-attention"):
        step.reference(np.zeros((1, 8, D)), step.init_weights(0), cu_seqlens=[0, 8],
                       cu_seqlens_k=[0, 8])



def test_torch_x_of_a_packed_call_is_answered_with_a_tensor(causal):
    """A torch x (and torch offsets) gets a torch answer, the numpy call's numbers; out= a
    tensor is written in place and returned; an all-empty call answers a [1, 0, d] tensor."""
    torch = pytest.importorskip("torch")
    layer, module, w = causal
    x, cu = _packed(LENGTHS["ragged"], seed=11)
    expected = module(x, cu_seqlens=cu)
    y = module(torch.from_numpy(x.copy()), cu_seqlens=torch.from_numpy(cu))
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.numpy(), expected)
    out = torch.zeros(expected.shape)
    assert module(torch.from_numpy(x), cu_seqlens=cu, out=out) is out
    np.testing.assert_array_equal(out.numpy(), expected)
    empty = module(torch.zeros(1, 0, D), cu_seqlens=[0, 0])
    assert isinstance(empty, torch.Tensor) and tuple(empty.shape) == (1, 0, D)


def test_decoding_arguments_are_refused_on_a_prefill_module(causal):
    """seqs= (a paged cache's sequences) and prepare(cu_seqlens=) belong to decoding
    modules: refused here, saying so."""
    layer, module, w = causal
    x, cu = _packed([3, 4], seed=2)
    with pytest.raises(mhagen.InputError, match="seqs= names the sequences of a paged"):
        module(x, cu_seqlens=cu, seqs=[0])
    with pytest.raises(mhagen.InputError, match=r"prepare\(\) takes cu_seqlens="):
        module.prepare(mhagen.aligned_empty(x.shape, "float32"), cu_seqlens=cu)

def test_saved_and_loaded_modules_keep_packed_calls(causal, tmp_path):
    layer, module, w = causal
    loaded = mhagen.load(module.save(tmp_path / "packed", c_api=False))
    assert [k.name for k in loaded.program.packed] == [k.name for k in module.program.packed]
    x, cu = _packed(LENGTHS["ragged"], seed=9)
    np.testing.assert_array_equal(loaded(x, cu_seqlens=cu), module(x, cu_seqlens=cu))


def test_the_packed_attention_takes_tuned_configs(tmp_path):
    """mhagen.tune(..., kernels=["attention_varlen"]) sweeps the packed calls' attention on
    a packed call of the shape's sequences and records it under the any-length build's
    maximum shape; a build of that maximum uses a record's config (query tiles of its own,
    then with a block table of its own) and stays right."""
    from mhagen.tuning import Database
    layer = mhagen.mha(D, 4, causal=True)
    report = mhagen.tune(layer, shapes=[(2, 32)], trials=2, kernels=["attention_varlen"],
                         database=tmp_path / "db.json", progress=False)
    (res,) = report.results
    assert (res.kernel, res.method, res.trials) == ("attention_varlen", "config sweep", 2)
    (record,) = Database.load(tmp_path / "db.json").records.values()
    assert (record["key"]["kernel"], record["key"]["batch"], record["key"]["seq"]) == (
        "attention_varlen", 2, 32)
    other = {**record["default_config"], "q_tile": 64, "kv_block": 64}
    Database(tmp_path / "forced.json", [{**record, "kind": "config", "config": other}]).save()
    module, w = _build(layer, max_batch=2, max_seq_len=32, tuning=str(tmp_path / "forced.json"))
    (decision,) = [d for d in module.decisions if d["kernel"] == "attention_varlen"]
    assert (decision["source"], decision["config"]) == ("tuned", other)
    assert module.program.packed_q_tile == 64 and "blocks_varlen" in module.program.buffers
    x, cu = _packed([5, 0, 32, 27], seed=11)
    y = module(x, cu_seqlens=cu)
    assert_close(y, layer.reference(x, w, cu_seqlens=cu))
    np.testing.assert_array_equal(y, _alone(module, x, cu))
