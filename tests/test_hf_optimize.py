"""mhagen.hf.optimize on the decoder-only families (mhagen/hf/decoders.py): tiny random
configs (2 layers, hidden 64, 4 heads, 2 K/V heads where the family groups them), each
optimized model against the same model on Hugging Face's own attention: logits within
1e-4 (float32), generate() token for token (greedy and sampling at fixed seeds; left-padded
batches), right padding, the cache API, half precision, refusals.

The configs use initializer_range 0.2 (Hugging Face's 0.02 leaves every attention nearly
uniform, where a wrong rotary base moves the logits by 3e-4 only; at 0.2 by 1.5). Each
family is built once (module-scoped fixture, batch 2: every call here has 2 rows)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mhagen                     # noqa: E402
import mhagen.hf                  # noqa: E402

T = transformers
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, initializer_range=0.2)
MAX = 48                          # optimize's max_seq_len: prompt 9 + up to 39 new tokens


def _configs():
    return {
        # GQA, rotary
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(intermediate_size=96, num_key_value_heads=2,
                                                     **COMMON), "sdpa"),
        # sliding window 5 (a 9-token prompt and 8 new tokens cross it)
        "mistral": (T.MistralForCausalLM, T.MistralConfig(
            intermediate_size=96, num_key_value_heads=2, sliding_window=5, head_dim=16,
            **COMMON), "sdpa"),
        # q/k/v biases, no o bias
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(intermediate_size=96, num_key_value_heads=2,
                                                     **COMMON), "sdpa"),
        # sliding and full layers, softcap, query_pre_attn_scalar 32 != head_dim 16
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config(
            intermediate_size=96, num_key_value_heads=2, head_dim=16, sliding_window=5,
            query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
            final_logit_softcapping=None, **COMMON), "eager"),
        # Conv1D weights, learned positions
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                 n_positions=64, initializer_range=0.2),
                 "sdpa"),
        # fused QKV interleaved per head, ALiBi
        "bloom": (T.BloomForCausalLM, T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2,
                                                    n_head=4, initializer_range=0.2), "eager"),
        # new_decoder_architecture: grouped QKV, 2 K/V heads, rotary
        "falcon": (T.FalconForCausalLM, T.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=64,
            initializer_range=0.2), "sdpa"),
        # per-head QKV, ALiBi / sqrt(head_dim), biases
        "falcon_alibi": (T.FalconForCausalLM, T.FalconConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            multi_query=False, new_decoder_architecture=False, alibi=True, bias=True,
            parallel_attn=False, initializer_range=0.2), "sdpa"),
    }


ROTARY = {"llama", "mistral", "qwen2", "gemma2", "falcon"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on one torch thread: two threads' barriers, beside TVM's pool and other
    test workers on the same cores, made each generate() call 10-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_BUILT = {}


def _pair(name, **options):
    """(HF's model, the same weights optimized, the report); the default options' pair is
    built once per module (every build is the tests' cost)."""
    if not options and name in _BUILT:
        return _BUILT[name]
    cls, config, attn = _configs()[name]
    config._attn_implementation = attn
    torch.manual_seed(0)
    ref = cls(config).eval()
    opt = cls(config).eval()
    opt.load_state_dict(ref.state_dict())
    report = mhagen.hf.optimize(opt, **dict(dict(max_seq_len=MAX, batch=2), **options))
    if not options:
        _BUILT[name] = ref, opt, report
    return ref, opt, report


# Mistral (a window, as Gemma 2's sliding layers) and Qwen2 (LLaMA with q/k/v biases) are
# the slow set: what they add over the others is one option each
SLOW = {"mistral", "qwen2"}


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(_configs())])
def family(request):
    ref, opt, report = _pair(request.param)
    return request.param, ref, opt, report


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    left = torch.ones(2, 9, dtype=torch.long)
    left[1, :3] = 0
    right = torch.ones(2, 9, dtype=torch.long)
    right[0, 6:] = 0
    return ids, left, right


def _generate(model, ids, mask, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                          do_sample=seed is not None, **kw)


def test_logits_equal_hf(family):
    name, ref, opt, _ = family
    ids, left, right = _inputs()
    with torch.no_grad():
        for mask in (None, left, right):
            a = ref(ids, attention_mask=mask).logits
            b = opt(ids, attention_mask=mask).logits
            real = slice(None) if mask is None else mask.bool()
            assert (a - b)[real].abs().max().item() < 1e-4, (name, mask)
            assert a[real].abs().max().item() > 1.0      # the comparison is not of zeros


