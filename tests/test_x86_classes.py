"""x86 on every CPU class: both presets built and checked wherever the host runs them, the
register tiles derived from the target, no spills in the generated code, tuning records kept
per CPU class, and no SIGILL for code that needs features this host lacks."""
import dataclasses
import re

import numpy as np
import pytest

import mhagen
from mhagen.errors import TargetError
from mhagen.backends import Backend
from mhagen.schedules.cpu.attention import register_tiles
from mhagen.artifact.manifest import module_manifest
from mhagen.host import runtime_features
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from mhagen.tuning.records import Database, Tuning, workload_key

PRESETS = ("x86-avx2", "x86-avx512")
CLASSES = {"x86-avx2": "x86_64-v256-r16", "x86-avx512": "x86_64-v512-r32"}


def _input(b, s, d, seed=0):
    return np.random.default_rng(seed).standard_normal((b, s, d)).astype(np.float32)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layer_args, batch, seq", [
    (dict(d_model=320, num_heads=8, head_dim=40), 2, 97),                     # awkward shape
    (dict(d_model=256, num_heads=8, kv_heads=2, causal=True), 1, 130),       # grouped, causal
])
def test_both_presets_match_the_reference_or_refuse_clearly(preset, layer_args, batch, seq):
    layer = mhagen.mha(**layer_args)
    w = layer.init_weights(1)
    m = mhagen.build(layer, preset, batch=batch, seq_len=seq, weights=w, tuning=None)
    assert m.target.cpu_class == CLASSES[preset]
    x = _input(batch, seq, layer_args["d_model"])
    if m.target.runs_here():
        assert_close(m(x), layer.reference(x, w))
    else:   # e.g. the AVX-512 preset on an AVX2 host: a clear error, never SIGILL
        assert m.cannot_run and "avx512f" in m.cannot_run
        with pytest.raises(TargetError, match="needs CPU features .*avx512f"):
            m(x)


RUNNABLE = [p for p in PRESETS if resolve(p).runs_here()]


def l2_of_1mib(preset):
    """The preset's target with a 1 MiB L2, whatever this host's: for tests whose shapes
    pick row blocks (half the L2) of a given size."""
    return dataclasses.replace(resolve(preset), l2_kib=1024)


def _attention_config(module):
    return next(k.config for k in module.program.kernels if k.name == "attention")


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


def test_register_tiles_fit_each_class():
    avx2, avx512 = resolve("x86-avx2"), resolve("x86-avx512")
    assert (avx2.vector_registers, avx512.vector_registers) == (16, 32)
    # GEMM: 2 vectors wide, rows = what the registers hold after 2 B vectors + 1 broadcast
    # (at most 12 on 16 lanes)

    def tile(target, **kw):
        return Backend.for_target(target).gemm_tile(**kw)
    assert tile(avx2) == (6, 16) and tile(avx512) == (12, 32)
    assert tile(avx512, pairs=True) == (8, 32)      # bfloat16 pairs (vdpbf16ps): 8 rows
    for t in (avx2, avx512):
        rows, cols = tile(t)
        assert rows * (cols // t.lanes) + cols // t.lanes + 1 <= t.vector_registers
    # attention (S^T keys x queries, P V queries x head columns), head_dim 64
    assert register_tiles(avx2, 64, 16) == (6, 16, 6, 16)
    assert register_tiles(avx512, 64, 32) == (8, 32, 8, 32)
    for t in (avx2, avx512):
        tr, tc, orows, ocols = register_tiles(t, 64, 2 * t.lanes)
        for rows, cols in ((tr, tc), (orows, ocols)):
            vectors = cols // t.lanes
            assert rows * vectors + vectors + 1 <= t.vector_registers


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


def test_gemm_rows_are_padded_to_whole_tiles_only_across_row_blocks():
    layer = mhagen.mha(64, 4)
    # 97 rows -> 16 tiles of 6 and one of 1 (one row block: not padded); 250 rows -> 42
    # tiles -> two row blocks of 21 (padded to 252); 512 rows -> 86 tiles -> 4 blocks of
    # 22, the last one holding 20 (516 rows, not padded to 4 whole blocks = 528: the
    # missing tiles are skipped, not computed)
    for seq, padded in ((97, 97), (250, 252), (512, 516)):
        m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=seq, tuning=None)
        assert m.program.buffers["qkv"].shape[1] == padded
        assert m.program.buffers["out"].shape[0] == seq   # the output keeps batch*seq rows
        if m.target.runs_here():
            w = layer.init_weights(0)
            x = _input(1, seq, 64)
            assert_close(m(x, weights=w), layer.reference(x, w))


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


