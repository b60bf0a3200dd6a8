"""Differential fuzzing with hypothesis (issue 16: no silent wrong answer, no crash).

1. Valid layers vs the float64 reference: hypothesis draws a layer (heads 1-8, K/V heads
   dividing them, head_dim in {8, 12, 16, 24, 40, 64}, d_model = heads * head_dim or another
   width with an explicit head_dim, bias, causal, random boolean masks over q_idx / kv_idx /
   batch / head / q_len / kv_len, sliding windows, score modifiers, RoPE), a shape (batch
   1-4, seq 1-300, mostly < 64, with 1, 2, 97 and 257) and fuse on/off, builds it for
   "x86-avx2" (or "x86" when that preset runs here and differs), runs it on random input
   and compares with `assert_close` against `layer.reference` (2 in 5 cases in float16 or
   bfloat16 storage, with that dtype's tolerance). Nothing is cached across
   cases: every case builds its own module from its own graph. The same layers also run
   as decoding layers (two calls on a random cache), as symbolic-length builds (one build,
   1-3 calls at random shapes up to its maximum, some with key padding) and as
   cross-attention layers (a context of another length and width, fused or not), and a
   sample (one in ten) cross-built for ARM (NEON, 256-bit SVE), saved and run under qemu
   by the C example app. bfloat16 layers with depths AMX tiles take are drawn apart too
   (built for x86-amx everywhere, run where the CPU has AMX).
2. Invalid configurations (bad sizes, masks, score modifiers, rotary, build options, call
   time inputs and weights) raise mhagen's own errors (or the documented TypeError /
   ValueError of the expression builders) from a deliberate `raise` in mhagen, with a
   non-empty message: never another exception, never a crash.
3. NaN / Inf in one batch element's input leaves the other batch elements' outputs exact.

CI profile: the valid-layer fuzzer runs MHAGEN_FUZZ_EXAMPLES cases (default 30 builds, a
half unfused here: 95-114 s; the whole file 117-130 s, on the 2-core Xeon VM this was
written on, CI's class; the AMX layers, a sixth as many, add ~50 s there), the cheap fuzzers up to 10x as many (300 invalid layer options, 300 bad weights,
every bad builder / input / build option), all derandomized (the same cases every run; add
--hypothesis-show-statistics to see what they covered). Long profile: >= 10,000 compiled
cases, run in shards that each draw their own cases (MHAGEN_FUZZ_SEED=N, a different N per
shard), e.g. `MHAGEN_FUZZ_SEED=1 MHAGEN_FUZZ_EXAMPLES=1500 .venv/bin/python -m pytest -q
tests/test_fuzz.py -k match_the_reference` (1500 + 3 x 500 builds, 150 on ARM); the shards run so far
are listed in tests/FUZZ_LOG.md. A failure is shrunk to a minimal layer and printed
(shrinking a compile-heavy case can itself take minutes). A bug the fuzzers found (unfused builds at seq_len 1 with several heads) is
fixed and pinned by test_unfused_seq1_multi_head.
"""
import linecache
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import mhagen
from mhagen.ir import expr as ex
from mhagen.tolerances import assert_close, judged_as
from tests.conftest import random_cache, x86_targets
from tests.test_arm import Artifact, aarch64_runtime, qemu, toolchain  # noqa: F401 - fixtures

EXAMPLES = int(os.environ.get("MHAGEN_FUZZ_EXAMPLES", "30"))
SHARD = os.environ.get("MHAGEN_FUZZ_SEED")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=SHARD is None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=True)
CHEAP = settings(FUZZ, max_examples=10 * EXAMPLES)

TARGETS = x86_targets()


def shard(test):
    """MHAGEN_FUZZ_SEED=N draws another set of cases, the same for the same N: the long
    profile runs in shards (tests/FUZZ_LOG.md), each its own cases."""
    return test if SHARD is None else seed(int(SHARD))(test)


ARM_TARGETS = ["arm-neon", "arm-sve"]


@pytest.fixture(scope="module")
def arm(toolchain, qemu, aarch64_runtime):  # noqa: F811
    """The cross toolchain, qemu-user and TVM's aarch64 runtime (tests/test_arm.py's
    fixtures: missing ones skip with the reason, or fail in CI)."""


HEAD_DIMS = [8, 12, 16, 24, 40, 64]
INDEX_VARS = [ex.q_idx, ex.kv_idx, ex.batch, ex.head]
LENGTH_VARS = [ex.q_len, ex.kv_len]


# -- valid layers ----------------------------------------------------------------------------
@st.composite
def int_terms(draw):
    """An integer expression of the indices: v, v + c, v - w, c * v, q_len/kv_len - v."""
    v = draw(st.sampled_from(INDEX_VARS))
    kind = draw(st.integers(0, 4))
    if kind == 1:
        return v + draw(st.integers(-6, 6))
    if kind == 2:
        return v - draw(st.sampled_from(INDEX_VARS))
    if kind == 3:
        return draw(st.integers(-3, 3)) * v
    if kind == 4:
        return draw(st.sampled_from(LENGTH_VARS)) - v
    return v