def test_replaced_every_attention_module_one_build(family):
    name, _, opt, report = family
    fused = report.fused_modules()
    assert len(fused) == 2 == len(report.replaced) and not report.kept
    assert all(type(m).__name__ != f.replaced_class for f in fused
               for m in opt.modules() if m is not f)
    # layers of one configuration share one compiled program, each with its own weights
    programs = {id(f.module(2).program) for f in fused}
    assert len(programs) == report.configurations == (2 if name == "gemma2" else 1)
    assert fused[0].module(2) is not fused[1].module(2)
    assert str(report).count("->") == 2


def test_generate_greedy_equals_hf(family):
    name, ref, opt, _ = family
    ids, left, _ = _inputs(2)
    for mask in (None, left):
        expected = _generate(ref, ids, mask)
        assert torch.equal(_generate(opt, ids, mask), expected), name


def test_generate_sampling_equals_hf(family):
    name, ref, opt, _ = family
    ids, left, _ = _inputs(3)
    for seed in (0, 7):
        expected = _generate(ref, ids, left, seed=seed, top_k=0)
        assert torch.equal(_generate(opt, ids, left, seed=seed, top_k=0), expected), name


def test_right_padding_continued(family):
    """Right-padded rows continued token by token (taking each row's logits at its last real
    token): positions-free attention (GPT-2, ALiBi) equals HF recomputing the unpadded rows;
    rotary families are refused when generate() numbers a right-padded row's next token
    from its padding column (a cache of real tokens cannot place it there: pad on the left,
    HF's convention for decoder-only generation)."""
    name, ref, opt, _ = family
    ids, _, right = _inputs(4)
    if name in ROTARY:
        with pytest.raises(mhagen.InputError, match="padding_side='left'"):
            _generate(opt, ids, right)
        return
    with torch.no_grad():
        out = opt(ids, attention_mask=right, use_cache=True)
        last = right.sum(1) - 1
        nxt = out.logits[torch.arange(2), last].argmax(-1)[:, None]
        mask = torch.cat([right, torch.ones(2, 1, dtype=right.dtype)], 1)
        position = (mask.cumsum(-1) - 1)[:, -1:]    # GPT-2's learned positions: real count
        step = opt(nxt, attention_mask=mask, position_ids=position, cache=out.cache,
                   use_cache=True).logits[:, -1]
        for row in range(2):
            real = torch.cat([ids[row, :int(last[row]) + 1], nxt[row]])[None]
            want = ref(real).logits[0, -1]
            assert (step[row] - want).abs().max().item() < 1e-4, (name, row)


@pytest.fixture(scope="module")
def llama():
    return _pair("llama")


def test_cache_api_and_step_by_step(llama):
    """A manual loop: prefill then one token at a time through model(...) with the cache the
    model returns; HF's get_seq_length counts columns (padding included), the KVCaches
    real tokens."""
    ref, opt, report = llama
    ids, left, _ = _inputs(5)
    positions = (left.cumsum(-1) - 1).masked_fill(left == 0, 1)      # as generate() numbers them
    with torch.no_grad():
        out = opt(ids, attention_mask=left, position_ids=positions, use_cache=True)
        cache = out.cache
        assert isinstance(cache, mhagen.hf.cache.MhagenCache)
        assert cache.get_seq_length() == 9 and cache.lens().tolist() == [9, 6]
        mask, tokens = left, ids
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], 1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            pos = (mask.cumsum(-1) - 1)[:, -1:]
            out = opt(nxt, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 12 and cache.lens().tolist() == [12, 9]
        full = ref(tokens, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)).logits[:, -1]
        assert (out.logits[:, -1] - full).abs().max().item() < 1e-4
        assert cache.get_mask_sizes(1, 0) == (13, 0)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.lens() is None


def test_generate_without_cache_and_beam_search(llama):
    ref, opt, _ = llama
    ids, left, _ = _inputs(6)
    assert torch.equal(_generate(opt, ids, left, use_cache=False), _generate(ref, ids, left))
    # beam search on one prompt (2 beams: the batch-2 build): reorder_cache on mhagen's rows
    one = ids[:1]
    expected = ref.generate(one, max_new_tokens=6, num_beams=2, do_sample=False,
                            pad_token_id=0)
    assert torch.equal(opt.generate(one, max_new_tokens=6, num_beams=2, do_sample=False,
                                    pad_token_id=0), expected)


