"""x86 attention tiles per CPU class: key blocks and query tiles (cut at the last key,
aligned with causal and sliding-window masks, no core idle, tasks spread evenly), the
configurations a sweep tries, and the decode template's registers."""
import dataclasses

import numpy as np
import pytest

import mhagen
from mhagen.schedules.cpu.attention import register_tiles
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from mhagen.records.database import Database, workload_key
from x86_helpers import (PRESETS, _input, RUNNABLE, _attention_config, spills_in_fma_loops,
                         function_asm, _asm_of, accumulates_in_memory)


@pytest.mark.parametrize("preset", RUNNABLE)
@pytest.mark.parametrize("head_dim", [40, 64])            # generic columns / whole K panels
@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_cut_at_the_last_key(preset, head_dim, causal, tmp_path):
    """Key blocks of two S^T tiles, and lengths whose last block holds a partial tile, one
    whole tile and one key, one key: the cut block stops at the tile holding the last key,
    only that tile clamps its key rows, P V stops at the last key (AVX2: 6-key tiles, 37 =
    3 blocks of 12 + 1; AVX-512: 8-key tiles, 37 = 2 blocks of 16 + 5)."""
    layer = mhagen.mha(4 * head_dim, 4, causal=causal)
    w = layer.init_weights(2)
    default = _attention_config(mhagen.build(layer, preset, batch=2, seq_len=8, tuning=None))
    kv_block = 2 * default.tile_rows
    lengths = (2, 37, 43, 49)
    Database(tmp_path / "db.json", [
        {"key": workload_key(layer, resolve(preset), 2, seq, "attention"), "kind": "config",
         "config": {**vars(default), "kv_block": kv_block}} for seq in lengths]).save()
    for seq in lengths:
        m = mhagen.build(layer, preset, batch=2, seq_len=seq, weights=w,
                         tuning=tmp_path / "db.json")
        assert _attention_config(m).kv_block == kv_block
        x = _input(2, seq, layer.inputs[0].attrs["shape"][2], seed=seq)
        assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("preset", ["x86-avx2", "x86-avx512"])
def test_a_short_sequence_has_attention_configs_to_sweep(preset):
    """At seq 32 a 64-key goal is 66 keys in AVX2's 6-row tiles, within make_config's bound
    (twice the sequence, rounded up to whole tiles); the candidates' own bound had been
    stricter, and on AVX2 hosts the sweep of a short causal layer measured the default
    alone."""
    from mhagen.schedules.cpu.attention import AttentionRule
    rule, t = AttentionRule(), resolve(preset)
    m = mhagen.build(mhagen.mha(64, 4, causal=True), t, batch=1, seq_len=32, tuning=None)
    work = next(k for k in m.program.kernels if k.name == "attention").workload
    space = rule.candidates(work, t)
    assert len(space) >= 3 and space[0] == rule.default_config(work, t)
    assert {c.kv_block for c in space[1:]} == {66 if preset == "x86-avx2" else 64}
    for c in space:
        assert rule.make_config(dataclasses.asdict(c), t, work) == c


def test_attention_query_tiles_need_not_be_whole_pv_tiles(tmp_path):
    """AVX2's 6-row P V tile does not divide query tiles of 16, 32 or 64: P V covers them in
    tiles one row apart, so seq 128 computes 128 query rows, not 144 (query tiles of 48).
    Every candidate keeps the template's constraints; 32 queries as 2 x 6 + 4 x 5 and 64 as
    9 x 6 + 2 x 5 match the reference."""
    from mhagen.schedules.cpu.attention import AttentionRule
    rule = AttentionRule()
    layer = mhagen.mha(128, 2)
    w = layer.init_weights(0)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=128, tuning=None)
    work = next(k for k in m.program.kernels if k.name == "attention").workload
    t = resolve("x86-avx2")
    default = rule.default_config(work, t)
    assert default.out_rows == 6 and 128 % default.q_tile == 0 and default.q_tile % 6
    space = rule.candidates(work, t)
    assert space[0] == default and {c.q_tile for c in space} >= {32, 64, 128}
    for c in space:
        assert rule.make_config(dataclasses.asdict(c), t, work) == c
    avx512 = resolve("x86-avx512")
    assert all(c.out_rows == 8 for c in rule.candidates(
        next(k for k in mhagen.build(layer, "x86-avx512", batch=1, seq_len=128, tuning=None)
             .program.kernels if k.name == "attention").workload, avx512))
    x = _input(1, 128, 128)
    for q_tile in (32, 64):
        c = dataclasses.replace(default, q_tile=q_tile)
        db = tmp_path / f"db{q_tile}.json"
        Database(db, [{"key": workload_key(layer, t, 1, 128, "attention"), "kind": "config",
                       "config": dataclasses.asdict(c)}]).save()
        m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=128, weights=w, tuning=db)
        assert _attention_config(m) == c
        if t.runs_here():
            assert_close(m(x), layer.reference(x, w))


