"""attn_implementation="mhagen" (mhagen.hf.register): tiny random-config Hugging Face models
whose attention cores run on mhagen kernels, against the same models on "sdpa" (Gemma 2,
which has no sdpa, on "eager"): outputs within 1e-4, generate() with greedy decoding and
sampling at fixed seeds giving the same tokens, padded batches included; the refusals."""
import copy

import numpy as np
import pytest

from mhagen import InputError

torch = pytest.importorskip(
    "torch", reason="torch is not installed: `pip install -e .[test]` (CI installs it, so these "
                    "tests never skip there)")
tf = pytest.importorskip(
    "transformers", reason="transformers is not installed: `pip install -e .[test]` (CI "
                           "installs it, so these tests never skip there)")

import mhagen.hf  # noqa: E402
from mhagen.hf import interface  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
IDS = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
LEFT = torch.ones(2, 12, dtype=torch.long)
LEFT[1, :5] = 0           # the second row is 7 tokens, left-padded as generate() wants
RIGHT = torch.ones(2, 12, dtype=torch.long)
RIGHT[1, 7:] = 0          # an encoder's batch: right padding


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's ops on one thread here: its pool and TVM's spinning for the same two cores
    made every op of these tiny models ~10x slower (a test run 74 s instead of ~25 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert mhagen.hf.register() == "mhagen"


def pair(cls, config, reference="sdpa"):
    """(the model on `reference`, the same weights on "mhagen"), in eval mode."""
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(config), attn_implementation=reference).eval()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="mhagen").eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "mhagen"
    return ref, ours


def output(model, **inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def same_generation(ref, ours, ids, mask):
    """generate() greedy, then sampling at two seeds: the same tokens."""
    kw = dict(attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ref.generate(ids, do_sample=False, **kw),
                           ours.generate(ids, do_sample=False, **kw))
        for seed in (1, 2):
            torch.manual_seed(seed)
            a = ref.generate(ids, do_sample=True, **kw)
            torch.manual_seed(seed)
            assert torch.equal(a, ours.generate(ids, do_sample=True, **kw))


def max_diff(a, b, keep=None):
    if keep is not None:
        a, b = a[keep.bool()], b[keep.bool()]
    return (a - b).abs().max().item()


FAMILIES = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**TINY), "sdpa"),
    "mistral-sliding-window": (tf.MistralForCausalLM, tf.MistralConfig(**TINY, sliding_window=4),
                               "sdpa"),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**TINY), "sdpa"),
    # softcap, query_pre_attn_scalar != head_dim, sliding and full layers alternating
    "gemma2": (tf.Gemma2ForCausalLM,
               tf.Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                               attn_logit_softcapping=5.0, final_logit_softcapping=None),
               "eager"),
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                               n_positions=128, bos_token_id=0,
                                               eos_token_id=0), "sdpa"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_outputs_and_generation_equal_the_reference(family):
    cls, config, reference = FAMILIES[family]
    ref, ours = pair(cls, config, reference)
    assert max_diff(output(ref, input_ids=IDS), output(ours, input_ids=IDS)) < 1e-4
    # left padding: the padded queries see no key, and sdpa gives 0 there as mhagen does;
    # eager gives them a uniform average instead, so only the real tokens are compared
    keep = LEFT if reference == "eager" else None
    assert max_diff(output(ref, input_ids=IDS, attention_mask=LEFT),
                    output(ours, input_ids=IDS, attention_mask=LEFT), keep) < 1e-4
    same_generation(ref, ours, IDS, LEFT)


def test_layers_share_one_build_per_configuration():
    """LLaMA's two layers (and Qwen2's, of the same shape) run one compiled core; Gemma 2's
    sliding and full layers two."""
    keys = [key for key, _ in interface.builds()]
    llama = [k for k in keys if k[:5] == (4, 16, 2, 0.25, True) and k[5] is None and k[7] is None]
    assert len(llama) == 1
    gemma = [k for k in keys if k[3] == pytest.approx(24 ** -0.5)]
    assert sorted(k[5] is None for k in gemma) == [False, True]


def test_bert_right_padding():
    config = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=128)
    ref, ours = pair(tf.BertModel, config)
    for mask in (None, RIGHT):
        assert max_diff(output(ref, input_ids=IDS, attention_mask=mask),
                        output(ours, input_ids=IDS, attention_mask=mask)) < 1e-4