def test_gemm_tasks_split_evenly_over_the_cores():
    """512 rows of 6-row tiles (86) in row blocks of 22, 22, 22, 20: with (block, panel)
    tasks split in halves one of two threads runs 44 tiles a panel, not 43, so the exact
    build gives each core a group of panels instead, as AVX-512 does at 512 rows (43 tiles
    of 12 in blocks of 22 and 21); at 576 rows its 48 tiles in blocks of 24 split evenly
    and keep one group. Checked against the reference."""
    from mhagen.schedules.cpu.matmul import most_tiles_a_thread
    assert most_tiles_a_thread(86, 22, 96, 2) == 44 * 96    # an even share: 43 * 96
    assert most_tiles_a_thread(48, 24, 96, 2) == 24 * 96
    layer = mhagen.mha(64, 4)

    def groups(preset, cores, seq=512):
        t = dataclasses.replace(resolve(preset), cores=cores)
        m = mhagen.build(layer, t, batch=1, seq_len=seq, tuning=None)
        return m, {d["kernel"]: d["config"]["panel_groups"] for d in m.info.decisions
                   if d["rule"] == "matmul"}
    m, avx2 = groups("x86-avx2", 2)
    assert avx2 == {"qkv_projection": 2, "output_projection": 2}
    assert set(groups("x86-avx2", 1)[1].values()) == {1}
    assert set(groups("x86-avx512", 2)[1].values()) == {2}
    assert set(groups("x86-avx512", 2, seq=576)[1].values()) == {1}
    if m.target.runs_here():
        w = layer.init_weights(0)
        x = _input(1, 512, 64)
        assert_close(m(x, weights=w), layer.reference(x, w))


def test_gemm_rows_that_fit_one_block_split_over_the_cores():
    """A GEMM whose rows fit one row block runs a task per weight panel; where that leaves
    cores idle or uneven (64 cores, the default layer's 16 output panels; 2 cores, 15 panels
    of d_model 480) its rows are split into blocks too, padded to whole tiles. The benchmark
    layers on 2 cores keep one block. The split builds keep the whole tiles' unguarded
    loop and match the reference here. The L2 is pinned to 1 MiB (on a 256 KiB L2 the QKV
    GEMM of d_model 480 takes blocks of 8 tiles for the cache's sake)."""
    from mhagen.schedules.cpu.matmul import core_blocks
    assert core_blocks(16, 16, 64) == 4        # 64 tasks of 4 tiles, not 16 of 16
    assert core_blocks(16, 15, 2) == 8         # 15 tasks of 8 tiles a thread, not 8 of 16
    assert core_blocks(16, 16, 2) == 16        # 8 panels a thread either way
    assert core_blocks(16, 45, 2) == 16        # 23 panels vs 22.5: under 5%, one block
    assert core_blocks(3, 1, 64) == 3          # too few tiles to split

    def blocks(preset, cores, d_model, heads, seq=128, run=False):
        t = dataclasses.replace(l2_of_1mib(preset), cores=cores)
        layer = mhagen.mha(d_model, heads)
        w = layer.init_weights(4)
        m = mhagen.build(layer, t, batch=1, seq_len=seq, weights=w, tuning=None)
        for kernel in ("qkv_projection", "output_projection"):
            assert whole_tile_loops(m, kernel), f"{preset} {kernel}: tiles guarded per row"
        if run and t.runs_here():
            x = _input(1, seq, d_model, seed=cores)
            assert_close(m(x), layer.reference(x, w))
        return ({d["kernel"]: d["config"]["row_block"] for d in m.info.decisions
                 if d["rule"] == "matmul"}, m.program.buffers["qkv"].shape[1])
    from mhagen.schedules.cpu.matmul import packed_blocking
    for preset in ("x86-avx512", "x86-avx2"):   # the benchmark layers' GEMMs on 2 cores
        t = dataclasses.replace(resolve(preset), cores=2)
        for rows, d_model in ((128, 512), (512, 512), (2048, 768), (2048, 1024)):
            for cols in (3 * d_model, d_model):
                assert (packed_blocking(t, rows, d_model, cols)
                        == packed_blocking(t, rows, d_model)), (preset, rows, d_model, cols)
    # AVX-512: 16 tiles of 12 rows
    assert blocks("x86-avx512", 2, 480, 8, seq=192, run=True) == (
        {"qkv_projection": 1, "output_projection": 8}, 192)
    assert blocks("x86-avx512", 64, 512, 8, seq=192, run=True) == (
        {"qkv_projection": 4, "output_projection": 4}, 192)
    # AVX2: 21 tiles of 6 and one of 2 rows in two blocks of 11: padded to 132
    assert blocks("x86-avx2", 64, 512, 8, run=True) == (
        {"qkv_projection": 11, "output_projection": 11}, 132)
    # AVX-512: 8 tiles of 12 and one of 1 row, in blocks of 2 (48 panels) and 3 (16)
    assert blocks("x86-avx512", 64, 512, 8, seq=97, run=True) == (
        {"qkv_projection": 2, "output_projection": 3}, 108)


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


def test_gemm_rows_4kib_apart_are_packed_first():
    """A's rows 4 KiB apart (depth 1024) share one L1 set: such GEMMs copy A into row-tile
    panels first (both projections here); depth 512 does not. Exact and any-length builds
    against the reference."""
    def packed(m):
        return sorted(k.name for k in m.program.kernels
                      if any(s.pattern == "pack" for s in k.stages))
    layer = mhagen.mha(1024, 16, causal=True)
    w = layer.init_weights(3)
    m = mhagen.build(layer, "x86-avx2", batch=2, seq_len=13, weights=w, tuning=None)
    assert packed(m) == ["output_projection", "qkv_projection"]
    assert packed(mhagen.build(mhagen.mha(512, 8), "x86-avx2", batch=1, seq_len=8,
                               tuning=None)) == []
    any_len = mhagen.build(layer, "x86-avx2", batch=2, seq_len=None, max_seq_len=20,
                           weights=w, tuning=None)
    assert packed(any_len) == ["output_projection", "qkv_projection"]
    if m.target.runs_here():
        x = _input(2, 13, 1024, seed=4)
        assert_close(m(x), layer.reference(x, w))
        for seq in (1, 7, 20):
            x = _input(2, seq, 1024, seed=seq)
            assert_close(any_len(x), layer.reference(x, w))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("seq_len", [512, None])
