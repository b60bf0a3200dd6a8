"""Tuning a decoding layer's packed (seq_len=None) and paged (kv_block_size=) builds: the
decode template's sweep on the call those builds run (cu_seqlens, a shuffled pool), records
keyed apart from the fixed, contiguous build's, a kept config checked against the default's
output first, and a build of that form using its record and staying right."""
import numpy as np
import pytest

import mhagen
import mhagen.tuning.search as search
from mhagen.lower import lower
from mhagen.records.database import Database, Tuning, TuningWarning, workload_key
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from mhagen.tuning.search import tune

LAYER = dict(d_model=64, num_heads=4, kv_heads=2, causal=True, kv_cache=96)
BATCH, MOST, BLOCK = 2, 4, 32     # 2 rows of up to 4 new tokens; pool blocks of 32 tokens
FORM = dict(packed=True, kv_block_size=BLOCK)


def _faster_second(calls):
    """A _measure that says candidate 1 is 20% faster than the default, in the sweep and in
    the second look (so the sweep keeps it if its output matches); records the arguments."""
    def measure(funcs, target, remote, fixed=None, errors=None):
        calls.append(fixed)
        return [1e-3, 0.8e-3] + [2e-3] * (len(funcs) - 2)
    return measure


def _paged_call(module, layer, w, counts, seed):
    """A call of the module (packed: `counts` new tokens a row; None: one each) on a pool
    whose blocks are handed out shuffled, and the float64 reference of the same call on a
    pool of the same tables."""
    rng = np.random.default_rng(seed)
    pools = [module.new_paged_cache(12),
             mhagen.PagedKVCache.for_module(layer, 12, block_size=module.kv_block_size,
                                            dtype=np.float64)]
    order = rng.permutation(12)
    for pool in pools:            # the same shuffled free list in both
        held = [pool.add() for _ in range(12)]
        pool.reserve(held, [1] * 12)
        for s in order:
            pool.free(held[s])
    seqs = [[p.add() for _ in range(BATCH)] for p in pools]
    past = [70, 7]
    k = rng.standard_normal((BATCH, 2, 96, 16))
    v = rng.standard_normal((BATCH, 2, 96, 16))
    for pool, ids in zip(pools, seqs):
        for b, (seq, n) in enumerate(zip(ids, past)):
            pool.reserve([seq], [n])
            pool.write(seq, 0, k[b, :, :n], v[b, :, :n])
            pool.advance([seq], [n])
    first = pools[0].blocks(seqs[0][0])
    assert first != list(range(first[0], first[0] + len(first)))     # scattered
    if counts is None:
        x = rng.standard_normal((BATCH, 1, 64)).astype(np.float32)
        return (module(x, cache=pools[0], seqs=seqs[0]),
                layer.reference(x, w, cache=pools[1], seqs=seqs[1]))
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((1, int(cu[-1]), 64)).astype(np.float32)
    y = module(x, cache=pools[0], seqs=seqs[0], cu_seqlens=cu)
    return y, layer.reference(x, w, cache=pools[1], seqs=seqs[1], cu_seqlens=cu)


def test_a_packed_paged_build_is_tuned_on_its_own_call_and_uses_its_record(tmp_path,
                                                                             monkeypatch):
    """tune(..., packed=True, kv_block_size=32) sweeps the decode template of that build (key
    blocks dividing the pool's blocks) on a call of every row adding max_seq_len tokens on a
    full, shuffled pool; keeps the faster config after checking its output; records it
    under a key that says packed and kv_block_size; the build of that form uses it and
    matches the reference, and neither the fixed nor the contiguous build sees it."""
    layer = mhagen.mha(**LAYER)
    calls = []
    monkeypatch.setattr(search, "_measure", _faster_second(calls))
    checked = []
    real_check = search._wrong_result

    def spy_check(funcs, t, fixed=None, rows=None, remote=None):
        why = real_check(funcs, t, fixed, rows=rows, remote=remote)
        checked.append(why)
        return why
    monkeypatch.setattr(search, "_wrong_result", spy_check)
    db = tmp_path / "db.json"
    report = tune(layer, shapes=[(BATCH, MOST)], trials=2, database=db, progress=False, **FORM)
    by_kernel = {r.kernel: r for r in report.results}
    assert (by_kernel["attention"].method, by_kernel["attention"].kept) == ("config sweep",
                                                                            "tuned")
    # a packed build's GEMMs run any length: not tunable, said so
    assert by_kernel["qkv_projection"].kept == "default (not tunable)"
    assert checked == [None]      # the kept config's output was compared, and matched

    # the sweep's call: cu_seqlens of 4 tokens a row, a full cache, a shuffled block table
    program = lower(layer, BATCH, MOST, resolve("x86"), symbolic={"batch": False, "seq": True},
                    kv_block_size=BLOCK)
    attention = next(k for k in program.kernels if k.name == "attention")
    args = {attention.args[i]: a for i, a in calls[0][0].items()}
    assert args["cu_seqlens"].tolist() == [0, 4, 8]
    assert args["cache_lens"].tolist() == [92, 92]
    tables = args["block_tables"]
    assert tables.shape == (BATCH, 3) and sorted(tables.ravel()) == list(range(6))
    assert tables.ravel().tolist() != list(range(6))
    t = resolve("x86")
    candidates = t.backend().decode.candidates(attention.workload, t)
    assert all(BLOCK % c.kv_block == 0 for c in candidates) and \
        {c.kv_block for c in candidates} == {16, 32}

    (record,) = Database.load(db).records.values()
    key = record["key"]
    assert (key["kernel"], key["batch"], key["seq"], key["packed"], key["kv_block_size"]) == (
        "attention", BATCH, MOST, True, BLOCK)
    assert record["kind"] == "config" and record["config"] != record["default_config"]
    tuning = Tuning([Database.load(db)])
    for other in ({}, {"packed": True}, {"kv_block_size": BLOCK}):   # other builds' keys
        assert tuning.lookup(workload_key(layer, t, BATCH, MOST, "attention", other)) is None

    w = layer.init_weights(0)
    module = mhagen.build(layer, batch=BATCH, seq_len=None, max_seq_len=MOST, weights=w,
                          kv_block_size=BLOCK, tuning=db)
    (decision,) = [d for d in module.decisions if d["kernel"] == "attention"]
    assert (decision["source"], decision["config"]) == ("tuned", record["config"])
    assert module.tuning_records == [record]
    for counts, seed in (([3, 1], 1), ([0, 4], 2)):
        y, expected = _paged_call(module, layer, w, counts, seed)
        assert_close(y, expected)

    # a record whose key blocks straddle the pool's blocks is refused, the default used
    Database(db, [{**record, "config": {**record["config"], "kv_block": 64}}]).save()
    with pytest.warns(TuningWarning, match="invalid"):
        module = mhagen.build(layer, batch=BATCH, seq_len=None, max_seq_len=MOST, weights=w,
                              kv_block_size=BLOCK, tuning=db)
    (decision,) = [d for d in module.decisions if d["kernel"] == "attention"]
    assert (decision["source"], decision["config"]) == ("default", record["default_config"])