@st.composite
def comparisons(draw):
    lhs = draw(int_terms())
    rhs = draw(st.one_of(st.integers(-4, 40), int_terms()))
    op = draw(st.sampled_from(["<", "<=", ">", ">=", "eq", "ne"]))
    return {"<": lambda: lhs < rhs, "<=": lambda: lhs <= rhs, ">": lambda: lhs > rhs,
            ">=": lambda: lhs >= rhs, "eq": lambda: lhs.eq(rhs), "ne": lambda: lhs.ne(rhs)}[op]()


@st.composite
def masks(draw):
    kind = draw(st.sampled_from(["none", "none", "window", "random", "random", "causal&random"]))
    if kind == "none":
        return None
    if kind == "window":
        return ex.sliding_window(draw(st.integers(1, 70)))
    m = draw(comparisons())
    for _ in range(draw(st.integers(0, 3))):
        other = draw(comparisons())
        m = (m & other) if draw(st.booleans()) else (m | other)
    if kind == "causal&random":
        m = ex.causal() | m if draw(st.booleans()) else ex.causal() & m
    return m


@st.composite
def score_mods(draw, num_heads):
    def one():
        kind = draw(st.sampled_from(["alibi", "softcap", "where", "affine", "clip", "table",
                                     "relative_bias"]))
        if kind == "alibi":
            return ex.alibi(num_heads)
        if kind == "softcap":
            return ex.softcap(draw(st.sampled_from([0.5, 2.0, 5.0, 30.0])))
        if kind == "where":
            return ex.where(draw(comparisons()), ex.score + draw(st.floats(-3, 3)), ex.score)
        if kind == "affine":
            return ex.score * draw(st.floats(0.25, 2.0)) + draw(st.floats(-1, 1))
        if kind == "clip":
            return ex.minimum(ex.maximum(ex.score, -draw(st.floats(0.5, 4))),
                              draw(st.floats(0.5, 4)))
        if kind == "relative_bias":     # T5: tables past LARGE_TABLE read from a param
            buckets = draw(st.sampled_from([4, 8, 32]))
            bidirectional = draw(st.booleans())
            exact = (buckets // 2 if bidirectional else buckets) // 2
            table = draw(st.lists(st.lists(st.floats(-2, 2), min_size=buckets,
                                           max_size=buckets),
                                  min_size=num_heads, max_size=num_heads))
            return ex.relative_bias(table, max_distance=draw(st.integers(exact + 1, 40)),
                                    bidirectional=bidirectional)
        if draw(st.booleans()):      # one value per head (a per-head table must cover them)
            return ex.score + ex.table(draw(st.lists(st.floats(-1, 1), min_size=num_heads,
                                                     max_size=num_heads)), ex.head)
        values = draw(st.lists(st.floats(-1, 1), min_size=1, max_size=40))
        return ex.score + ex.table(values, ex.kv_idx - ex.q_idx)
    n = draw(st.sampled_from([0, 0, 1, 1, 2]))
    mods = [one() for _ in range(n)]
    if n == 2 and draw(st.booleans()):
        return ex.combine(*mods)
    return mods[0] if n == 1 else (mods or None)


@st.composite
def layers(draw):
    num_heads = draw(st.integers(1, 8))
    kv_heads = draw(st.sampled_from([d for d in range(1, num_heads + 1) if num_heads % d == 0]))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    explicit = draw(st.sampled_from(["default", "default", "same", "other"]))
    d_model = num_heads * head_dim
    if explicit == "other":
        d_model = draw(st.integers(4, 200))
    rot = draw(st.sampled_from(["none", "none", "default", "partial"]))
    rotary = {"none": None, "default": True}.get(rot)
    if rot == "partial":
        rotary = mhagen.rotary(base=draw(st.sampled_from([10000.0, 500.0, 2.0])),
                               rotary_dim=2 * draw(st.integers(1, head_dim // 2)))
    options = dict(d_model=d_model, num_heads=num_heads, kv_heads=kv_heads,
                   head_dim=None if explicit == "default" else head_dim,
                   bias=draw(st.booleans()), causal=draw(st.booleans()), mask=draw(masks()),
                   score_mod=draw(score_mods(num_heads)), rotary=rotary)
    if kv_heads == num_heads and draw(st.booleans()):
        del options["kv_heads"]
    return options


# storage dtypes: 2 in 5 layers in float16 or bfloat16
STORAGE = st.sampled_from(["float32", "float32", "float32", "float16", "bfloat16"])
SEQS = st.one_of(st.integers(1, 16), st.integers(1, 63), st.integers(1, 63),
                 st.sampled_from([1, 2, 3, 5, 7, 13, 31, 61, 97, 127, 257]), st.integers(64, 300))


@shard
@FUZZ
@given(options=layers(), batch=st.integers(1, 4), seq=SEQS, fuse=st.sampled_from([True, True, False]),
       target=st.sampled_from(TARGETS), seed=st.integers(0, 2 ** 16),
       dtype=STORAGE)
def test_random_valid_layers_match_the_reference(options, batch, seq, fuse, target, seed,
                                                  dtype):
    layer = mhagen.mha(**options, dtype=dtype)
    num_heads, kv_heads = options["num_heads"], options.get("kv_heads", options["num_heads"])
    for what in (f"seq {seq}" if seq in (1, 2, 97, 257) else f"seq {'<64' if seq < 64 else '>=64'}",
                 f"fuse {fuse}", target, f"mask {options['mask'] is not None}",
                 f"score_mod {options['score_mod'] is not None}",
                 f"rotary {options['rotary'] is not None}", f"gqa {kv_heads < num_heads}",
                 dtype):
        event(what)     # --hypothesis-show-statistics lists what the profile covered
    w = layer.init_weights(seed)
    x = np.random.default_rng(seed).standard_normal(
        (batch, seq, options["d_model"])).astype(np.float32)
    kernel = mhagen.build(layer, target, batch=batch, seq_len=seq, weights=w, fuse=fuse)
    if "AMX tiles" in (kernel.precision or ""):   # bfloat16 on an AMX host (x86/amx.py)
        event("AMX tiles" + (", attention too" if "P V on AMX" in kernel.precision else ""))
    expected = layer.reference(x, w)     # half layers: of x and w rounded to the dtype
    assert_close(kernel(x), expected, dtype)
    assert_close(kernel(x, weights=w), expected, dtype)   # weights per call: the packing path


@shard
@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
@given(options=layers(), batch=st.integers(1, 3), new=st.sampled_from([1, 1, 2, 3, 5, 16]),
       room=st.integers(0, 90), target=st.sampled_from(TARGETS), seed=st.integers(0, 2 ** 16),
       dtype=STORAGE,
       cache_dtype=st.sampled_from([None, None, None, "float16", "bfloat16"]))
def test_random_decoding_layers_match_the_reference(options, batch, new, room, target, seed,
                                                    dtype, cache_dtype):
    """The same random layers as decoding layers (kv_cache=), some with half-precision
    storage or caches: two calls of `new` tokens on a cache holding random rows up to
    per-row random lengths; outputs and caches match (judged by the dtype or cache dtype
    that holds less: tolerances.judged_as)."""
    max_len = 2 * new + room + 1
    layer = mhagen.mha(**options, kv_cache=max_len, dtype=dtype, cache_dtype=cache_dtype)
    judged = judged_as(layer)
    for what in (f"new tokens {new}", f"dtype {dtype}", f"cache {cache_dtype or 'float32'}"):
        event(what)
    rng = np.random.default_rng(seed)
    w = layer.init_weights(seed)
    kernel = mhagen.build(layer, target, batch=batch, seq_len=new, weights=w)
    cache = kernel.new_cache()
    random_cache(cache, rng)
    cache.lens[...] = rng.integers(0, max_len - 2 * new + 1, batch)
    expected_cache = cache.copy()
    for _ in range(2):
        x = rng.standard_normal((batch, new, options["d_model"])).astype(np.float32)
        assert_close(kernel(x, cache=cache), layer.reference(x, w, cache=expected_cache),
                     judged)
    assert cache.lens.tolist() == expected_cache.lens.tolist()
    assert_close(cache.k, expected_cache.k, judged)
    assert_close(cache.v, expected_cache.v, judged)


@st.composite
def amx_layers(draw):
    """The random layers with depths AMX tiles take (schedules/x86/amx.py): head_dim 32 or
    64, d_model heads x head_dim or another multiple of 32, at least 64 (the QKV GEMM's
    tiles need 2 steps of 32; a one-head output GEMM of depth 32 converts on load);
    partial RoPE dropped (its rotary_dim was drawn for another head_dim)."""
    options = draw(layers())
    head_dim = draw(st.sampled_from([32, 64]))
    d_model = max(64, draw(st.sampled_from([options["num_heads"] * head_dim,
                                            32 * draw(st.integers(2, 8))])))
    options.update(head_dim=head_dim, d_model=d_model)
    if options["rotary"] not in (None, True):
        options["rotary"] = None
    return options


@shard
@settings(FUZZ, max_examples=max(1, EXAMPLES // 6))
@given(options=amx_layers(), batch=st.integers(1, 3), seq=SEQS, any_length=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_random_amx_layers_match_the_reference(options, batch, seq, any_length, seed):
    """bfloat16 layers on AMX tiles (x86-amx): the GEMMs always (depths whole 32s), the
    attention's Q K^T and P V too unless the layer has RoPE; exact or any-length builds.
    Compiled on every host (the precision says tiles), run and compared where the CPU has
    AMX (Sapphire Rapids and later)."""
    layer = mhagen.mha(**options, dtype="bfloat16")
    kw = dict(seq_len=None, max_seq_len=seq + 7) if any_length else dict(seq_len=seq)
    w = layer.init_weights(seed)
    m = mhagen.build(layer, "x86-amx", batch=batch, weights=w, **kw)
    assert "run on AMX tiles" in m.precision, m.precision
    on_tiles = "Q K^T and P V on AMX tiles" in m.precision
    assert on_tiles == (options["rotary"] is None), m.precision
    event(f"attention on tiles: {on_tiles}")
    event(f"any length: {any_length}")
    if not m.target.runs_here():
        return    # compile-only here (no AMX)
    x = np.random.default_rng(seed).standard_normal(
        (batch, seq, options["d_model"])).astype(np.float32)
    assert_close(m(x), layer.reference(x, w), "bfloat16")


@shard
@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
@given(options=layers(), max_batch=st.integers(1, 3), max_seq=st.integers(1, 300),
       calls=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=3),
       padding=st.booleans(), target=st.sampled_from(TARGETS), seed=st.integers(0, 2 ** 16))
def test_random_symbolic_length_layers_match_the_reference(options, max_batch, max_seq, calls,
                                                           padding, target, seed):
    """The same random layers built once for every batch <= max_batch and seq <= max_seq
    (seq_len=None), some with key padding, called at 1-3 random shapes (the maximum among
    them when drawn): each call matches the reference of its shape."""
    layer = mhagen.mha(**options, key_padding=padding)
    rng = np.random.default_rng(seed)
    w = layer.init_weights(seed)
    kernel = mhagen.build(layer, target, batch=None, max_batch=max_batch, seq_len=None,
                          max_seq_len=max_seq, weights=w)
    for fb, fs in calls:
        batch, seq = 1 + round(fb * (max_batch - 1)), 1 + round(fs * (max_seq - 1))
        event(f"call at the maximum: {(batch, seq) == (max_batch, max_seq)}")
        x = rng.standard_normal((batch, seq, options["d_model"])).astype(np.float32)
        lens = rng.integers(0, seq + 1, batch) if padding else None
        assert_close(kernel(x, kv_lens=lens), layer.reference(x, w, kv_lens=lens))


@shard
@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
@given(options=layers(), batch=st.integers(1, 3), seq=st.integers(1, 120),
       kv_seq=st.integers(1, 120), kv_dim=st.integers(4, 100), padding=st.booleans(),
       fuse=st.booleans(), target=st.sampled_from(TARGETS), seed=st.integers(0, 2 ** 16))
def test_random_cross_attention_layers_match_the_reference(options, batch, seq, kv_seq, kv_dim,
                                                           padding, fuse, target, seed):
    """The same random layers (without RoPE) as cross-attention: K/V from a context of
    another length and width, some with key padding over it, fused or not."""
    options = dict(options, rotary=None)
    layer = mhagen.mha(**options, cross=True, kv_dim=kv_dim, key_padding=padding)
    event(f"fused: {fuse}")
    rng = np.random.default_rng(seed)
    w = layer.init_weights(seed)
    kernel = mhagen.build(layer, target, batch=batch, seq_len=seq, kv_seq_len=kv_seq,
                          weights=w, fuse=fuse)
    x = rng.standard_normal((batch, seq, options["d_model"])).astype(np.float32)
    c = rng.standard_normal((batch, kv_seq, kv_dim)).astype(np.float32)
    lens = rng.integers(0, kv_seq + 1, batch) if padding else None
    assert_close(kernel(x, context=c, kv_lens=lens),
                 layer.reference(x, w, context=c, kv_lens=lens))


@shard
@settings(FUZZ, max_examples=max(1, EXAMPLES // 10))
@given(options=layers(), batch=st.integers(1, 2), seq=st.integers(1, 40),
       fuse=st.sampled_from([True, True, False]), target=st.sampled_from(ARM_TARGETS),
       seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from(["float32", "float32", "float16", "bfloat16"]))
def test_random_layers_on_aarch64_under_qemu_match_the_reference(
        arm, tmp_path_factory, options, batch, seq, fuse, target, seed, dtype):
    """A sample of the same random layers cross-built for ARM (NEON or 256-bit SVE), saved
    with their C API and run under qemu by the C example app (examples/c_app/mha_app.c)."""
    event(target)
    layer = mhagen.mha(**options, dtype=dtype)
    w = layer.init_weights(seed)
    module = mhagen.build(layer, target, batch=batch, seq_len=seq, weights=w, fuse=fuse)
    x = np.random.default_rng(seed).standard_normal((batch, seq, options["d_model"]))
    art = Artifact(module, layer, w, x, tmp_path_factory.mktemp("arm-fuzz") / "mha")
    r, y = art.run()
    assert r.returncode == 0, f"qemu -cpu {art.cpu()}: {r.stderr}"
    assert_close(y, art.expected, dtype)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("d_model,heads,kv_heads", [(16, 2, 1), (32, 2, 2), (64, 4, 2),
                                                     (48, 3, 3)])
def test_unfused_seq1_multi_head(target, d_model, heads, kv_heads):
    """Found by the fuzzers (the AVX-512 class first, then x86-avx2 with cross-attention):
    unfused builds at seq_len 1 with several heads gave wrong numbers (up to 1e38). The
    heads' concat, a Select between two heads' buffers, was vectorised; its vector form
    loads both sides, past the end of a one-token buffer. The concat now keeps a scalar
    loop (schedules/cpu/elementwise.py)."""
    layer = mhagen.mha(d_model, heads, kv_heads=kv_heads, bias=False)
    w = layer.init_weights(0)
    x = np.random.default_rng(0).standard_normal((1, 1, d_model)).astype(np.float32)
    kernel = mhagen.build(layer, target, batch=1, seq_len=1, weights=w, fuse=False)
    assert_close(kernel(x), layer.reference(x, w))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("options,seq,kv_seq", [
    (dict(d_model=48, num_heads=3, kv_heads=1, rotary=True), 1, None),
    (dict(d_model=8, num_heads=1, cross=True, kv_dim=4), 3, 1),
    (dict(d_model=32, num_heads=2, cross=True, kv_dim=4), 3, 1),
], ids=["rotary-seq1", "cross-3x1", "cross-3x1-2heads"])
def test_unfused_small_shapes(target, options, seq, kv_seq):
    """Also found by the fuzzers, unfused: RoPE at seq_len 1 (its Select vectorised, as the
    concat's) and 3 queries over 1 key (the softmax's guarded row loop of 2 + 1 rows with a
    column loop of extent 1, which LLVM vectorised wrongly; tasks now divide the rows)."""
    layer = mhagen.mha(**options, bias=False)
    w = layer.init_weights(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, seq, options["d_model"])).astype(np.float32)
    context = rng.standard_normal((1, kv_seq, 4)).astype(np.float32) if kv_seq else None
    kernel = mhagen.build(layer, target, batch=1, seq_len=seq, weights=w, fuse=False,
                          **({"kv_seq_len": kv_seq} if kv_seq else {}))
    assert_close(kernel(x, context=context), layer.reference(x, w, context=context))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("heads,kv_heads,rotary", [(1, 1, None), (8, 1, "partial")])
def test_unfused_seq1_batch_dependent_mask(target, heads, kv_heads, rotary):
    """Found by the fuzzers (8 heads, 1 K/V head, partial RoPE, a mask of q_len and batch,
    batch 2, seq_len 1: off by 2.84); the smallest case is 1 head, mask batch < 1. One key
    per row: compute_at dropped the softmax's column loop of extent 1, so its exp block's
    last loop became the row loop, and vectorising that loop (its body holds the row
    reductions) gave batch 0 the masked batch 1's zeros. The rule now vectorises only a
    column loop (schedules/cpu/softmax.py)."""
    rot = mhagen.rotary(rotary_dim=4) if rotary else None
    layer = mhagen.mha(8 * heads, heads, kv_heads=kv_heads, rotary=rot,
                       mask=(ex.q_idx < ex.q_len) & (ex.batch < 1))
    w = layer.init_weights(0)
    x = np.random.default_rng(0).standard_normal((2, 1, 8 * heads)).astype(np.float32)
    kernel = mhagen.build(layer, target, batch=2, seq_len=1, weights=w, fuse=False)
    assert_close(kernel(x), layer.reference(x, w))


# -- invalid configurations ------------------------------------------------------------------
def raised_by_mhagen(excinfo) -> bool:
    """The exception comes from a `raise` statement in mhagen's own code (not a Python
    builtin failing inside it, such as a bad slice or a negative shift)."""
    tb = excinfo.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
    return f"{os.sep}mhagen{os.sep}" in code.co_filename and line.startswith("raise")


BAD_SIZES = st.one_of(st.integers(-5, 0), st.just(True), st.just(False),
                      st.floats(0.5, 64.0), st.just("8"), st.just(None), st.just(8.0))
BUILDER_ERRORS = (mhagen.MhagenError, TypeError, ValueError)


@st.composite
def bad_layer_options(draw):
    """(a thunk calling mha() with one invalid option, its description)."""
    heads = draw(st.integers(1, 8))
    base = dict(d_model=heads * 8, num_heads=heads)
    kind = draw(st.sampled_from(["size", "indivisible", "kv_heads", "mask", "score_mod",
                                 "rotary"]))
    if kind == "size":
        name = draw(st.sampled_from(["d_model", "num_heads", "head_dim", "kv_heads",
                                     "kv_cache"]))
        value = draw(BAD_SIZES.filter(lambda v: v is not None
                                      or name in ("d_model", "num_heads")))
        base[name] = value
    elif kind == "indivisible":
        base["d_model"] = heads * 8 + draw(st.integers(1, heads - 1)) if heads > 1 else 0
    elif kind == "kv_heads":
        base["kv_heads"] = draw(st.integers(1, 16).filter(lambda k: heads % k))
    elif kind == "mask":
        base["mask"] = draw(st.sampled_from([
            ex.score > 0, ex.q_idx < 2.5, ex.kv_idx * 0.5 <= ex.q_idx, ex.q_idx - ex.kv_idx,
            ex.q_idx, 3, True, "causal", ex.softcap(3.0), (ex.q_idx / 2) < ex.kv_idx,
            ex.where(ex.q_idx < 3, ex.q_idx, ex.kv_idx) < 2,
            ex.table([1.0, 2.0], ex.head) > 1, ex.tanh(ex.q_idx) > 0,
            (ex.q_idx < 3) & (ex.score < 1), lambda b, h, q, k: q >= k]))
    elif kind == "score_mod":
        base["score_mod"] = draw(st.sampled_from([
            ex.score > 0, ex.causal(), 2.0, 1, "softcap", lambda s: s,
            [ex.alibi(heads), ex.q_idx < 3], [ex.score, "x"], (ex.score > 1,),
            [None], {"softcap": 3.0}, ex.alibi(heads + 1),
            ex.score + ex.table([0.5] * (heads + 2), ex.head),
            ex.relative_bias([[0.0] * 8] * (heads + 1), max_distance=9)]
            + ([ex.alibi(heads - 1)] if heads > 1 else [])))
    else:
        base["head_dim"] = hd = draw(st.sampled_from(HEAD_DIMS))
        base["d_model"] = heads * hd
        rd = draw(st.one_of(st.integers(-4, 1), st.integers(1, 40).map(lambda i: 2 * i + 1),
                            st.integers(hd // 2 + 1, hd + 20).map(lambda i: 2 * i),
                            st.just(2.0), st.just(True), st.just("4")))
        rbase = draw(st.sampled_from([1.0, 0.5, -3.0, 0, True, float("nan"), "1e4", None]))
        base["rotary"] = draw(st.sampled_from(
            [lambda: mhagen.rotary(rotary_dim=rd), lambda: ex.causal(), lambda: 1,
             lambda: "rope", lambda: {"rotary_dim": 4}, lambda: mhagen.rotary(base=rbase),
             lambda: mhagen.ir.Rotary(rotary_dim=rd), lambda: mhagen.ir.Rotary(base=rbase)]))
        return (lambda: mhagen.mha(**{**base, "rotary": base["rotary"]()})), f"rotary {rd!r}"
    return (lambda: mhagen.mha(**base)), repr(base)


@CHEAP
@given(case=bad_layer_options())
def test_invalid_layer_options_raise_graph_errors(case):
    make, what = case
    with pytest.raises(mhagen.MhagenError) as e:
        make()
    assert str(e.value).strip() and raised_by_mhagen(e), what


BAD_BUILDERS = [
    lambda: ex.sliding_window(0), lambda: ex.sliding_window(-4), lambda: ex.sliding_window("w"),
    lambda: ex.sliding_window(None), lambda: ex.sliding_window(2.5),
    lambda: ex.sliding_window(True), lambda: ex.sliding_window(float("nan")),
    lambda: ex.softcap(0), lambda: ex.softcap(-2.0), lambda: ex.softcap(float("nan")),
    lambda: ex.softcap(float("inf")), lambda: ex.softcap("30"), lambda: ex.softcap(None),
    lambda: ex.softcap(True),
    lambda: ex.alibi(0), lambda: ex.alibi(-2), lambda: ex.alibi(2.5), lambda: ex.alibi(True),
    lambda: ex.alibi("8"), lambda: ex.alibi(None),
    lambda: ex.table([], ex.head), lambda: ex.table([1.0], ex.score),
    lambda: ex.table([1.0], ex.q_idx * 0.5), lambda: ex.table(["a"], ex.head),
    lambda: ex.table([float("nan")], ex.head), lambda: ex.table(3.0, ex.head),
    lambda: ex.q_idx & 3, lambda: ex.q_idx | ex.kv_idx, lambda: ex.q_idx < "a",
    lambda: ex.q_idx < None, lambda: ex.Const(True), lambda: ex.Var("seq"),
    lambda: ex.where(ex.q_idx, 1.0, 2.0), lambda: bool(ex.causal()),
    lambda: ex.causal() and ex.q_idx, lambda: ex.combine(ex.causal()),
    lambda: ex.combine(3.0), lambda: ex.q_idx + float("nan") < 2,
    lambda: ex.score * float("nan"), lambda: ex.table([0.0, True], ex.head),
    lambda: ex.table("ab", ex.head),
    lambda: ex.from_json({"op": "**", "args": [{"var": "q_idx"}, {"const": 2}]}),
    lambda: ex.from_json({"call": "tanh", "args": []}), lambda: ex.from_json([1]),
]


@CHEAP
@given(make=st.sampled_from(BAD_BUILDERS))
def test_invalid_expression_builders_raise_documented_errors(make):
    with pytest.raises(BUILDER_ERRORS) as e:
        make()
    assert str(e.value).strip() and raised_by_mhagen(e)


@CHEAP
@given(kind=st.sampled_from(["batch", "seq_len", "target", "layer"]),
       value=st.one_of(st.integers(-3, 0), st.just(True), st.just(2.0), st.just("2"),
                       st.just(None), st.just("x86-avx3"), st.just(""), st.just(7)))
def test_invalid_build_options_raise_before_compiling(kind, value):
    layer = mhagen.mha(32, 4)
    opts = {"batch": 1, "seq_len": 8, "target": "x86-avx2"}
    if kind == "layer":
        args = (value,)
    else:
        opts[kind] = value
        args = (layer,)
        if kind == "target" and value in ("x86-avx2",):
            return
        if kind in ("batch", "seq_len") and value == 7:
            return          # valid
        if kind == "target" and value == 7:
            pass
    target = opts.pop("target")
    with pytest.raises(mhagen.MhagenError) as e:
        mhagen.build(*args, target, **opts)
    assert str(e.value).strip() and raised_by_mhagen(e)


class Small(tuple):
    def __repr__(self):
        return "<mha(32, 4, kv_heads=2, causal=True) built for [2, 5]>"


@pytest.fixture(scope="module")
def small_module():
    """One small built module to call with bad inputs (bad calls do not change it)."""
    layer = mhagen.mha(32, 4, kv_heads=2, causal=True)
    w = layer.init_weights(0)
    return Small((layer, w, mhagen.build(layer, "x86-avx2", batch=2, seq_len=5, weights=w)))


GOOD_X = np.zeros((2, 5, 32), np.float32)
BAD_X = [np.zeros((2, 5, 31), np.float32), np.zeros((5, 32), np.float32),
         np.zeros((1, 2, 5, 32), np.float32), GOOD_X.astype(bool),
         GOOD_X.astype(object), GOOD_X.astype(np.complex64), None, "x", 3.0, np.float32(1.0),
         [[["a"] * 32] * 5] * 2]
# The reference takes any float array of any [batch, seq]; a module only its own float32 shape.
BAD_FOR_A_MODULE = [np.zeros((2, 6, 32), np.float32), np.zeros((3, 5, 32), np.float32),
                    np.zeros((1, 5, 32), np.float32), np.zeros((0, 5, 32), np.float32),
                    np.zeros((2, 0, 32), np.float32)]
# Converted for x (the input policy, mhagen/inputs.py), refused where a call writes in place.
_X = np.random.default_rng(0).uniform(-3, 3, GOOD_X.shape).astype(np.float32)
CONVERTED_X = [_X.astype(np.int32), _X.astype(np.float64), _X.astype(np.float16),
               _X.astype(">f4"), _X.tolist()]


@st.composite
def bad_weights(draw):
    w = mhagen.mha(32, 4, kv_heads=2, causal=True).init_weights(0)
    name = draw(st.sampled_from(sorted(w)))
    kind = draw(st.sampled_from(["missing", "extra", "renamed", "shape", "transposed", "nan",
                                 "inf", "not-array", "not-dict", "complex", "scalar"]))
    if kind == "missing":
        del w[name]
    elif kind == "extra":
        w["w_x"] = w[name]
    elif kind == "renamed":
        w[name.upper()] = w.pop(name)
    elif kind == "shape":
        w[name] = np.zeros(w[name].shape + (1,), np.float32)
    elif kind == "transposed":
        if w[name].ndim < 2 or w[name].shape == w[name].T.shape:
            w[name] = w[name][..., :-1]
        else:
            w[name] = w[name].T
    elif kind in ("nan", "inf"):
        w[name] = w[name].copy()
        w[name].flat[draw(st.integers(0, w[name].size - 1))] = np.nan if kind == "nan" else -np.inf
    elif kind == "not-array":
        w[name] = "weights"
    elif kind == "complex":
        w[name] = w[name].astype(np.complex64)
    elif kind == "scalar":
        w[name] = np.float32(1.0)
    else:
        return draw(st.sampled_from([[], {}, list(w.values()), "w", 3]))
    return w


@CHEAP
@given(i=st.integers(0, len(CONVERTED_X) - 1))
def test_converted_inputs_compute_as_float32_and_are_refused_as_out(small_module, i):
    layer, w, kernel = small_module
    x = CONVERTED_X[i]
    assert_close(kernel(x), layer.reference(np.asarray(x, np.float64), w))
    with pytest.raises(mhagen.InputError) as e:
        kernel(GOOD_X, out=x)
    assert str(e.value).strip() and raised_by_mhagen(e)


@CHEAP
@given(i=st.integers(0, len(BAD_X) + len(BAD_FOR_A_MODULE) - 1))
def test_bad_inputs_at_call_time_raise_input_errors(small_module, i):
    layer, w, kernel = small_module
    x = (BAD_X + BAD_FOR_A_MODULE)[i]
    calls = [lambda: kernel(x), lambda: kernel(x, weights=w)]
    if x is not None:        # out=None is the default
        calls.append(lambda: kernel(GOOD_X, out=x))
    if i < len(BAD_X):
        calls.append(lambda: layer.reference(x, w))
    for call in calls:
        with pytest.raises(mhagen.MhagenError) as e:
            call()
        assert str(e.value).strip() and raised_by_mhagen(e)


@CHEAP
@given(w=bad_weights(), where=st.sampled_from(["call", "reference", "bind", "build"]))
def test_bad_weights_raise_input_errors(small_module, w, where):
    layer, good, kernel = small_module
    x = np.zeros((2, 5, 32), np.float32)
    if where == "build" and not isinstance(w, dict):
        return
    call = {"call": lambda: kernel(x, weights=w), "reference": lambda: layer.reference(x, w),
            "bind": lambda: kernel.bind(w)}.get(where)
    if where == "build":
        from mhagen.weights import check_weights
        call = lambda: check_weights(layer, w)          # what build(weights=) checks first
    with pytest.raises(mhagen.MhagenError) as e:
        call()
    assert str(e.value).strip() and raised_by_mhagen(e)
    assert_close(kernel(x), layer.reference(x, good))   # a refused call changes nothing


# -- NaN / Inf isolation ---------------------------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_input_stays_in_its_batch_element(fuse):
    """A NaN/Inf in one token of batch element 1 leaves elements 0 and 2 exact. Found: inside
    element 1 every row becomes NaN, also the causal rows before the bad token, in the
    reference as in the kernels (fused and unfused): a hidden key gets probability 0, and
    0 * NaN (its value row) is NaN in P @ V. Documented here, not hidden."""
    layer = mhagen.mha(64, 4, kv_heads=2, causal=True, score_mod=mhagen.alibi(4), rotary=True)
    w = layer.init_weights(0)
    batch, seq = 3, 37
    kernel = mhagen.build(layer, TARGETS[-1], batch=batch, seq_len=seq, weights=w, fuse=fuse)
    clean = [0, 2]
    for poison in (np.nan, np.inf, -np.inf):
        x = np.random.default_rng(1).standard_normal((batch, seq, 64)).astype(np.float32)
        x[1, 20, 5] = poison
        y = kernel(x)
        assert_close(y[clean], layer.reference(x[clean], w))
        assert not np.isfinite(y[1, 20]).all()            # the bad token is not hidden
        assert not np.isfinite(layer.reference(x[1:2], w)[0, :20]).any()   # see docstring


# -- regressions: cases the fuzzers found, fixed in mhagen/ir/expr.py and mhagen/dsl.py --------
@pytest.mark.parametrize("make, error, words", [
    (lambda: ex.alibi(0), ValueError, "num_heads"),            # was: "negative shift count"
    (lambda: ex.alibi(-2), ValueError, "num_heads"),           # was: accepted, one slope
    (lambda: ex.alibi(2.5), TypeError, "num_heads"),           # was: bad slice indices
    (lambda: ex.sliding_window(2.5), TypeError, "window"),     # was: silently window 2
    (lambda: ex.sliding_window("w"), TypeError, "window"),     # was: int() ValueError
    (lambda: ex.softcap(float("inf")), ValueError, "positive cap"),  # was: inf * tanh(0) = NaN scores
    (lambda: ex.softcap("30"), TypeError, "softcap"),          # was: '>' not supported
    (lambda: ex.table([float("nan")], ex.head), ValueError, "NaN"),   # was: NaN scores
    (lambda: ex.score * float("nan"), ValueError, "NaN"),      # was: NaN scores
    (lambda: mhagen.mha(32, 4, score_mod=[mhagen.alibi(4), mhagen.q_idx < 3]),
     mhagen.GraphError, "score_mod"),                          # was: TypeError from combine()
    (lambda: mhagen.mha(32, 4, rotary=mhagen.ir.Rotary(base=None)), mhagen.GraphError, "base"),
    (lambda: mhagen.mha(32, 4, rotary=mhagen.ir.Rotary(base="1e4")), mhagen.GraphError, "base"),
    (lambda: mhagen.mha(32, 4, bias="no"), mhagen.GraphError, "bias"),    # was: bias on
    (lambda: mhagen.mha(32, 4, causal="yes"), mhagen.GraphError, "causal"),
], ids=["alibi-0", "alibi-negative", "alibi-float", "window-float", "window-str",
        "softcap-inf", "softcap-str", "table-nan", "const-nan", "score_mod-list-of-mask",
        "Rotary-base-None", "Rotary-base-str", "bias-str", "causal-str"])
def test_regressions_found_by_fuzzing(make, error, words):
    with pytest.raises(error, match=words) as e:
        make()
    assert raised_by_mhagen(e)