def test_short_unmasked_layers_take_query_tiles_of_64_where_they_pad_no_more():
    """Default query tiles below seq 256: ~64 for an unmasked layer where that pads no more
    queries than ~32 and leaves every core 4 tasks; 32 for a masked one (causal: more
    blocks skipped); seq 97 on AVX2 keeps 16 (112 queries, not 128). Checked against the
    reference where the code runs here."""
    def q_tile(preset, seq, causal=False, cores=2, run=False):
        t = dataclasses.replace(resolve(preset), cores=cores)
        layer = mhagen.mha(512, 8, causal=causal)
        w = layer.init_weights(2)
        m = mhagen.build(layer, t, batch=1, seq_len=seq, weights=w, tuning=None)
        if run and t.runs_here():
            x = _input(1, seq, 512, seed=seq)
            assert_close(m(x), layer.reference(x, w))
        return _attention_config(m).q_tile
    assert q_tile("x86-avx2", 128, run=True) == 64
    assert q_tile("x86-avx2", 128, causal=True) == 32
    assert q_tile("x86-avx2", 97, run=True) == 16
    assert q_tile("x86-avx2", 128, cores=16) == 32      # 16 tasks of 64 queries: too few
    assert q_tile("x86-avx512", 97, run=True) == 64     # 128 queries either way
    assert q_tile("x86-avx512", 128, causal=True) == 32


def test_attention_query_tiles_leave_no_core_idle():
    """Where the (batch, head, query tile) tasks are fewer than the cores, query tiles
    shrink (to one S^T tile at least): 8 heads at seq 256 on 64 cores run 64 tasks of 32
    queries, not 32 of 64; AVX2 at seq 128 on 64 cores tiles of 16. 2 cores keep theirs.
    Checked against the reference."""
    def q_tile(preset, seq, cores, causal=False):
        t = dataclasses.replace(resolve(preset), cores=cores)
        layer = mhagen.mha(512, 8, causal=causal)
        w = layer.init_weights(6)
        m = mhagen.build(layer, t, batch=1, seq_len=seq, weights=w, tuning=None)
        if t.runs_here():
            x = _input(1, seq, 512, seed=cores)
            assert_close(m(x), layer.reference(x, w))
        return _attention_config(m).q_tile
    assert q_tile("x86-avx512", 256, 64) == 32
    assert q_tile("x86-avx512", 256, 2) == 64
    assert q_tile("x86-avx2", 128, 64, causal=True) == 16
    assert q_tile("x86-avx512", 128, 64) == 32      # one S^T tile: no smaller


def _most_blocks_a_thread(m, heads, lens, cores, tile_of):
    """The most key blocks one of `cores` threads runs in module m's attention, over an even
    share, when TVM splits its tasks into runs of consecutive ones; tile_of(task, batch,
    heads, n_q) -> (batch row, head, query tile). Blocks the table skips or that start past
    a row's key length (lens) do not count."""
    from mhagen.schedules.cpu.matmul import busiest_thread
    table = m.program.buffers["blocks"].value
    kv_block = _attention_config(m).kv_block
    batch, n_q = len(lens), table.shape[2]
    work = []
    for task in range(batch * heads * n_q):
        b, h, qt = tile_of(task, batch, heads, n_q)
        row = table[b % table.shape[0], h % table.shape[1], qt]
        work.append(sum(1 for kb, state in enumerate(row) if state and kb * kv_block < lens[b]))
    return busiest_thread(work, cores) / (sum(work) / cores)