def test_a_packed_build_of_a_contiguous_cache_is_tuned_under_its_own_key(tmp_path,
                                                                        monkeypatch):
    """packed=True alone: the call of every row adding max_seq_len tokens on a full
    contiguous cache (cu_seqlens, no block table); the kept config's output checked; the
    record says packed and no block size."""
    layer = mhagen.mha(**LAYER)
    calls = []
    monkeypatch.setattr(search, "_measure", _faster_second(calls))
    db = tmp_path / "db.json"
    tune(layer, shapes=[(BATCH, MOST)], trials=2, kernels=["attention"], database=db,
         progress=False, packed=True)
    assert sorted(a.tolist() for a in calls[0][0].values()) == [[0, 4, 8], [92, 92]]
    (record,) = Database.load(db).records.values()
    assert record["key"]["packed"] is True and "kv_block_size" not in record["key"]
    assert record["kind"] == "config" and "rejected" not in record


def test_a_config_that_answers_otherwise_on_the_pool_is_not_kept(tmp_path, monkeypatch):
    """The faster config is kept only if its output on the paged call equals the default's:
    a candidate handed another block table (each row reading the other row's blocks) is
    recorded as rejected and the record stays the default."""
    layer = mhagen.mha(**LAYER)
    monkeypatch.setattr(search, "_measure", _faster_second([]))
    real_candidate = search._candidate
    made = []

    def misread(*args):
        func, fixed = real_candidate(*args)
        made.append(fixed)
        if len(made) == 2:        # the second candidate: the rows' tables swapped
            kernel = args[6]
            at = kernel.args.index("block_tables")
            fixed[at] = np.ascontiguousarray(fixed[at][::-1])
        return func, fixed
    monkeypatch.setattr(search, "_candidate", misread)
    db = tmp_path / "db.json"
    report = tune(layer, shapes=[(BATCH, 1)], trials=2, kernels=["attention"], database=db,
                  progress=False, kv_block_size=BLOCK)
    (res,) = report.results
    (record,) = Database.load(db).records.values()
    assert res.kept == "default" and record["kind"] == "default"
    assert "differs from the default" in record["rejected"]
    assert record["key"]["kv_block_size"] == BLOCK and "packed" not in record["key"]


def test_tiles_across_the_heads_read_a_whole_pool_block_a_key_block_by_default():
    """A decode step on a paged cache whose row tiles run across the K/V heads takes key
    blocks of the whole pool block by default (a part of it read every head's rows a
    stride apart: 2.2x slower at blocks of 32 and 64), and stays right on a shuffled pool
    (a sequence of 70 tokens ends inside its second block of 64, the other one's 7)."""
    layer = mhagen.mha(**LAYER)
    w = layer.init_weights(0)
    module = mhagen.build(layer, batch=BATCH, seq_len=1, weights=w, kv_block_size=64,
                          tuning=None)
    (decision,) = [d for d in module.decisions if d["kernel"] == "attention"]
    assert decision["config"]["kv_block"] == 64 and decision["config"]["row_tile"] == 4
    for seed in (3, 4):
        y, expected = _paged_call(module, layer, w, None, seed)
        assert_close(y, expected)


def test_tuning_a_packed_or_paged_build_of_a_layer_without_one_is_refused(tmp_path):
    db = tmp_path / "db.json"
    with pytest.raises(mhagen.GraphError, match="keeps no K/V cache"):
        tune(mhagen.mha(64, 2), shapes=[(1, 8)], database=db, progress=False, packed=True)
    with pytest.raises(mhagen.GraphError, match="multiple of 16"):
        tune(mhagen.mha(**LAYER), shapes=[(1, 1)], database=db, progress=False,
             kv_block_size=24)
    with pytest.raises(mhagen.InputError, match="packed is True"):
        tune(mhagen.mha(**LAYER), shapes=[(1, 1)], database=db, progress=False, packed="yes")
    assert not db.exists()