def test_a_gemm_task_runs_many_register_tiles(preset, seq_len):
    """A parallel task of a packed GEMM runs its row block's tiles of one panel in a serial
    loop. TVM gets the tile's local accumulator from TVMBackendAllocWorkspace where the
    task's body starts: with a task per tile, every tile of ~1.5 us paid that call and the
    free (AVX2 on Zen 4: 2-15% of the GEMMs' time). Exact and any-length builds."""
    m = mhagen.build(mhagen.mha(512, 8), preset, batch=1, seq_len=seq_len,
                     max_seq_len=None if seq_len else 512, tuning=None)
    tir = m.inspect("tir")
    for kernel in ("qkv_projection", "output_projection"):
        lines = tir[tir.index(f"def {kernel}("):].splitlines()
        at = next(i for i, line in enumerate(lines) if "T.parallel(" in line)
        tiles = re.match(r"\s*for \w+ in range\((\w+)\):", lines[at + 1])
        assert tiles, f"{preset} {kernel}: a task per tile:\n" + "\n".join(lines[at:at + 3])
        assert not tiles.group(1).isdigit() or int(tiles.group(1)) > 1, lines[at + 1]


def multiply_add_loops(asm: str, op: str = "vfmadd") -> list:
    """The innermost multiply-add loops of an assembly listing: a label's instructions up to
    the jump back to it, with 4 or more `op` instructions."""
    blocks, name = {}, None
    for line in asm.splitlines():
        label = re.match(r"^(\.?[\w$.]+):", line)
        if label:
            name = label.group(1)
            blocks[name] = []
        elif name and line.startswith("\t") and not line.strip().startswith("."):
            blocks[name].append(line.strip())
    loops = []
    for name, ins in blocks.items():
        back = [k for k, i in enumerate(ins) if i.startswith("j") and i.split()[-1] == name]
        if back and sum(op in i for i in ins[:back[-1] + 1]) >= 4:
            loops.append(ins[:back[-1] + 1])
    return loops


def _multiplies_broadcast_data(body) -> bool:
    """A register tile's loop: it broadcasts data (a vbroadcast or an embedded {1toN} from
    anywhere but a constant pool). A softmax loop's multiply-adds (the exp polynomial) only
    broadcast constants; LLVM may unroll one over a short key block's rows and spill there,
    which the register tiles' sizes have nothing to do with."""
    return any(("broadcast" in i or "{1to" in i) and "(%rip)" not in i for i in body)


def spills_in_fma_loops(asm: str, op: str = "vfmadd") -> list:
    """Stack slots that an innermost register-tile loop (multiply-adds of broadcast data)
    both stores a vector register to and reads back: register spills (TVM prints assembly
    without LLVM's "Spill" comments). The task buffers that live on the stack (scores, Q^T)
    are only read in those loops, never stored and reloaded."""
    store = re.compile(r"vmov\w+\s+%[xyz]mm\d+, (-?\w*\(%rsp\))")
    found = []
    for body in filter(_multiplies_broadcast_data, multiply_add_loops(asm, op)):
        stored = {m.group(1) for m in map(store.match, body) if m}
        loaded = {slot for i in body if not store.match(i)
                  for slot in re.findall(r"(-?\w*\(%rsp\))", i)}
        found += sorted(stored & loaded)
    return found