def test_attention_tasks_spread_evenly_over_the_threads():
    """TVM hands each thread a run of consecutive attention tasks. Under a causal mask a
    head's later query tiles have more key blocks, so a head's tiles run as 0, n-1, 1, n-2,
    ...; with key lengths per call the batch row is the innermost index (task_tile). From
    the block tables of real builds: the most blocks a thread runs stays within 5% of an
    even share where the plain order (batch, head, tile) gave one thread 1.47x (1 causal
    head on 2 cores), 1.16x (3 heads on 2), 1.44x (8 heads at seq 512 on 16 cores), 1.78x
    (key lengths 512 and 64 on 2 cores); odd tile counts and lengths match the reference."""
    from mhagen.schedules.cpu.attention import task_tile

    def plain(task, batch, heads, n_q):
        return task // (heads * n_q), task // n_q % heads, task % n_q
    cases = [((64, 1, True, False), 2048, [2048], 2, 1.47),
             ((192, 3, True, False), 1024, [1024], 2, 1.15),
             ((512, 8, True, False), 512, [512], 16, 1.44),
             ((512, 8, False, True), 512, [512, 64], 2, 1.77),
             ((512, 8, True, True), 512, [512, 400, 200, 100], 2, 1.2)]
    for (d_model, heads, causal, key_padding), seq, lens, cores, before in cases:
        t = dataclasses.replace(resolve("x86-avx512"), cores=cores)
        m = mhagen.build(mhagen.mha(d_model, heads, causal=causal, key_padding=key_padding),
                         t, batch=len(lens), seq_len=seq, tuning=None)
        assert _most_blocks_a_thread(m, heads, lens, cores, lambda *a: task_tile(
            *a, batch_inner=key_padding)) <= 1.05, (d_model, heads, lens)
        assert _most_blocks_a_thread(m, heads, lens, cores, plain) >= before, (d_model, heads, lens)
    for causal, key_padding in ((True, False), (True, True)):
        layer = mhagen.mha(64, 1, causal=causal, key_padding=key_padding)
        w = layer.init_weights(5)
        for preset in PRESETS:
            m = mhagen.build(layer, preset, batch=3, seq_len=300, weights=w, tuning=None)
            assert m.program.buffers["blocks"].shape[2] % 2 == 1
            if m.target.runs_here():
                x = _input(3, 300, 64, seed=5)
                kw = {"kv_lens": np.array([300, 31, 170], np.int32)} if key_padding else {}
                assert_close(m(x, **kw), layer.reference(x, w, **kw))


