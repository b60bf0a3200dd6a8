"""x86 GEMM register tiles per CPU class: tile sizes from the target, rows padded to
whole tiles, row blocks and tasks spread over the cores, whole tiles left unguarded,
decode-step GEMMs with enough accumulators, QKV tasks head by head."""
import dataclasses
import re

import pytest

import mhagen
from mhagen.backends import Backend
from mhagen.schedules.cpu.attention import register_tiles
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from x86_helpers import (PRESETS, _input, RUNNABLE, l2_of_1mib, multiply_add_loops,
                         _multiplies_broadcast_data, function_asm, whole_tile_loops,
                         accumulates_in_memory)


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
    import mhagen.schedules.cpu.backend as cpu_backend
    import mhagen.schedules.cpu.matmul as matmul
    exact = matmul.packed_blocking

    def unpadded(target, rows, depth, cols=0, pairs=False, on_amx=False):
        return exact(target, rows, depth, cols, pairs, on_amx)[:2] + (rows,)
    monkeypatch.setattr(matmul, "packed_blocking", unpadded)
    monkeypatch.setattr(cpu_backend, "packed_blocking", unpadded)
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