def function_asm(asm: str, name: str) -> str:
    """A function's assembly with the parallel lambdas LLVM places after it (up to the next
    global label)."""
    lines = asm.splitlines()
    start = lines.index(name + ":")
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"^[A-Za-z_][\w$]*:", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def whole_tile_loops(m, kernel) -> list:
    """The loops of a GEMM kernel that run a whole register tile's multiply-adds in one
    basic block (tile_rows x tile_cols / lanes of them): a guard on the tile's rows would
    split them into a block per row."""
    from mhagen.schedules.cpu.matmul import packed_tile
    rows, cols = packed_tile(m.target)
    fmas = rows * cols // m.target.lanes
    body = function_asm(m.inspect("source"), kernel + "_compute_")
    return [b for b in filter(_multiplies_broadcast_data, multiply_add_loops(body))
            if sum("vfmadd" in i for i in b) == fmas]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_partial_last_row_tile_leaves_the_whole_tiles_unguarded(preset):
    """GEMM rows in one row block are not padded to whole tiles: 16 tiles and 2 rows run
    as 16 whole tiles and one of 2 (AVX2: 98 rows; AVX-512: 194, tiles of 12), 97 rows as 8
    AVX-512 tiles of 12 and one of 1 (AVX2: 16 of 6 and 1; depth 1024: A packed first). The
    guard of the partial tile is hoisted out of the k loop, so the whole tiles keep their
    unguarded loop; checked against the reference. The L2 is pinned to 1 MiB (on a 512 KiB
    L2 the 17 AVX-512 tiles take two row blocks)."""
    from mhagen.schedules.cpu.matmul import packed_tile
    tile_rows = packed_tile(resolve(preset))[0]
    for d_model, seq in ((512, 16 * tile_rows + 2), (1024, 97)):
        layer = mhagen.mha(d_model, 8)
        w = layer.init_weights(1)
        m = mhagen.build(layer, l2_of_1mib(preset), batch=1, seq_len=seq, weights=w,
                         tuning=None)
        assert m.program.buffers["qkv"].shape[1] == seq
        for kernel in ("qkv_projection", "output_projection"):
            assert whole_tile_loops(m, kernel), f"{preset} {kernel}: tiles guarded per row"
        if m.target.runs_here():
            x = _input(1, seq, d_model, seed=seq)
            assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_last_tile_of_3_or_more_rows_pads_the_rows_to_whole_tiles(preset):
    """With 3 or more row tiles and 3 or more rows in the last, an unpadded GEMM kept the
    whole tiles' accumulators of the guarded rows in memory (AVX2 at 16-112 rows: half
    speed): such rows are padded to whole tiles (clamped reads of A's last row), and no
    accumulator of the GEMMs' tiles is summed in memory; checked against the reference.
    (The accumulator check fails on the former unpadded build: the test below.)"""
    from mhagen.schedules.cpu.matmul import packed_tile
    tile_rows = packed_tile(resolve(preset))[0]
    seq = 3 * tile_rows + 3            # AVX2: 21 rows, 4 tiles; AVX-512: 27 rows, 4 tiles
    layer = mhagen.mha(512, 8)
    w = layer.init_weights(2)
    m = mhagen.build(layer, preset, batch=1, seq_len=seq, weights=w, tuning=None)
    assert m.program.buffers["qkv"].shape[1] == 4 * tile_rows
    asm = m.inspect("source")
    for kernel in ("qkv_projection", "output_projection"):
        body = function_asm(asm, kernel + "_compute_")
        assert not accumulates_in_memory(body), (preset, kernel, accumulates_in_memory(body))
    if m.target.runs_here():
        x = _input(1, seq, 512, seed=seq)
        assert_close(m(x), layer.reference(x, w))


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
        rows = register_tiles(t, work["head_dim_padded"], work["panel"])[0]
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


def fma_accumulators(loop) -> int:
    """Distinct registers a multiply-add loop accumulates into."""
    return len({i.split(",")[-1].strip() for i in loop if i.startswith("vfmadd")})


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_gemms_keep_8_or_more_accumulators(preset):
    """A decode step's GEMMs (1 or 2 rows) put several weight panels in one register tile:
    8-12 accumulators in the multiply-add loop, where one panel gave 2 or 4 and each
    multiply-add waited on the last (AVX2 steps' GEMMs 0.63-0.85x the time now)."""
    for batch in (1, 2):
        m = mhagen.build(mhagen.mha(1024, 16, kv_cache=64), preset, batch=batch, seq_len=1,
                         tuning=None)
        asm = m.inspect("source")
        for kernel in ("qkv_projection", "output_projection"):
            (cfg,) = [d["config"] for d in m.decisions if d["kernel"] == kernel]
            assert cfg["tile_panels"] >= 2, (preset, batch, kernel, cfg)
            loops = [loop for loop in multiply_add_loops(function_asm(asm, kernel + "_compute_"))
                     if _multiplies_broadcast_data(loop)]
            assert loops and min(map(fma_accumulators, loops)) >= 8, (preset, batch, kernel)


def _unpadded_avx2_build(monkeypatch, seq):
    """The default layer for x86-avx2 with its GEMM rows never padded to whole tiles (the
    packed blocking's run rows replaced by the rows themselves)."""
    import mhagen.schedules.x86 as x86
    import mhagen.schedules.cpu.matmul as matmul
    exact = matmul.packed_blocking

    def unpadded(target, rows, depth, cols=0, pairs=False, on_amx=False):
        return exact(target, rows, depth, cols, pairs, on_amx)[:2] + (rows,)
    monkeypatch.setattr(matmul, "packed_blocking", unpadded)
    monkeypatch.setattr(x86, "packed_blocking", unpadded)
    m = mhagen.build(mhagen.mha(512, 8), "x86-avx2", batch=1, seq_len=seq, tuning=None)
    assert m.program.buffers["qkv"].shape[1] == seq
    return m


def test_the_accumulator_check_sees_a_guarded_tile_in_memory(monkeypatch):
    """The check above can fail: AVX2 at 16 rows (2 tiles of 6 and one of 4) unpadded,
    as built before: rows 4 and 5 of the whole tiles summed in memory."""
    m = _unpadded_avx2_build(monkeypatch, 16)
    assert accumulates_in_memory(function_asm(m.inspect("source"), "qkv_projection_compute_"))