def test_call_refusals_leave_the_cache_usable(llama):
    _, opt, report = llama
    ids, left, _ = _inputs(7)
    with torch.no_grad():
        with pytest.raises(mhagen.InputError, match="max_seq_len=48"):
            opt(torch.randint(3, 128, (2, MAX + 1)))
        dynamic = T.DynamicCache(config=opt.config)
        dynamic.update(torch.zeros(2, 2, 3, 16), torch.zeros(2, 2, 3, 16), 0)
        with pytest.raises(mhagen.InputError, match="DynamicCache holding 3 tokens"):
            opt(ids, cache=dynamic, use_cache=True)
        with pytest.raises(mhagen.InputError, match="2-D attention_mask"):
            opt(ids, attention_mask=torch.ones(2, 1, 9, 9))
        other = _pair("llama", batch=None)[2]
        with pytest.raises(mhagen.InputError, match="another optimized model"):
            opt(ids, cache=other.new_cache(), use_cache=True)
        opt.train()
        try:
            with pytest.raises(mhagen.InputError, match="model.eval()"):
                opt(ids)
        finally:
            opt.eval()
        assert opt(ids).logits.shape == (2, 9, 128)


def _mutated(name, **changes):
    cls, config, attn = _configs()[name]
    for key, value in changes.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


class _ToyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)


class _ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": _ToyAttention()})])


def _untouched(model, before):
    return [type(m).__name__ for m in model.modules()] == before


def test_refusals_name_the_module_and_change_nothing():
    toy = _ToyModel()
    before = [type(m).__name__ for m in toy.modules()]
    with pytest.raises(mhagen.InputError, match=r"blocks\.0\.attn: _ToyAttention: no mhagen "
                                                r"family covers this class.*unsupported='keep'"):
        mhagen.hf.optimize(toy, max_seq_len=16)
    assert _untouched(toy, before)
    report = mhagen.hf.optimize(toy, max_seq_len=16, unsupported="keep")
    assert report.kept == [("blocks.0.attn", "_ToyAttention",
                            "no mhagen family covers this class")] and not report.replaced
    assert _untouched(toy, before) and "kept on torch: blocks.0.attn" in str(report)

    scaled = _mutated("llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0})
    before = [type(m).__name__ for m in scaled.modules()]
    with pytest.raises(mhagen.InputError, match=r"model\.layers\.0\.self_attn: LlamaAttention: "
                                                r"llama: rope_type 'linear'.*\(and 1 more\)"):
        mhagen.hf.optimize(scaled, max_seq_len=16)
    assert _untouched(scaled, before)
    with pytest.raises(mhagen.InputError, match="bidirectional"):
        mhagen.hf.optimize(_mutated("gemma2", use_bidirectional_attention=True), batch=None)
    with pytest.raises(mhagen.InputError, match="cross-attention"):
        mhagen.hf.optimize(_mutated("gpt2", add_cross_attention=True), batch=None)
    model = _mutated("gpt2")
    for bad, match in ((dict(dtype=torch.float64), "dtype="), (dict(max_seq_len=0), "max_seq_len="),
                       (dict(batch=0), "batch="), (dict(unsupported="skip"), "unsupported=")):
        with pytest.raises(mhagen.InputError, match=match):
            mhagen.hf.optimize(model, **bad)
    with pytest.raises(mhagen.InputError, match="torch model"):
        mhagen.hf.optimize("gpt2")
    mhagen.hf.optimize(model, max_seq_len=16, batch=None)
    with pytest.raises(mhagen.InputError, match="already optimized"):
        mhagen.hf.optimize(model)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_half_precision_within_tolerance(dtype):
    """A bfloat16 model optimized in its dtype (weights, activations and cache in bfloat16):
    its logits are as close to the float32 model's as Hugging Face's own bfloat16 run, and
    greedy generation follows it for the first tokens."""
    torch_dtype = getattr(torch, dtype)
    cls, config, attn = _configs()["llama"]
    config._attn_implementation = attn
    torch.manual_seed(0)
    exact = cls(config).eval()
    ref = cls(config).eval().to(torch_dtype)
    opt = cls(config).eval().to(torch_dtype)
    ref.load_state_dict(exact.state_dict())
    opt.load_state_dict(exact.state_dict())
    report = mhagen.hf.optimize(opt, max_seq_len=MAX, batch=2)
    assert report.dtype == dtype
    ids, left, _ = _inputs(8)
    with torch.no_grad():
        want = exact(ids, attention_mask=left).logits[left.bool()]
        hf = ref(ids, attention_mask=left).logits[left.bool()].float()
        ours = opt(ids, attention_mask=left).logits
        assert ours.dtype == torch_dtype
        ours = ours[left.bool()].float()
    tol = mhagen.TOLERANCES[dtype]
    bound = tol["atol"] + tol["rtol"] * want.abs().max().item()
    hf_error = (hf - want).abs().max().item()
    our_error = (ours - want).abs().max().item()
    print(f"bfloat16 logits error: mhagen {our_error:.3g}, HF {hf_error:.3g}, bound {bound:.3g}")
    assert our_error <= max(2 * hf_error, bound), (our_error, hf_error, bound)
    assert torch.equal(_generate(opt, ids, left)[:, 9:11], _generate(ref, ids, left)[:, 9:11])