@pytest.mark.parametrize("preset", PRESETS)
def test_causal_key_blocks_align_with_the_query_tiles(preset):
    """A causal layer's key blocks are as wide as its query tiles and whole S^T tiles: AVX2's
    6 key rows divide no query tile of 16, 32 or 64, and blocks of 18, 36 or 66 keys put
    each query tile across two partial blocks; it takes S^T tiles of 4 rows instead (at
    most 3/4 of the scores through the mask), AVX-512's 8 rows divide them already. An
    unmasked layer keeps the register tile's rows. Checked against the reference at seq 97
    (query tiles of 16) and head_dim 40."""
    from mhagen.blockmask import PARTIAL
    from mhagen.program import round_up
    from mhagen.schedules.cpu.attention import computed_scores
    t = resolve(preset)
    for d_model, heads, seq in ((512, 8, 128), (512, 8, 512), (160, 4, 97)):
        layer = mhagen.mha(d_model, heads, causal=True)
        w = layer.init_weights(seq)
        m = mhagen.build(layer, preset, batch=1, seq_len=seq, weights=w, tuning=None)
        cfg = _attention_config(m)
        work = next(k for k in m.program.kernels if k.name == "attention").workload
        rows = register_tiles(t, work.head_dim_padded, work.panel)[0]
        assert cfg.kv_block == cfg.q_tile and cfg.q_tile % cfg.tile_rows == 0, cfg
        if cfg.q_tile % rows:
            assert cfg.tile_rows == 4, cfg
            wide = dataclasses.replace(cfg, kv_block=round_up(cfg.q_tile, rows),
                                       tile_rows=rows)
            assert (computed_scores(work, cfg, (PARTIAL,))
                    <= 0.75 * computed_scores(work, wide, (PARTIAL,))), (cfg, wide)
        else:
            assert cfg.tile_rows == rows, cfg
        unmasked = mhagen.build(mhagen.mha(d_model, heads), preset, batch=1, seq_len=seq,
                                tuning=None)
        assert _attention_config(unmasked).tile_rows == rows
        if m.target.runs_here():
            x = _input(1, seq, d_model, seed=seq)
            assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_sliding_window_takes_aligned_32_wide_tiles(preset):
    """A band of keys per query (sliding window 64 at seq 256) computes far fewer scores in
    aligned tiles of 32 queries x 32 keys (AVX2: S^T tiles of 4 key rows, 32 not being a
    multiple of 6) than in the default 64-wide ones (AVX2's 66-key blocks straddled the
    query tiles); a causal mask keeps its 64-query tiles; both checked against the
    reference."""
    from mhagen.program import round_up
    from mhagen.schedules.cpu.attention import computed_scores
    rows = register_tiles(resolve(preset), 64, 2 * resolve(preset).lanes)[0]   # S^T's rows
    for mask, causal in ((mhagen.sliding_window(64), False), (None, True)):
        layer = mhagen.mha(256, 4, mask=mask, causal=causal)
        w = layer.init_weights(3)
        m = mhagen.build(layer, preset, batch=1, seq_len=256, weights=w, tuning=None)
        cfg = _attention_config(m)
        if mask is not None:
            assert (cfg.q_tile, cfg.kv_block) == (32, 32), cfg
            assert 32 % cfg.tile_rows == 0 and cfg.tile_rows >= 4, cfg
            work = next(k for k in m.program.kernels if k.name == "attention").workload
            wide = dataclasses.replace(cfg, q_tile=64, kv_block=round_up(64, rows),
                                       tile_rows=rows)
            assert computed_scores(work, cfg) <= 0.8 * computed_scores(work, wide)
        else:
            assert cfg.q_tile == 64 and cfg.kv_block >= 64, cfg
        if m.target.runs_here():
            x = _input(1, 256, 256, seed=4)
            assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_short_causal_sequence_skips_key_blocks(preset):
    """Masked self-attention takes key blocks as wide as its query tiles at every length:
    one 128-key block at seq 128 skipped nothing (causal attention 1.3-1.45x slower on
    Zen 4). Compile-only; the reference checks of causal layers run above."""
    from mhagen.program import round_up
    m = mhagen.build(mhagen.mha(512, 8, causal=True), preset, batch=1, seq_len=128,
                     tuning=None)
    cfg = _attention_config(m)
    assert cfg.kv_block == round_up(cfg.q_tile, cfg.tile_rows)
    table = m.program.buffers["blocks"].make(None)
    assert (table == 0).any(), "no key block skipped"


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_values_accumulate_in_registers(preset):
    """The split-KV decode template sums p * V rows in registers, not in its partial O
    (which made each key's multiply-adds wait on the last key's stores: GQA steps took
    1.6-1.7x the time), and its row-lane scores (8, 12 and 16 query rows a K/V head) keep
    their sums in registers too; for 1, 2, 4, 8, 12 and 16 rows and head_dim 40. (12 rows
    on AVX2's 8 lanes spilled as row vectors: they keep the lanes along head_dim.)"""
    for heads, kv_heads, d_model in ((4, 4, 256), (4, 2, 256), (8, 2, 320), (8, 1, 512),
                                     (12, 1, 768), (16, 1, 1024)):
        layer = mhagen.mha(d_model, heads, kv_heads=kv_heads, kv_cache=64, causal=True)
        asm = function_asm(_asm_of(layer, preset, 1), "attention_compute_")
        assert "vfmadd" in asm
        assert not accumulates_in_memory(asm), (preset, heads, kv_heads,
                                                accumulates_in_memory(asm)[:3])
        assert not spills_in_fma_loops(asm), (preset, heads, kv_heads)


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_rows_of_any_head_dim_stay_whole_vectors(preset):
    """The decode template scales, stores and merges its O rows a vector at a time: written
    as one vector of head_dim floats, rows of 40, 48, 80, 96 or 112 (not a power of two)
    became LLVM vectors it legalised lane by lane (300 vinsertps in the kernel at head_dim
    80; on the Intel Xeon VM 8 heads on one K/V head took 728 us against 56 at head_dim 64,
    now 65). No lane inserts in the kernel, for 4 and 8 rows a K/V head."""
    for heads, kv_heads, head_dim in ((8, 1, 80), (8, 2, 40), (8, 8, 48)):
        layer = mhagen.mha(heads * head_dim, heads, kv_heads=kv_heads, head_dim=head_dim,
                           kv_cache=64, causal=True)
        asm = function_asm(_asm_of(layer, preset, 1), "attention_compute_")
        assert "vfmadd" in asm and "vinsertps" not in asm, (preset, head_dim,
                                                           asm.count("vinsertps"))


def test_the_memory_accumulator_check_sees_one():
    """The check above can fail: the listing of the template that summed into part_o."""
    old = "".join(f"""
\tvmovaps\t{o}(%rbx,%rcx,4), %zmm1
\tvfmadd213ps\t{o}(%r12,%rax,4), %zmm0, %zmm1
\tvmovaps\t%zmm1, {o}(%r12,%rax,4)""" for o in ("", "64", "128", "192"))
    assert accumulates_in_memory(old) == ["(%r12,%rax,4) at ['', '128', '192', '64']"]
    assert not accumulates_in_memory(old.replace("%zmm1, 128(%r12", "%zmm1, 136(%r12")
                                     .replace("%zmm1, 192(%r12", "%zmm1, 200(%r12"))