def test_static_cache_and_a_chunk_after_the_prompt():
    """A static cache hands all its slots, the unwritten ones past the queries too (read
    off the mask and left out); new tokens in a chunk after a cached prompt see it
    bottom-right."""
    ref, ours = pair(tf.LlamaForCausalLM, tf.LlamaConfig(**TINY))
    kw = dict(attention_mask=LEFT, max_new_tokens=4, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(ref.generate(IDS, **kw), ours.generate(IDS, **kw))
        caches = [m(IDS[:, :8], attention_mask=LEFT[:, :8], use_cache=True).past_key_values
                  for m in (ref, ours)]
        want, got = (m(IDS[:, 8:], attention_mask=LEFT, cache=c).logits
                     for m, c in zip((ref, ours), caches))
    assert max_diff(want, got) < 1e-4


def test_gpt2_cross_attention_to_a_padded_encoder_output():
    """Cross-attention: no positions (queries may outnumber the keys), the encoder's
    padding read off its mask."""
    config = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                           add_cross_attention=True, bos_token_id=0, eos_token_id=0)
    ref, ours = pair(tf.GPT2LMHeadModel, config)
    encoded = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, 5:] = 0
    for n in (12, 4):
        inputs = dict(input_ids=IDS[:, :n], encoder_hidden_states=encoded,
                      encoder_attention_mask=padding)
        assert max_diff(output(ref, **inputs), output(ours, **inputs)) < 1e-4


def test_bfloat16_model_within_its_tolerance():
    ref, ours = pair(tf.LlamaForCausalLM, tf.LlamaConfig(**TINY))
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    want, got = output(ref, input_ids=IDS), output(ours, input_ids=IDS)
    assert got.dtype == torch.bfloat16
    # the table's bfloat16 row (atol 1e-3, rtol 2^-7), on logits two layers deep
    assert max_diff(want.float(), got.float()) <= 1e-3 + 2 ** -7 * 4 * want.abs().max().item()


def test_set_attn_implementation_switches_a_built_model():
    ref = tf.LlamaForCausalLM._from_config(copy.deepcopy(tf.LlamaConfig(**TINY)),
                                           attn_implementation="sdpa").eval()
    want = output(ref, input_ids=IDS)
    ref.set_attn_implementation("mhagen")
    assert ref.config._attn_implementation == "mhagen"
    assert max_diff(output(ref, input_ids=IDS), want) < 1e-4


# -- refusals ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return pair(tf.LlamaForCausalLM, tf.LlamaConfig(**TINY, attention_dropout=0.1))[1]


def test_training_and_grad_are_refused(llama):
    with pytest.raises(InputError, match="inference-only"):
        llama(IDS)                                     # grad enabled
    llama.train()
    try:
        with torch.no_grad(), pytest.raises(InputError, match="attention dropout 0.1"):
            llama(IDS)
    finally:
        llama.eval()


def test_output_attentions_is_refused(llama):
    with torch.no_grad(), pytest.raises(InputError, match="output_attentions=False"):
        llama(IDS, output_attentions=True)


def test_masks_that_are_not_causal_sliding_or_padding_are_refused(llama):
    q = torch.zeros(1, 4, 6, 16)
    k = v = torch.zeros(1, 2, 6, 16)
    attn = llama.model.layers[0].self_attn
    holes = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    holes[..., 2] = False                          # a key hidden in the middle of the rows
    with pytest.raises(InputError, match="neither causal, sliding-window nor full"):
        interface.attention(attn, q, k, v, holes)
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 0] = -0.5                            # an additive bias, not a mask
    with pytest.raises(InputError, match="values other than 0 and -inf"):
        interface.attention(attn, q, k, v, bias)
    per_head = torch.ones(1, 4, 6, 6, dtype=torch.bool).tril()
    per_head[:, 1] = True
    with pytest.raises(InputError, match="differs between heads"):
        interface.attention(attn, q, k, v, per_head)
    with pytest.raises(InputError, match="position_bias"):
        interface.attention(attn, q, k, v, None, position_bias=torch.zeros(1, 4, 6, 6))


def test_mask_reading(llama):
    """A float 0/-inf mask of left padding and a causal pattern reads as the padding it is;
    a 0/-inf mask gives what its boolean form gives."""
    attn = llama.model.layers[0].self_attn
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32))
               for s in ((2, 4, 6, 16), (2, 2, 6, 16), (2, 2, 6, 16)))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, :, :, :2] = False
    causal, window, starts, ends, keys = interface.read_mask(keep, 2, 6, 6, True, None)
    assert (causal, window, starts.tolist(), ends.tolist(), keys) == (True, None, [0, 2],
                                                                      [6, 6], 6)
    # a static cache's prompt: 4 slots past the queries, hidden from all of them
    slots = torch.cat([keep, torch.zeros(2, 1, 6, 4, dtype=torch.bool)], dim=-1)
    assert interface.read_mask(slots, 2, 6, 10, True, None)[4] == 6
    # a sliding window of 3 on top of left padding
    band = keep & (torch.arange(6)[:, None] - torch.arange(6)[None, :] < 3)
    assert interface.read_mask(band, 2, 6, 6, True, 3)[:2] == (True, 3)
    floats = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    got = interface.attention(attn, q, k, v, floats)[0]
    assert torch.equal(got, interface.attention(attn, q, k, v, keep)[0])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=keep,
        scale=attn.scaling).transpose(1, 2)
    assert max_diff(got, want) < 1e-5