def test_the_tile_loop_check_sees_guarded_tiles(monkeypatch):
    """The check above can fail: rows in several row blocks left unpadded put the guard on
    every multiply-add (AVX2, 512 rows: LLVM does not hoist it; 2.9x slower)."""
    m = _unpadded_avx2_build(monkeypatch, 512)
    assert not whole_tile_loops(m, "qkv_projection")


def _asm_of(layer, preset, seq, tuning=None):
    return mhagen.build(layer, preset, batch=1, seq_len=seq, tuning=tuning).inspect("source")


@pytest.mark.parametrize("preset", PRESETS)
def test_no_vector_register_spills(preset):
    for layer, seq in ((mhagen.mha(512, 8), 128),
                       (mhagen.mha(256, 4, kv_heads=2, causal=True), 97)):
        asm = _asm_of(layer, preset, seq)
        assert "vfmadd" in asm
        spills = spills_in_fma_loops(asm)
        assert not spills, f"{preset}: vector spills in multiply-add loops at {spills}"


def test_the_spill_check_sees_spills():
    """The check above can fail: a 8 x 16 S^T tile (16 accumulators) on 16 ymm registers
    spills, as the AVX-512-sized template did on AVX2."""
    from mhagen.schedules.cpu.attention import AttentionConfig

    class Forced:
        def lookup(self, key):
            if key["kernel"] != "attention":
                return None
            return {"kind": "config", "config": AttentionConfig(64, 128, 8, 16, 8, 16).__dict__}
    asm = _asm_of(mhagen.mha(512, 8), "x86-avx2", 128, tuning=Tuning([Forced()]))
    assert spills_in_fma_loops(asm)


def accumulates_in_memory(asm: str) -> list:
    """Rows of vectors summed in memory: vector multiply-adds `vfmadd*ps OFF(BASE), a, b`
    followed, before b is written again, by `vmov* b, OFF(BASE)`, at 3 or more offsets of
    one BASE (a row of O, 3+ vectors for head_dim >= 48: each multiply-add waits on the
    last one's store). A single vector so updated (the softmax's running sum, once a key
    block) is not such a row."""
    lines = [line.strip() for line in asm.splitlines()]
    rows = {}
    for k, ins in enumerate(lines):
        fma = re.match(r"vfmadd\w+ps\s+(-?\w*)(\(%[\w,%]+\)), %[xyz]mm\d+, (%[xyz]mm\d+)$",
                       ins)
        if not fma:
            continue
        offset, base, reg = fma.groups()
        for nxt in lines[k + 1:k + 4]:
            if re.match(rf"vmov\w+\s+{re.escape(reg)}, {re.escape(offset + base)}$", nxt):
                rows.setdefault(base, set()).add(offset)
            if nxt.endswith(", " + reg):
                break
    return [f"{base} at {sorted(offsets)}" for base, offsets in rows.items()
            if len(offsets) >= 3]


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


def test_avx512_code_on_an_avx2_host_raises_instead_of_sigill(monkeypatch, tmp_path):
    avx2_host = tuple(f for f in runtime_features() if not f.startswith("avx512"))
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: avx2_host)
    layer = mhagen.mha(64, 4)
    m = mhagen.build(layer, "x86-avx512", batch=1, seq_len=16, weights=layer.init_weights(0))
    assert not m.target.runs_here()
    assert m.target.missing_features()[0].startswith("avx512")
    with pytest.raises(TargetError, match=r"needs CPU features avx512.*x86-avx2"):
        m(_input(1, 16, 64))
    with pytest.raises(TargetError, match="avx512"):
        m.latency()
    m.save(tmp_path / "m")          # cross-class artifacts are still written ...
    with pytest.raises(mhagen.ArtifactError, match="needs CPU features .*avx512"):
        mhagen.load(tmp_path / "m")  # ... and refused where they cannot run
    ok = mhagen.build(layer, "x86-avx2", batch=1, seq_len=16, weights=layer.init_weights(0))
    assert ok.cannot_run is None


def test_a_cpu_without_avx2_is_not_told_to_build_for_avx2(monkeypatch):
    """Sandy Bridge (AVX, no AVX2/FMA): the refusal of AVX2 code suggests 'x86' only (qemu
    -cpu SandyBridge-v1 showed the message suggesting 'x86-avx2' too)."""
    from mhagen.targets import load_preset, preset_names
    fallbacks = [n for n in preset_names() if load_preset(n).get("fallback") is not None]
    assert {"x86", "x86-avx2", "arm-neon"} <= set(fallbacks)
    for name in fallbacks:        # the preset's "fallback" list is what its code needs
        preset = load_preset(name)
        needs = () if preset["tvm"]["mcpu"] == "host" else resolve(name).required_features()
        assert tuple(preset["fallback"]) == needs, f"{name} needs {needs}"
    monkeypatch.setattr("mhagen.host.runtime_features",
                        lambda: ("avx", "popcnt", "sse4.1", "sse4.2", "ssse3"))
    layer = mhagen.mha(64, 4)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=8, tuning=None)
    assert m.cannot_run.endswith("needs CPU features avx2, bmi, bmi2, f16c, fma, lzcnt, movbe "
                                 "that this "
                                 "machine lacks (an "
                                 "instruction it lacks would kill the process with SIGILL): "
                                 "build for target 'x86' (this CPU) instead"), m.cannot_run


