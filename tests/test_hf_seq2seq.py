"""mhagen.hf.optimize on the encoder and encoder-decoder families (mhagen/hf/seq2seq.py):
BERT, RoBERTa, T5, BART and Whisper from tiny random configs, against the same models on
Hugging Face's own modules: every replaced layer alone, whole-model outputs (right-padded
encoder batches), generate() greedy and sampled, and the refusals.

Every model has d_model 64, 4 heads and max_seq_len 32, so the BERT, RoBERTa, BART and
Whisper encoders share one compiled program, BART's and Whisper's decoders and
cross-attention layers another each (mhagen.hf.fused.SHARED_BUILDS): six builds in all."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="a test dependency")

import mhagen  # noqa: E402
import mhagen.hf  # noqa: E402
from mhagen.errors import InputError  # noqa: E402

D, H, VOCAB, MAX_LEN = 64, 4, 128, 32
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on one torch thread: its OpenMP workers spin for cores that TVM's pool
    (mhagen's kernels) and other processes hold, and made HF's own generate() 10-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _scaled(model):
    """Weights large enough that attention is far from uniform and tokens vary (the
    configs' 0.02 initialisation makes every layer nearly an average)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name or "shared" in name else 0.5)
    return model.eval()


def _pair(model):
    """(the model on Hugging Face's modules, an optimized copy of it, the report)."""
    optimized = copy.deepcopy(model)
    report = mhagen.hf.optimize(optimized, max_seq_len=MAX_LEN, batch=None)
    return model, optimized, report


def _close(actual, expected, what):
    """Within ATOL of Hugging Face's answer, relative to its magnitude where that exceeds 1
    (logits of the scaled models reach ~40)."""
    err = (actual - expected).abs().max().item()
    bound = ATOL * max(1.0, expected.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _padded_ids(batch=2, seq=11, lengths=(11, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=2,
                                     intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=64)
    return _pair(_scaled(transformers.BertForMaskedLM(config)))


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(1)
    config = transformers.T5Config(d_model=D, d_kv=16, num_heads=H, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, vocab_size=VOCAB,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _pair(_scaled(transformers.T5ForConditionalGeneration(config)))


@pytest.fixture(scope="module")
def bart():
    torch.manual_seed(2)
    config = transformers.BartConfig(d_model=D, encoder_attention_heads=H,
                                     decoder_attention_heads=H, encoder_layers=2,
                                     decoder_layers=2, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, vocab_size=VOCAB,
                                     max_position_embeddings=64)
    return _pair(_scaled(transformers.BartForConditionalGeneration(config)))


@pytest.fixture(scope="module")
def whisper():
    torch.manual_seed(3)
    config = transformers.WhisperConfig(d_model=D, encoder_attention_heads=H,
                                        decoder_attention_heads=H, encoder_layers=2,
                                        decoder_layers=2, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, vocab_size=VOCAB, num_mel_bins=8,
                                        max_source_positions=MAX_LEN,
                                        max_target_positions=MAX_LEN, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1)
    return _pair(_scaled(transformers.WhisperForConditionalGeneration(config)))


def _features(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, 2 * MAX_LEN, generator=g)      # [batch, mel bins, frames]


# -- every replaced layer alone, against the module it replaced ----------------------------

def _layer_pairs(pair):
    model, optimized, _ = pair
    fused = dict(optimized.named_modules())
    return [(path, module, fused[path]) for path, module in model.named_modules()
            if isinstance(fused.get(path), mhagen.hf.fused.FusedAttention)]


def _padding_mask(lengths, q_len, kv_len):
    seen = torch.arange(kv_len)[None, :] < torch.tensor(lengths)[:, None]
    return seen[:, None, None, :].expand(len(lengths), 1, q_len, kv_len)


@pytest.mark.parametrize("family", ["bert", "t5", "bart", "whisper"])
def test_every_replaced_layer_matches_the_module_it_replaced(family, request):
    """Encoder layers on a right-padded batch (lengths 11 and 6, the mask as the models pass
    it), decoder self-attention on 7 causal tokens, cross-attention over an 11-long padded
    encoder output: each fused layer alone gives the replaced module's answer."""
    pairs = _layer_pairs(request.getfixturevalue(family))
    g = torch.Generator().manual_seed(7)
    x, enc = torch.randn(2, 7, D, generator=g), torch.randn(2, 11, D, generator=g)
    lengths = [11, 6]
    modules = dict(request.getfixturevalue(family)[0].named_modules())
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))[None, None].expand(2, 1, 7, 7)
    roles = set()
    for path, theirs, ours in pairs:
        role = mhagen.hf.seq2seq.plan_role(ours.plan)
        roles.add(role)
        if family == "bert":
            args = dict(hidden_states=enc, attention_mask=_padding_mask(lengths, 11, 11))
        elif role == "encoder":
            mask = _padding_mask(lengths, 11, 11)
            args = dict(hidden_states=enc, **({"mask": mask} if family == "t5"
                                               else {"attention_mask": mask}))
        elif role == "decoder":
            args = dict(hidden_states=x, **({"mask": causal} if family == "t5"
                                             else {"attention_mask": causal}))
        else:
            mask = _padding_mask(lengths, 7, 11)
            args = dict(hidden_states=x, key_value_states=enc,
                        **({"mask": mask} if family == "t5" else {"attention_mask": mask}))
        if family == "t5" and role != "cross" and not theirs.has_relative_attention_bias:
            # T5Stack hands later layers the first layer's bias
            parts = path.split(".")           # encoder.block.<i>.layer.0.SelfAttention
            first = modules[".".join(parts[:2] + ["0"] + parts[3:])]
            length = args["hidden_states"].shape[1]
            args["position_bias"] = first.compute_bias(length, length)
        with torch.no_grad():
            expected, got = theirs(**args)[0], ours(**args)[0]
        assert got.shape == expected.shape
        _close(got, expected, path)
    assert roles == ({"encoder"} if family == "bert" else {"encoder", "decoder", "cross"})


# -- whole models ---------------------------------------------------------------------------

def test_bert_masked_lm_matches_hf_on_a_right_padded_batch(bert):
    model, optimized, report = bert
    assert [cls for _, cls, family, _ in report.replaced] == ["BertAttention"] * 2
    ids, mask = _padded_ids()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_hidden_states=True)
        got = optimized(ids, attention_mask=mask, output_hidden_states=True)
        unpadded = optimized(ids[:1], attention_mask=mask[:1]).logits
    _close(got.hidden_states[-1], expected.hidden_states[-1], "last hidden state")
    _close(got.logits, expected.logits, "logits")
    _close(unpadded, expected.logits[:1], "batch 1, no padding")


def test_roberta_model_matches_hf(bert):
    """RobertaModel, on the program BERT's encoder layers compiled (same widths, another
    model: no build)."""
    ids, mask = _padded_ids(seed=1)
    with torch.no_grad():
        bert[1](ids, attention_mask=mask)      # BERT's encoder program for batch 2
    torch.manual_seed(4)
    config = transformers.RobertaConfig(hidden_size=D, num_attention_heads=H,
                                        num_hidden_layers=2, intermediate_size=128,
                                        vocab_size=VOCAB, max_position_embeddings=64)
    model, optimized, report = _pair(_scaled(transformers.RobertaModel(config)))
    assert {cls for _, cls, _, _ in report.replaced} == {"RobertaAttention"}
    with torch.no_grad():
        _close(optimized(ids, attention_mask=mask).last_hidden_state,
               model(ids, attention_mask=mask).last_hidden_state, "last hidden state")
    assert report.state.builds.log == []


def test_t5_forward_matches_hf(t5):
    model, optimized, report = t5
    assert len(report.replaced) == 6      # 2 encoder, 2 decoder self, 2 cross
    ids, mask = _padded_ids(seed=2)
    decoder_ids = ids[:, :5]
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        got = optimized(ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        no_cache = optimized(ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                             use_cache=False)
    _close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, "encoder")
    _close(got.logits, expected.logits, "logits")
    _close(no_cache.logits, expected.logits, "logits without a cache")


def test_bart_forward_matches_hf(bart):
    model, optimized, _ = bart
    ids, mask = _padded_ids(seed=3)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :6])
        got = optimized(ids, attention_mask=mask, decoder_input_ids=ids[:, :6])
    _close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, "encoder")
    _close(got.logits, expected.logits, "logits")


