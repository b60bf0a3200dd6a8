"""The paged K/V cache (mhagen.PagedKVCache): the pool's block manager against a model of it
(allocation, fork with shared blocks, copy-on-write, free, truncate), and modules built
with kv_block_size= (keys read through the block table) against the float64 reference and
the contiguous cache."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mhagen
from mhagen import PagedKVCache
from mhagen.tolerances import assert_close

from decode_modules import (LAYER, MAX_LEN, W, packed_module, paged_module, paged_step_module,
                            reference_cache)

# -- the pool alone ----------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "append", "append", "fork", "free",
                                          "truncate"]),
                         st.integers(0, 7), st.integers(0, 9)), max_size=40)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_pool_operations_match_a_model_of_it(ops):
    """A stream of add / append / fork / free / truncate on a pool of 10 blocks of 4, each
    appended token a distinct marker written through the block table: after every step each
    sequence reads back exactly its own tokens (a block shared wrongly, or written while
    shared, would show another sequence's), every block's count is the number of sequences
    holding it, the free blocks are exactly the unheld ones (none leaked), and an append the
    pool has no room for is refused with the pool unchanged."""
    pool = PagedKVCache(10, 4, kv_heads=1, head_dim=1, max_len=16, dtype=np.float64)
    model = {}         # sequence id -> its tokens' markers
    marker = 0.0
    for op, pick, n in ops:
        seqs = sorted(model)
        seq = seqs[pick % len(seqs)] if seqs else None
        if op == "add" or seq is None:
            model[pool.add()] = []
        elif op == "fork":
            model[pool.fork(seq)] = list(model[seq])
        elif op == "free":
            pool.free(seq)
            del model[seq]
        elif op == "truncate":
            keep = n % (len(model[seq]) + 1)
            pool.truncate(seq, keep)
            del model[seq][keep:]
        else:
            held = len(model[seq])
            need = (-(-(held + n) // 4) - len(pool.blocks(seq))
                    + sum(pool.refcount(b) > 1 for b in pool.blocks(seq)[held // 4:]) * (n > 0))
            before = (pool.free_blocks, {s: pool.blocks(s) for s in model}, pool.k.copy())
            if held + n > 16 or need > pool.free_blocks:
                with pytest.raises(mhagen.InputError, match="max_len|free blocks"):
                    pool.reserve([seq], [n])
                assert (pool.free_blocks, {s: pool.blocks(s) for s in model}) == before[:2]
                np.testing.assert_array_equal(pool.k, before[2])
                continue
            pool.reserve([seq], [n])
            rows = marker + 1 + np.arange(n, dtype=np.float64)
            marker += n
            pool.write(seq, held, rows.reshape(1, n, 1), -rows.reshape(1, n, 1))
            pool.advance([seq], [n])
            model[seq] += rows.tolist()
        pool.check()
        held_blocks = {b for s in model for b in pool.blocks(s)}
        assert pool.used_blocks == len(held_blocks)
        if model:
            got = pool.to_contiguous(sorted(model))
            for row, s in enumerate(sorted(model)):
                assert pool.lens(s) == len(model[s])
                np.testing.assert_array_equal(got.k[row, 0, :len(model[s]), 0], model[s])
                np.testing.assert_array_equal(got.v[row, 0, :len(model[s]), 0],
                                              -np.asarray(model[s]))


def test_fork_shares_blocks_and_copies_the_one_it_writes():
    """A fork shares every block (counts 2, no copy); the parent's next token lands in the
    partly filled shared block, which it copies first (copy-on-write: the child keeps the
    original); whole blocks stay shared; freeing both returns every block."""
    pool = PagedKVCache(8, 16, kv_heads=2, head_dim=3, max_len=64, dtype=np.float64)
    a = pool.add()
    pool.reserve([a], [20])
    pool.write(a, 0, np.ones((2, 20, 3)), np.ones((2, 20, 3)))
    pool.advance([a], [20])
    b = pool.fork(a)
    assert pool.blocks(a) == pool.blocks(b) and pool.used_blocks == 2
    assert [pool.refcount(x) for x in pool.blocks(a)] == [2, 2]
    pool.reserve([a], [1])
    assert pool.blocks(a)[0] == pool.blocks(b)[0] and pool.blocks(a)[1] != pool.blocks(b)[1]
    np.testing.assert_array_equal(pool.k[pool.blocks(a)[1]], pool.k[pool.blocks(b)[1]])
    assert pool.used_blocks == 3
    pool.free(a)
    pool.free(b)
    assert pool.free_blocks == 8
    pool.check()


# -- modules reading it ----------------------------------------------------------------------

def shuffled_pool(module, num_blocks, dtype=None, seed=0):
    """A pool whose free blocks come out in a random order (made and freed one-block
    sequences), and the same for the reference (float64)."""
    pools = []
    for kind in (module, LAYER):
        pool = PagedKVCache.for_module(kind, num_blocks, block_size=16,
                                       dtype=None if kind is module else np.float64)
        held = [pool.add() for _ in range(num_blocks)]
        pool.reserve(held, [1] * num_blocks)
        for s in np.random.default_rng(seed).permutation(held):
            pool.free(int(s))
        pools.append(pool)
    return pools


def test_paged_calls_match_the_reference_and_the_contiguous_cache():
    """Three sequences in a shuffled pool: a 20-token prompt, a fork of it (a shared
    prefix, then copy-on-write), a 5-token prompt; then calls mixing a prompt's chunk, single
    tokens and speculative ones. Each call equals the float64 reference (fed the same pool
    operations) and the contiguous cache's module fed the same tokens (its rows holding the
    same sequences); the pool then holds what the contiguous cache holds."""
    m, contiguous = paged_module(), packed_module()
    pool, ref = shuffled_pool(m, 12)
    cache = contiguous.new_cache()     # rows 0-2: a, its fork, c; row 3 unused
    rng = np.random.default_rng(5)
    a, ra = pool.add(), ref.add()
    x = rng.standard_normal((1, 20, 64)).astype(np.float32)
    assert_close(m(x, cache=pool, seqs=[a], cu_seqlens=[0, 20]),
                 LAYER.reference(x, W, cache=ref, seqs=[ra], cu_seqlens=[0, 20]))
    cache.k[1], cache.v[1] = pool.to_contiguous([a]).k[0], pool.to_contiguous([a]).v[0]
    cache.lens[1] = 20
    contiguous(x[:, :12], cache=cache, cu_seqlens=[0, 12, 12, 12, 12])
    contiguous(x[:, 12:], cache=cache, cu_seqlens=[0, 8, 8, 8, 8])
    b, rb = pool.fork(a), ref.fork(ra)
    c, rc = pool.add(), ref.add()
    assert pool.blocks(a) == pool.blocks(b)
    for counts in ([1, 3, 5], [2, 1, 1], [1, 1, 4], [0, 2, 1]):
        cu = np.concatenate([[0], np.cumsum(counts)]).tolist()
        x = rng.standard_normal((1, cu[-1], 64)).astype(np.float32)
        y = m(x, cache=pool, seqs=[a, b, c], cu_seqlens=cu)
        assert_close(y, LAYER.reference(x, W, cache=ref, seqs=[ra, rb, rc], cu_seqlens=cu))
        assert_close(y, contiguous(x, cache=cache, cu_seqlens=cu + [cu[-1]]))
    pool.check()
    assert [pool.lens(s) for s in (a, b, c)] == cache.lens[:3].tolist() == [24, 27, 11]
    assert pool.blocks(a)[0] == pool.blocks(b)[0] and pool.blocks(a)[1] != pool.blocks(b)[1]
    held = pool.to_contiguous([a, b, c])
    for name in ("k", "v"):
        got, want = getattr(held, name), getattr(cache, name)[:3]
        for row, n in enumerate(held.lens):
            assert_close(got[row, :, :n], want[row, :, :n])
        assert_close(got, getattr(ref.to_contiguous([ra, rb, rc]), name))


def test_paged_steps_of_a_fixed_shape_module_match_the_reference():
    """A module of 2 sequences x 1 new token (the template's lanes along head_dim): two
    sequences, one forked from a prompt already 17 tokens in, 4 steps; then the pool's
    sequences in the other order."""
    m = paged_step_module()
    pool, ref = shuffled_pool(m, 8, seed=1)
    p, rp = pool.add(), ref.add()
    x = np.random.default_rng(6).standard_normal((1, 17, 64)).astype(np.float32)
    pool.reserve([p], [17])
    ref.reserve([rp], [17])
    for target, seq in ((pool, p), (ref, rp)):   # the prompt's K/V rows, as the reference has them
        row = mhagen.KVCache.empty(LAYER, 1, np.float64)
        LAYER.reference(x, W, cache=row)
        target.write(seq, 0, row.k[0, :, :17], row.v[0, :, :17])
        target.advance([seq], [17])
    q, rq = pool.fork(p), ref.fork(rp)
    rng = np.random.default_rng(7)
    for order in ([p, q], [p, q], [q, p], [q, p]):
        refs = [rp if s == p else rq for s in order]
        x = rng.standard_normal((2, 1, 64)).astype(np.float32)
        assert_close(m(x, cache=pool, seqs=order), LAYER.reference(x, W, cache=ref, seqs=refs))
    assert [pool.lens(p), pool.lens(q)] == [21, 21]
    assert_close(pool.to_contiguous([p, q]).k, ref.to_contiguous([rp, rq]).k)


def test_prepared_paged_call_reserves_each_step():
    """prepare() with a paged cache: every run makes room first (a new block at the 17th
    token of a sequence), then writes; equals the reference calls."""
    m = paged_module()
    pool, ref = shuffled_pool(m, 6, seed=2)
    seqs, refs = [pool.add(), pool.add()], [ref.add(), ref.add()]
    x = mhagen.aligned_empty((2, 6, 64), "float32")
    run = m.prepare(x, cache=pool, seqs=seqs)
    rng = np.random.default_rng(8)
    for _ in range(3):
        x[...] = rng.standard_normal(x.shape)
        assert_close(run(), LAYER.reference(x, W, cache=ref, seqs=refs))
    assert [len(pool.blocks(s)) for s in seqs] == [2, 2] and pool.free_blocks == 2


def state(pool, seqs):
    return ({s: (pool.lens(s), pool.blocks(s)) for s in seqs}, pool.free_blocks,
            pool.k.copy(), pool.v.copy())


def same_state(a, b):
    assert a[:2] == b[:2]
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_array_equal(a[3], b[3])


@pytest.mark.parametrize("case", ["full-pool", "past-max-len", "unknown-seq", "twice",
                                  "too-many-seqs", "no-seqs", "contiguous-cache",
                                  "cu-on-fixed-module"])
def test_bad_paged_calls_are_refused_before_anything_is_written(case):
    m = paged_step_module() if case == "cu-on-fixed-module" else paged_module()
    pool = m.new_paged_cache(4)
    seqs = [pool.add(), pool.add()]
    pool.reserve(seqs, [32, 15])          # 3 of the 4 blocks
    pool.advance(seqs, [32, 15])
    x, kw = np.ones((1, 4, 64), np.float32), dict(cache=pool, seqs=seqs, cu_seqlens=[0, 2, 4])
    message = {"full-pool": "1 free blocks of 4; this call needs 2",
               "past-max-len": "holds 32 tokens; 20 new ones",
               "unknown-seq": "7 is not a sequence", "twice": "lists a sequence twice",
               "too-many-seqs": "runs 1..4 a call", "no-seqs": "seqs=",
               "contiguous-cache": "kv_block_size=16", "cu-on-fixed-module": "seq_len=None"}
    if case == "past-max-len":    # (full-pool: 2 tokens each cross into new blocks: 2 needed)
        x, kw["cu_seqlens"] = np.ones((1, 20, 64), np.float32), [0, 20, 20]
    elif case == "unknown-seq":
        kw["seqs"] = [seqs[0], 7]
    elif case == "twice":
        kw["seqs"] = [seqs[0], seqs[0]]
    elif case == "too-many-seqs":
        kw["seqs"] = [pool.add() for _ in range(5)]
        kw["cu_seqlens"] = [0] * 5 + [4]
    elif case == "no-seqs":
        kw["seqs"] = None
    elif case == "contiguous-cache":
        kw = dict(cache=mhagen.KVCache.empty(m, 4), cu_seqlens=[0, 1, 2, 3, 4])
    before = state(pool, seqs)
    with pytest.raises(mhagen.InputError, match=message[case]):
        m(x, **kw)
    same_state(state(pool, seqs), before)


def test_paged_build_options_are_checked():
    with pytest.raises(mhagen.GraphError, match="multiple of 16"):
        mhagen.build(LAYER, "x86", batch=1, seq_len=1, kv_block_size=24)
    with pytest.raises(mhagen.GraphError, match="decoding layer"):
        mhagen.build(mhagen.mha(64, 4), "x86", batch=1, seq_len=1, kv_block_size=16)
    with pytest.raises(mhagen.InputError, match="module.new_paged_cache"):
        paged_module().new_cache()
    with pytest.raises(mhagen.InputError, match="block_size=16 differs|blocks of 16"):
        PagedKVCache.for_module(paged_module(), 4, block_size=32)
    assert paged_module().new_paged_cache(3).k.shape == (3, 2, 16, 24)
    assert MAX_LEN == paged_module().new_paged_cache(3).max_len
    assert reference_cache  # (shared helper, used above through the contiguous module)


@pytest.mark.slow
def test_c_api_runs_a_paged_call_as_python_does(tmp_path):
    """mha_run_paged of the saved module with the block tables Python's pool holds (the
    caller's allocation: shuffled blocks, a fork sharing a prefix, copy-on-write done by
    reserve) gives the same bits as the Python call; a table entry outside the pool is
    refused with nothing written or advanced."""
    from decode_modules import c_driver, run_c_call
    m = paged_module()
    artifact, exe = c_driver(m, tmp_path)
    assert "#define MHA_KV_BLOCK_SIZE 16" in (artifact / "mha.h").read_text()
    pool, _ = shuffled_pool(m, 8, seed=3)
    rng = np.random.default_rng(10)
    a = pool.add()
    m(rng.standard_normal((1, 20, 64)).astype(np.float32), cache=pool, seqs=[a],
      cu_seqlens=[0, 20])
    b = pool.fork(a)
    seqs, cu = [a, b], np.array([0, 3, 4], np.int32)
    pool.reserve(seqs, np.diff(cu))     # what the caller's block manager does first
    tables = np.zeros((2, pool.max_blocks), np.int32)
    for row, s in enumerate(seqs):
        tables[row, :len(pool.blocks(s))] = pool.blocks(s)
    lens = np.array([pool.lens(s) for s in seqs], np.int32)
    x = rng.standard_normal((1, 4, 64)).astype(np.float32)
    arrays = dict(x=x, cu=cu, lens=lens, k=pool.k, v=pool.v, tables=tables)
    status, message, out = run_c_call(artifact, exe, tmp_path / "ok", arrays, (2, 4, 8))
    assert status == "MHA_OK", message
    expected = m(x, cache=pool, seqs=seqs, cu_seqlens=cu)
    np.testing.assert_array_equal(np.frombuffer(out["y"], np.float32), expected.reshape(-1))
    np.testing.assert_array_equal(np.frombuffer(out["k.out"], np.float32), pool.k.reshape(-1))
    assert np.frombuffer(out["lens.out"], np.int32).tolist() == [23, 21]
    outside = tables.copy()
    outside[1, 1] = 8
    status, message, out = run_c_call(artifact, exe, tmp_path / "bad",
                                      dict(arrays, tables=outside), (2, 4, 8))
    assert status == "MHA_ERR_ARGUMENT" and "block_tables[1][1] = 8" in message, message
    assert out["k.out"] == np.ascontiguousarray(arrays["k"]).tobytes()
    assert out["lens.out"] == lens.tobytes()


def test_saved_paged_module_loads_and_decodes_the_same(tmp_path):
    """A paged module saved (no C API) and loaded with mhagen.load keeps its block size and
    answers a packed call on a pool with the same bits."""
    m = paged_module()
    loaded = mhagen.load(m.save(tmp_path / "paged", c_api=False))
    assert loaded.kv_block_size == 16 and loaded._packed
    x = np.random.default_rng(11).standard_normal((1, 5, 64)).astype(np.float32)
    outs = []
    for module in (m, loaded):
        pool = module.new_paged_cache(4)
        seqs = [pool.add(), pool.add()]
        outs.append(module(x, cache=pool, seqs=seqs, cu_seqlens=[0, 4, 5]))
    np.testing.assert_array_equal(outs[0], outs[1])