def test_zen_code_needs_sse4a_and_the_bf16_preset_leaves_it_out():
    """LLVM writes AMD's SSE4a (insertq) into code for Zen: a bfloat16 layer for znver4 had
    it and died of SIGILL on an Intel Xeon with every other Zen 4 extension. sse4a is a
    checked feature now (code for Zen lists it; a CPU without it refuses the module), and
    the x86-avx512-bf16 preset (znver4) turns it off, so its code runs on such a Xeon."""
    from mhagen.target import _checked_features
    assert "sse4a" in _checked_features({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                         "mcpu": "znver4"})
    layer = mhagen.mha(8, 1, dtype="bfloat16")
    m = mhagen.build(layer, "x86-avx512-bf16", batch=1, seq_len=7,
                     weights=layer.init_weights(0), tuning=None)
    asm = m.inspect("source")
    assert "vdpbf16ps" in asm and not re.search(r"\b(insertq|extrq)\b", asm)
    assert "sse4a" not in m.target.required_features()


def test_avx512_bf16_code_is_refused_on_an_avx512_cpu_without_it(monkeypatch, tmp_path):
    """A bfloat16 layer for an AVX-512 BF16 CPU multiplies with vdpbf16ps. Its code listed only
    AVX-512 F/BW/DQ/VL as needed, so an AVX-512 CPU without BF16 (Skylake-SP, Ice Lake)
    would have loaded it and died of SIGILL; the module and the saved artifact now name
    what is missing."""
    layer = mhagen.mha(64, 4, dtype="bfloat16")
    m = mhagen.build(layer, "x86-avx512-bf16", batch=1, seq_len=8,
                     weights=layer.init_weights(0), tuning=None)
    assert "vdpbf16ps" in m.inspect("source")
    assert {"avx512bf16", "avx512vnni"} <= set(m.target.required_features())
    path = m.save(tmp_path / "bf16")
    skylake_sp = resolve("x86-avx512").required_features()
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: skylake_sp)
    assert re.search(r"needs CPU features avx512bf16, .*avx512vnni.* that this machine lacks",
                     m.target.cannot_run())
    with pytest.raises(mhagen.ArtifactError, match="needs CPU features avx512bf16, .*avx512vnni"):
        mhagen.load(path)

@pytest.mark.parametrize("hide", [("avx512vbmi2", "gfni"), ("avx512f", "avx512bw", "avx512cd",
                                                             "avx512dq", "avx512vl"),
                                  ("avx2", "fma")])
def test_the_host_preset_leaves_out_what_a_hypervisor_hides(monkeypatch, hide):
    """LLVM names the CPU by family and model (znver4), but a VM may hide some of its
    extensions: `x86` turns those off (-mattr) and its code runs on this machine; hiding
    AVX-512 makes it the AVX2 class."""
    host = resolve("x86")
    hidden = [f for f in hide if f in host.required_features()]
    if not hidden:
        pytest.skip(f"this CPU ({host.cpu}) has none of {', '.join(hide)} to hide")
    have = tuple(f for f in runtime_features() if f not in hidden)
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: have)
    t = resolve("x86")
    assert t.cpu == host.cpu and not set(hidden) & set(t.required_features())
    assert {f"-{f}" for f in hidden} <= set(t.tvm_target_dict()["mattr"])
    assert t.cannot_run() is None
    if "avx512f" in hidden:
        assert t.vector_bits == 256 and t.vector_registers == 16
    layer = mhagen.mha(64, 4, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, t, batch=1, seq_len=24, weights=w, tuning=None)
    x = _input(1, 24, 64)
    assert_close(m(x), layer.reference(x, w))

@pytest.mark.parametrize("llvm_name", ["k8-sse3", "generic"])
def test_a_cpu_llvm_does_not_know_gets_the_x86_64_level_it_reaches(monkeypatch, llvm_name):
    """LLVM names a CPU it does not know by an older CPU's name or "generic" (qemu -cpu max,
    an AVX2 CPU, was "k8-sse3", and `x86` compiled SSE3 code): the host preset then
    compiles for the best x86-64 level the CPU reaches, plus its other extensions."""
    real = set(runtime_features())
    monkeypatch.setattr("mhagen.target.host_llvm_cpu", lambda: llvm_name)
    avx2 = resolve("x86-avx2").required_features() + ("vaes",)
    avx512 = resolve("x86-avx512").required_features() + ("gfni",)
    for have, cpu, cpu_class in ((avx2, "x86-64-v3", "x86_64-v256-r16"),
                                 (avx512, "x86-64-v4", "x86_64-v512-r32")):
        monkeypatch.setattr("mhagen.host.runtime_features", lambda have=have: have)
        t = resolve("x86")
        assert (t.cpu, t.cpu_class) == (cpu, cpu_class)
        assert sorted(t.required_features()) == sorted(have)     # exactly what the CPU has
        assert resolve("x86-avx2").machine_cpu == cpu    # records: this CPU by that name
        if set(have) <= real:                           # this machine runs that code
            layer = mhagen.mha(64, 4)
            w = layer.init_weights(0)
            m = mhagen.build(layer, t, batch=1, seq_len=24, weights=w, tuning=None)
            x = _input(1, 24, 64)
            assert_close(m(x), layer.reference(x, w))