def test_bart_step_by_step_with_the_returned_cache(bart):
    """A loop of model calls passing the returned cache back (no generate()): the cache
    is an EncoderDecoderCache (the MhagenCache, and the cross-attention K/V projected on the
    first call only); each step's logits are HF's for the whole sequence."""
    model, optimized, _ = bart
    ids, mask = _padded_ids(seed=6)
    cross = [m for m in optimized.modules()
             if isinstance(m, mhagen.hf.fused.FusedAttention) and m.plan.context_cache]
    projected = []
    handles = [m.k_proj.register_forward_hook(lambda *_: projected.append(1)) for m in cross]
    try:
        with torch.no_grad():
            expected = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :4]).logits
            out = optimized(ids, attention_mask=mask, decoder_input_ids=ids[:, :2])
            assert isinstance(out.cache, transformers.EncoderDecoderCache)
            steps = [out.logits]
            for t in (2, 3):
                out = optimized(attention_mask=mask, decoder_input_ids=ids[:, t:t + 1],
                                encoder_outputs=(out.encoder_last_hidden_state,),
                                cache=out.cache)
                steps.append(out.logits)
    finally:
        for handle in handles:
            handle.remove()
    assert len(projected) == len(cross)       # once per layer, on the first call
    _close(torch.cat(steps, dim=1), expected, "logits step by step")