def test_every_checked_x86_feature_is_one_llvm_knows():
    """The host preset turns features on and off by these names (-mattr); a name this LLVM
    does not know is ignored with a warning (its LLVM dropped Xeon Phi's AVX-512 ER/PF)."""
    import tvm
    from mhagen.host import X86_FEATURES
    x86 = list(X86_FEATURES)
    t = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64",
                           "mattr": [f"+{f}" for f in x86]})
    known = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(t)}
    assert set(x86) <= known, sorted(set(x86) - known)

def _record(kernel, cpu_class, l2, q_tile, cpu=None):
    key = {"cpu_class": cpu_class, "l2_kib": l2, "l1d_kib": 32, "cpu": cpu, "dtype": "float32",
           "batch": 1, "seq": 64, "d_model": 64, "heads": 4, "kv_heads": 4, "head_dim": 16,
           "mask": "none", "graph": "g", "kernel": kernel}
    return {"key": key, "kind": "config", "config": {"q_tile": q_tile}}


def test_records_are_per_class_and_the_closest_caches_win():
    db = Database(records=[_record("attention", "x86_64-v256-r16", 512, 16),
                           _record("attention", "x86_64-v256-r16", 2048, 32),
                           _record("attention", "x86_64-v512-r32", 1024, 64)])
    want = dict(_record("attention", "x86_64-v256-r16", 1536, 0)["key"])
    assert db.lookup(want)["config"]["q_tile"] == 32          # L2 2 MiB is closer to 1.5
    want["l2_kib"] = 640
    assert db.lookup(want)["config"]["q_tile"] == 16
    want["cpu_class"] = "x86_64-v128-r16"                      # no record of that class
    assert db.lookup(want) is None


def test_machines_with_the_same_caches_keep_their_own_records(tmp_path):
    """A Zen 4 and a Skylake-SP (L1d 32 KiB, L2 1 MiB both) each keep their record of a
    workload (tuning on one used to replace the other's); a lookup takes the same CPU's
    among equal caches, the closest caches before that, and any CPU's when none matches."""
    db = Database(tmp_path / "db.json")
    for cpu, q_tile in (("skylake-avx512", 32), ("znver4", 64), (None, 16)):
        db.put(_record("attention", "x86_64-v512-r32", 1024, q_tile, cpu))
    db.put(_record("attention", "x86_64-v512-r32", 512, 8, "znver3"))
    db.save()
    db = Database.load(tmp_path / "db.json")
    assert len(db.records) == 4
    want = dict(_record("attention", "x86_64-v512-r32", 1024, 0)["key"])
    for cpu, q_tile in (("znver4", 64), ("skylake-avx512", 32), (None, 16)):
        want["cpu"] = cpu
        assert db.lookup(want)["config"]["q_tile"] == q_tile, cpu
    want["cpu"] = "znver3"       # its own record has a 512 KiB L2: a 1 MiB one wins
    assert db.lookup(want)["config"]["q_tile"] in (16, 32, 64)
    want["l2_kib"] = 512
    assert db.lookup(want)["config"]["q_tile"] == 8


def test_a_preset_run_here_looks_for_this_cpus_records():
    """x86-avx2 compiles for `haswell`, but built on this machine it runs here: its records
    are looked up (and tuned) as this CPU's; a foreign architecture keeps its own CPU."""
    avx2 = resolve("x86-avx2")
    assert avx2.cpu == "haswell"
    assert avx2.machine_cpu == (resolve("x86").cpu if avx2.runs_here() else "haswell")
    assert resolve("x86").machine_cpu == resolve("x86").cpu
    assert resolve("arm-neon").machine_cpu == resolve("arm-neon").cpu
    layer = mhagen.mha(64, 4)
    key = mhagen.build(layer, "x86-avx2", batch=1, seq_len=8, tuning=None).program.key("qkv_projection")
    assert key["cpu"] == avx2.machine_cpu


def test_a_record_of_another_class_is_never_applied(tmp_path):
    layer = mhagen.mha(64, 4)
    avx512_key = mhagen.build(layer, "x86-avx512", batch=1, seq_len=64,
                              tuning=None).program.key("attention")
    rec = {"key": avx512_key, "kind": "config",
           "config": {"q_tile": 32, "kv_block": 64, "tile_rows": 4, "tile_cols": 32,
                      "out_rows": 4, "out_cols": 16}}
    Database(tmp_path / "db.json", [rec]).save()
    on_avx2 = mhagen.build(layer, "x86-avx2", batch=1, seq_len=64, tuning=tmp_path / "db.json")
    assert {d["kernel"]: d["source"] for d in on_avx2.decisions}["attention"] == "default"
    on_avx512 = mhagen.build(layer, "x86-avx512", batch=1, seq_len=64,
                             tuning=tmp_path / "db.json")
    assert {d["kernel"]: d["source"] for d in on_avx512.decisions}["attention"] == "tuned"
    assert on_avx512.tuning_records[0]["key"]["cpu_class"] == "x86_64-v512-r32"