def test_whisper_forward_matches_hf(whisper):
    model, optimized, _ = whisper
    features, decoder_ids = _features(), torch.randint(3, VOCAB, (2, 5))
    with torch.no_grad():
        expected = model(features, decoder_input_ids=decoder_ids)
        got = optimized(features, decoder_input_ids=decoder_ids)
    _close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, "encoder")
    _close(got.logits, expected.logits, "logits")


def _inputs(family):
    if family == "whisper":
        return dict(input_features=_features(1))
    ids, mask = _padded_ids(seq=9, lengths=(9, 5), seed=4)
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_generate_gives_hf_tokens_greedy_and_sampled(family, request):
    """Greedy and sampled (seeds 0 and 1) generation of 8 tokens from a padded batch (Whisper:
    random features): the same tokens as Hugging Face; the cross-attention K/V projected
    once per generate() (the first decoder call), not once per token."""
    model, optimized, _ = request.getfixturevalue(family)
    inputs = _inputs(family)
    options = dict(max_new_tokens=8, min_new_tokens=8)
    cross = next(m for m in optimized.modules()
                 if isinstance(m, mhagen.hf.fused.FusedAttention) and m.plan.context_cache)
    projected = []
    handle = cross.k_proj.register_forward_hook(lambda *_: projected.append(1))
    try:
        got = optimized.generate(**inputs, do_sample=False, **options)
        assert len(projected) == 1
        assert got.tolist() == model.generate(**inputs, do_sample=False, **options).tolist()
    finally:
        handle.remove()
    assert len(set(got[:, -8:].flatten().tolist())) > 2      # the tokens vary
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = model.generate(**inputs, do_sample=True, **options)
        torch.manual_seed(seed)
        assert optimized.generate(**inputs, do_sample=True, **options).tolist() == \
            expected.tolist()


@pytest.mark.slow
def test_bart_beam_search_gives_hf_tokens(bart):
    """Beam search reorders the self- and cross-attention caches (batch 2 x 2 beams: the
    decoder and cross layers compile for batch 4)."""
    model, optimized, _ = bart
    inputs = _inputs("bart")
    options = dict(max_new_tokens=6, num_beams=2, num_return_sequences=2)
    assert optimized.generate(**inputs, **options).tolist() == \
        model.generate(**inputs, **options).tolist()


# -- refusals ---------------------------------------------------------------------------------

def test_left_padding_into_an_encoder_is_refused(bert):
    _, optimized, _ = bert
    ids, mask = _padded_ids()
    with pytest.raises(InputError, match="right-padded batches.*padding_side = 'right'"):
        optimized(ids, attention_mask=mask.flip(1))


def test_padded_decoder_rows_are_refused(t5):
    _, optimized, _ = t5
    ids, mask = _padded_ids(seed=5)
    decoder_mask = torch.ones(2, 4, dtype=torch.long)
    decoder_mask[1, 3] = 0
    with pytest.raises(InputError, match="unpadded decoder rows"):
        optimized(ids, attention_mask=mask, decoder_input_ids=ids[:, :4],
                  decoder_attention_mask=decoder_mask)


def test_inputs_longer_than_max_seq_len_are_refused(bart):
    _, optimized, _ = bart
    ids = torch.randint(3, VOCAB, (2, MAX_LEN + 3))
    with pytest.raises(InputError, match=f"{MAX_LEN + 3} positions.*max_seq_len>="):
        optimized(ids, decoder_input_ids=ids[:, :2])


def test_unsupported_variants_are_refused_by_name_and_nothing_changes():
    """A BERT decoder (causal self-attention, cross-attention) and a T5 whose
    relative_attention_max_distance lies within its exact buckets: refused, naming the module
    and the reason; the model keeps its torch modules."""
    config = transformers.BertConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=1,
                                     intermediate_size=128, vocab_size=VOCAB, is_decoder=True,
                                     add_cross_attention=True)
    model = transformers.BertModel(config).eval()
    with pytest.raises(InputError, match="encoder.layer.0.attention: BertAttention: bert: "
                                         "BERT as a decoder"):
        mhagen.hf.optimize(model, max_seq_len=MAX_LEN, batch=None)
    assert type(model.encoder.layer[0].attention).__name__ == "BertAttention"
    config = transformers.T5Config(d_model=D, d_kv=16, num_heads=H, d_ff=128, num_layers=1,
                                   vocab_size=VOCAB, relative_attention_num_buckets=32,
                                   relative_attention_max_distance=8)
    model = transformers.T5EncoderModel(config).eval()
    with pytest.raises(InputError, match="T5Attention: t5: its relative attention bias: "
                                         "relative_bias's max_distance \\(8\\) must exceed"):
        mhagen.hf.optimize(model, max_seq_len=MAX_LEN, batch=None)
    assert type(model.encoder.block[0].layer[0].SelfAttention).__name__ == "T5Attention"