def test_the_c_api_checks_the_class_features_at_create():
    """mha_create refuses a CPU without the artifact's features (MHA_ERR_TARGET) rather than
    running into SIGILL; the generated config lists the class's features."""
    from mhagen.artifact.capi import _cpu_check
    layer = mhagen.mha(64, 4)
    for preset, needed, absent in (("x86-avx512", "avx512f", None),
                                   ("x86-avx2", "avx2", "avx512f")):
        m = mhagen.build(layer, preset, batch=1, seq_len=8, tuning=None)
        check = _cpu_check(module_manifest(m))
        assert f'X("{needed}", ' in check
        assert "fma" in m.target.required_features()
        if absent:
            assert f'"{absent}"' not in check


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


@pytest.mark.parametrize("preset", RUNNABLE)
def test_a_short_last_row_block_matches_the_reference(preset):
    """150 rows at depth 1024 (A packed first): 25 AVX2 tiles in blocks of 13, 19 AVX-512
    tiles in blocks of 10, the last block one tile short in both; rows padded to whole
    tiles only. The L2 is pinned to 1 MiB (a 2 MiB L2 holds all 19 AVX-512 tiles in one
    block)."""
    from mhagen.program import round_up
    from mhagen.schedules.cpu.matmul import packed_blocking
    layer = mhagen.mha(1024, 16)
    w = layer.init_weights(6)
    m = mhagen.build(layer, l2_of_1mib(preset), batch=1, seq_len=150, weights=w, tuning=None)
    tile_rows, row_block, rows = packed_blocking(m.target, 150, 1024)
    assert rows == round_up(150, tile_rows) == m.program.buffers["qkv"].shape[1]
    assert -(-rows // tile_rows) % row_block, "the last block is not short"
    x = _input(1, 150, 1024, seed=7)
    assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("n, word, offset", [(8, "i32", "i64"), (16, "i32", "i64"),
                                             (16, "i32", "i32"), (32, "i16", "i64")])
def test_the_register_transposes_transpose(n, word, offset):
    """The LLVM IR transposes (transpose.py: the float32 Q^T copy of both presets, AMX's
    O^T and V^T): dst = src^T between rows of other strides and at offsets, the words
    around the block untouched. Generic IR: runs on every x86 host."""
    import tvm
    from tvm.script import tirx as T
    from mhagen.schedules.x86.bf16_dot import with_llvm_ir
    from mhagen.schedules.cpu.transpose import transpose

    dtype = {"i32": "int32", "i16": "int16"}[word]
    # rows and offsets of even words: 4-byte aligned, as the helpers' loads declare
    sstride, dstride, soff, doff = n + 4, n + 6, 2 * (n + 4) + 2, n + 6 + 4
    name = f"test_transpose_{n}_{word}_{offset}"
    cast = (lambda v: T.int64(v)) if offset == "i64" else (lambda v: T.int32(v))

    @T.prim_func
    def f(src: T.Buffer((soff + n * sstride,), dtype),
          dst: T.Buffer((doff + n * dstride,), dtype)):
        T.evaluate(T.call_extern("int32", name, dst.data, cast(doff),
                                 T.int64(dstride * src.dtype.bits // 8), src.data,
                                 cast(soff), T.int64(sstride * src.dtype.bits // 8)))

    lib = tvm.compile(with_llvm_ir(f, transpose(name, n, word, offset)), target="llvm")
    rng = np.random.default_rng(n)
    src = rng.integers(-30000, 30000, soff + n * sstride).astype(dtype)
    dst = rng.integers(-30000, 30000, doff + n * dstride).astype(dtype)
    out = tvm.runtime.tensor(dst.copy())
    lib(tvm.runtime.tensor(src), out)
    got = out.numpy()
    block = lambda a, off, stride: a[off:off + n * stride].reshape(n, stride)[:, :n]
    np.testing.assert_array_equal(block(got, doff, dstride), block(src, soff, sstride).T)
    outside = np.ones(got.shape, bool)
    block(outside, doff, dstride)[...] = False
    np.testing.assert_array_equal(got[outside], dst[outside])


def test_qkv_gemm_tasks_run_head_by_head():
    """The QKV GEMM's panel tasks run Q, K and V of one head after the other: the first half
    of the tasks (one core's share of the parallel loop on 2 cores) writes heads 0-3 whole,
    which the attention's first half of tasks reads (1x128x512x8, 2 threads: the layer
    0.98-0.99x the time of the panel order Q, K, V, Intel Xeon). A 1 MiB L2 holds the 128
    rows in one row block (a 512 KiB one splits them in two: 96 tasks)."""
    m = mhagen.build(mhagen.mha(512, 8), l2_of_1mib("x86-avx512"), batch=1, seq_len=128,
                     tuning=None)
    tir = m.inspect("tir")
    tir = tir[tir.index("def qkv_projection"):]
    var, extent = re.search(r"for (\w+) in T\.parallel\((\d+)\)", tir).groups()
    panel = re.search(r"v_p = T\.axis\.spatial\(48, (.+)\)\n", tir).group(1)
    assert int(extent) == 48 and var in panel       # 3 sections x 8 heads x 2 panels
    first_half = {eval(panel, {var: t}) for t in range(24)}
    heads = {(p // 16, p % 16 // 2) for p in first_half}    # (Q/K/V, head) of each panel
    assert heads == {(s, h) for s in range(3) for h in range(4)}, sorted(heads)
