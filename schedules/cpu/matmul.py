"""Register-blocked matmul for CPUs with wide vectors.

Two forms, one schedule:
  packed_matmul  C[m, n] = sum_k A[m, k] W[n // NR, k, n % NR]  (weights in column panels,
                 repacked at build time), or C[p, m, j] (the output in column panels too):
                 loop order (row block, panel, row tile, k, rows, cols)
  matmul         C[b, i, j] = sum_k A[b, i, k] B[b, k, j]  (unfused graphs: scores, P V, ...)
Inside a task: a tile_rows x tile_cols accumulator in registers (rows unrolled, columns
vectorised), k innermost-but-two. Elementwise epilogues that follow (bias, scale, mask) are
folded into the tile's write-back, so they cost no extra pass over memory.
The measurements behind the tiles and blocks: benchmarks/PERFORMANCE.md, Schedule decisions.

By stage: packed_config (the packed GEMM's default tiles and blocks); packed_loops and
row_blocks (its loops tiled, the parallel loop); batched_loops (the unfused matmul's);
write_back (the accumulator tile and the epilogues folded into its write-back);
amx_products and vector_products (the register tile's products).
"""
from dataclasses import dataclass

from mhagen.schedules.x86 import amx, denormals
from mhagen.schedules.x86.bf16_dot import (HELPERS, IMPORT, INTRIN as BF16_DOT,
                                          LANES as BF16_LANES)
from mhagen.workloads import GemmWorkload


@dataclass(frozen=True)
class MatmulConfig:
    tile_rows: int
    """rows of C per register tile (unrolled): each row is one broadcast of A."""
    tile_cols: int
    """columns of C per register tile (vectorised): a multiple of the vector lanes."""
    row_block: int = 1
    """packed form: row tiles per row block; a block of A stays in L2 while every weight
    panel passes over it (1: no blocking)."""
    panel_groups: int = 1
    """packed form: the weight panels in this many groups, outermost in the parallel loop
    (one a core): with symbolic lengths, so each thread's share holds real rows whatever
    the call's length; in exact builds, where the row blocks split unevenly over the
    cores."""
    tile_panels: int = 1
    """packed form: weight panels side by side in one register tile (few_rows_panels: a
    decode step's 1-7 rows would otherwise leave 2-8 accumulators, too few to hide the
    multiply-add latency)."""


def few_rows_panels(rows, panels, lanes_per_panel, registers, cores=1):
    """Panels per register tile of a GEMM of fewer rows than a tile: accumulators (rows x
    2 vectors a panel) up to 12, with the panels' B vectors (held when rows > 1; one row
    reads each once, from memory) and one broadcast within the registers; a divisor of the
    panel count leaving 2 tasks a core or more. A tile of one panel had 2 accumulators at 1
    row, 4 at 2: each multiply-add waited on the last (benchmarks/PERFORMANCE.md, Schedule
    decisions)."""
    vectors = lanes_per_panel
    best = 1
    for p in range(1, panels + 1):
        acc = rows * vectors * p
        held = vectors * p if rows > 1 else 0
        if acc > 12 or acc + held + 1 > registers or panels // p < 2 * cores:
            break
        if panels % p == 0:
            best = p
    return best


def rows_that_fit(vectors, registers, most=8):
    """Unrolled rows of a register tile `vectors` vectors wide: the accumulators, the
    `vectors` operand vectors and one broadcast fit in `registers` (at most `most` rows)."""
    return max(1, min(most, (registers - vectors - 1) // vectors))


GEMM_ROWS_MOST = 12   # the packed GEMM's tile rows on 16 lanes at most (packed_tile)


def packed_tile(target, pairs=False, on_amx=False):
    """(tile_rows, tile_cols) of the packed GEMM: two vectors wide, as many rows as the
    vector registers hold after the 2 B vectors and the A broadcast, at most 12 on 16 lanes
    and 8 on fewer or for GEMMs over bfloat16 pairs (`pairs`: AVX-512 BF16's vdpbf16ps,
    where 12 rows gained nothing). AVX-512 (32 regs, 16 lanes): 12 x 32 (24 accumulators);
    AVX2 (16, 8): 6 x 16; NEON (32, 4): 8 x 8 (14 rows would fit; not measured).
    A taller tile loads the 2 B vectors once per 24 multiply-adds, not 16, and runs fewer
    tiles; 12 rows, not 14, leave registers for the write-back (the measurements of 8, 12
    and 14 rows: benchmarks/PERFORMANCE.md, Schedule decisions).
    on_amx: a GEMM on AMX tiles (amx.py): 32 x 32, four 16 x 16 tiles."""
    if on_amx:
        return amx.ROWS, amx.COLS
    most = GEMM_ROWS_MOST if target.lanes >= 16 and not pairs else 8
    return rows_that_fit(2, target.vector_registers, most), 2 * target.lanes


def packed_blocking(target, rows, depth, cols=0, pairs=False, on_amx=False):
    """(tile_rows, row_block, rows run over) of a packed GEMM with `rows` rows, depth K and
    `cols` columns (0: not known, or a symbolic build's: no blocks for the cores' sake).
    A row block of A (row_block tiles x K floats) takes at most half the L2 (at most 24
    tiles), the rest holds a weight panel and the tile's output: every row block streams all
    the weights once, so larger blocks halve that traffic. The blocks are balanced.
    Rows in one block are not padded where the last tile is partial by 1 or 2 rows, or the
    rows make 2 tiles: the guard (row < rows) depends only on the task's serial tile loop,
    so LLVM hoists it out of the k loop and gives the last tile a loop of its own rows
    (AVX2, 128 rows = 21 tiles of 6 + 2 rows, not 132). LLVM does so for this loop nest
    only (not with k split and unrolled by 2); a test reads the assembly for the whole
    tile's unguarded loop. With 3 or more tiles and 3 or more rows in the last, LLVM kept
    the whole tiles' accumulators of the guarded rows in memory: those rows are padded to
    whole tiles.
    Rows in several blocks are padded to whole tiles: there the guard depends on the
    parallel (block, panel) index, LLVM leaves it on every multiply-add. They are not
    padded to whole blocks: the last block may hold fewer tiles, and the guard that skips
    the missing ones stands per tile, out of the k loop (AVX2, 512 rows in 4 blocks of 22
    tiles: 516 rows computed, not 528). Waste: under one tile. What each choice gained:
    benchmarks/PERFORMANCE.md, Schedule decisions.
    Rows that fit one block are split into blocks all the same where the panels alone do
    not spread over the target's cores (core_blocks).
    pairs: a GEMM over bfloat16 pairs (packed_tile's pair tile), its rows padded to whole
    blocks (TVM's tensorize does not match a tile under a guard); on_amx: on AMX tiles
    (likewise padded, a decode step's few rows too)."""
    tile_rows, tile_cols = packed_tile(target, pairs, on_amx)
    pairs = pairs or on_amx
    if 0 < rows < tile_rows and not on_amx:   # a decode step's few rows: a shorter tile
        return rows, 1, rows   # (1 row: a GEMV, memory-bound; 8 rows would do 8x the FMAs)
    tiles = -(-rows // tile_rows)
    fit = target.l2_kib * 1024 // 2 // (tile_rows * max(1, depth) * 4)
    most = max(1, min(24, fit))
    if tiles <= most:
        row_block = core_blocks(tiles, cols // tile_cols, target.cores)
        if row_block == tiles:
            pad = pairs or (tiles >= 3 and rows % tile_rows >= 3)
            return tile_rows, 1, tiles * tile_rows if pad else rows
        blocks = -(-tiles // row_block)
        return tile_rows, row_block, (blocks * row_block if pairs else tiles) * tile_rows
    # the block count (blocks of at least half the most) whose blocks cover the tiles the
    # most evenly, then the fewest blocks: 86 tiles of at most 21 -> 8 x 11, not 5 x 18
    fewest = -(-tiles // most)
    blocks = min(range(fewest, 2 * fewest + 1), key=lambda n: (n * -(-tiles // n), n))
    row_block = -(-tiles // blocks)
    return tile_rows, row_block, (blocks * row_block if pairs else tiles) * tile_rows


def busiest_thread(work, threads):
    """The most work one thread runs when a parallel loop over tasks of these works (in
    loop order) is split as TVM splits it: consecutive runs of ceil(tasks / threads)."""
    step = max(1, -(-len(work) // threads))
    return max((sum(work[t:t + step]) for t in range(0, len(work), step)), default=0)


def most_tiles_a_thread(tiles, row_block, panels, cores):
    """The most row tiles x panels one thread runs over the (row block, panel) tasks."""
    blocks = -(-tiles // row_block)
    return busiest_thread([min(row_block, tiles - i // panels * row_block)
                           for i in range(blocks * panels)], cores)


def core_blocks(tiles, panels, cores):
    """Row tiles per block of a GEMM whose rows fit one row block: all of them (one block,
    a task per weight panel), or fewer where the panel tasks leave some core idle or one
    core with 5% more than it would run with the rows split too. The 128 rows of the default
    layer's output GEMM (AVX-512: 16 tiles, 16 panels) on 64 cores: 16 tasks, 48 cores idle;
    in blocks of 4 tiles, 64 tasks of 4 tiles. On 2 cores, 15 panels (d_model 480): 8 and 7
    panels a thread; in 2 blocks, 15 tasks of 8 tiles each. A task's tiles keep its weight
    panel in L1/L2; each block streams every panel once more."""
    if panels < 1 or cores < 2 or tiles < 4:
        return tiles

    def cost(row_block):
        return most_tiles_a_thread(tiles, row_block, panels, cores)
    # the largest block of the least cost; at least 2 tiles (a row_block of 1 means no
    # blocking to the schedule)
    best = min(range(tiles, 1, -1), key=cost)
    return best if cost(best) < 0.95 * cost(tiles) else tiles


@dataclass(frozen=True)
class GemmLoops:
    """The loops apply's stages hand on: the parallel loop (outer), the loop the write-back
    goes under (tile), the row tile (ii), the reduction (k), the loops inside it (inner), and
    where used the AMX depth blocks (kto, of `block` steps) and the bf16 pairs' vector split
    (jv, jl)."""
    outer: object
    tile: object
    ii: object
    k: object = None
    inner: tuple = ()
    kto: object = None
    block: int = 0
    jv: object = None
    jl: object = None


class MatmulRule:
    name = "matmul"

    def applies(self, stage, target):
        return stage.pattern in ("matmul", "packed_matmul")

    def default_config(self, workload, target):
        # Accumulators take tile_rows * tile_cols / lanes vector registers; 4 stay free for
        # the A broadcast and the B loads. Packed (packed_tile): AVX-512 (32 regs, 16 lanes)
        # 12 x 32; AVX2 (16, 8): 6 x 16; NEON (32, 4): 8 x 8; 256-bit SVE (32, 8): 8 x 16.
        if isinstance(workload, GemmWorkload):
            return packed_config(workload, target)
        lanes, budget = target.lanes, target.vector_registers - 4
        cols = workload.cols
        tile_cols = 2 * lanes if cols >= 2 * lanes and cols % (2 * lanes) == 0 else lanes
        while tile_cols > 1 and tile_cols > cols:   # never wider than the output
            tile_cols //= 2
        tile_rows = max(1, min(8, budget * lanes // tile_cols, workload.rows))
        return MatmulConfig(tile_rows=tile_rows, tile_cols=tile_cols)

    def apply(self, sch, stage, cfg, plan):
        blk = sch.get_sblock(stage.blocks[0])
        packs = self._pack_rows(sch, blk, plan)
        loops = sch.get_loops(blk)
        if stage.pattern == "packed_matmul":
            work = stage.workload
            tiled = packed_loops(sch, loops, work, cfg, plan.target)
        else:
            work = None
            tiled = batched_loops(sch, loops, cfg)
        sch.parallel(tiled.outer)
        first, absorbed = write_back(sch, blk, tiled.tile, plan)
        if work is not None and work.amx:
            amx_products(sch, blk, first, tiled, work)
        else:
            vector_products(sch, blk, first, tiled, cfg, work is not None and work.pairs)
        return absorbed + packs

    @staticmethod
    def _pack_rows(sch, blk, plan):
        """A's copy into row-tile panels (a "pack" stage the lowering put before the
        GEMM): one task per panel, its rows unrolled; AMX's A tiles (a_t[i, s, r, k2, p])
        a vector of a tile row (32 bfloat16) at a time instead: their rows and pairs
        unrolled (1,024 copies) took LLVM seconds a GEMM to compile, for the same speed
        (benchmarks/PERFORMANCE.md, Schedule decisions). Returns the stages it scheduled."""
        done = []
        for producer in sch.get_producers(blk):
            pack = plan.by_block.get(sch.get(producer).name_hint)
            if pack is not None and pack.pattern == "pack":
                loops = sch.get_loops(producer)
                sch.parallel(loops[0])
                if len(loops) == 5:           # a_t[i, s, r, k2, p]: AMX tiles
                    sch.vectorize(sch.fuse(*loops[3:]))
                else:                         # a_p[i, k2, r, p] (pairs) or a[i, k, r]
                    sch.unroll(loops[2])
                    if len(loops) == 4:
                        sch.unroll(loops[3])
                done.append(pack.name)
        return done


def packed_config(workload, target):
    """The packed GEMM's tiles (packed_tile, packed_blocking), row blocks and panel groups."""
    _, tile_cols = packed_tile(target, on_amx=bool(workload.amx))
    assert tile_cols == workload.panel, (tile_cols, workload)
    tile_rows, row_block, run_rows = packed_blocking(
        target, workload.rows, workload.depth, 0 if workload.symbolic else workload.cols,
        pairs=bool(workload.pairs), on_amx=bool(workload.amx))
    # A symbolic-length GEMM's row blocks are sized for its largest call: 128 rows
    # (22 tiles) of a module for up to 2048 filled one block of 19 tiles and 3 of a
    # second, and one thread did most of the work. The panel-major GEMM splits the
    # panels into a group per core, outermost (A then streams once a group); the
    # row-major one (slower with groups, not explained) gives each block every n-th
    # tile instead (apply). Measured: benchmarks/PERFORMANCE.md, Schedule decisions.
    if workload.amx and workload.symbolic:
        # TVM's tensorize does not match the AMX intrinsic under a row block of
        # symbolic extent (an InternalError; the random AMX layers found batch 3 of
        # up to 264 rows): one block, each panel task over every row tile
        row_block = 1
    panels, cores = workload.cols // tile_cols, target.cores
    if workload.symbolic:
        groups = cores if row_block > 1 and workload.panel_major else 1
    else:
        # exact builds: a group per core too where the (row block, panel) tasks
        # split unevenly over the cores (AVX2, 512 rows: 86 tiles in blocks of 22,
        # 22, 22, 20, and one of two threads runs 44 tiles per panel, not 43)
        tiles = -(-run_rows // tile_rows)
        groups = cores if row_block > 1 and most_tiles_a_thread(
            tiles, row_block, panels, cores) > 1.01 * tiles * panels / cores else 1
    if groups < 2 or panels % groups:
        groups = 1
    tile_panels = 1
    if tile_rows < packed_tile(target)[0] and not (workload.pairs or workload.amx):
        tile_panels = few_rows_panels(tile_rows, panels, tile_cols // target.lanes,
                                      target.vector_registers, cores)
    return MatmulConfig(tile_rows=tile_rows, tile_cols=tile_cols, row_block=row_block,
                        panel_groups=groups, tile_panels=tile_panels)


def packed_loops(sch, loops, work, cfg, target):
    """The packed GEMM's loops tiled: (row block, panel, row tile, k, rows, cols), the
    reduction split as the bf16 pairs' (k2, kp) or AMX tiles' (kt, k2, kp) intrinsics want."""
    pairs = work.pairs    # reduction (k2, kp): bf16 dot products
    tiles = work.amx      # reduction (kt, k2, kp): AMX tiles
    kto, block, jv, jl = None, 0, None, None   # AMX depth blocks: a loop outside the row tiles
    if pairs:
        *loops, kp = loops
    if tiles:
        *loops, kt, k2, kp = loops
        loops.append(kt)
        block = amx.gemm_depth_block(target, work.depth, bool(work.symbolic))
    if work.panel_major:   # C[p, m, j]: tiles are one panel wide
        jo, i, ji, k = loops
        heads = work.head_panels
        if heads and cfg.tile_panels == 1:
            # QKV's panels head by head (Q, K, V of head 0, then of head 1, ...): a
            # core's contiguous share of the panel tasks then holds whole heads,
            # which the attention's tasks, split by head, read from its own cache
            sec, hh, pp = sch.split(jo, list(heads))
            sch.reorder(hh, sec, pp)
            jo = sch.fuse(hh, sec, pp)
        io, ii = sch.split(i, [None, cfg.tile_rows])
        if cfg.tile_panels > 1:
            jo, jp = sch.split(jo, [None, cfg.tile_panels])
    else:
        i, j, k = loops
        io, ii = sch.split(i, [None, cfg.tile_rows])
        if cfg.tile_panels > 1:
            jo, jp, ji = sch.split(j, [None, cfg.tile_panels, cfg.tile_cols])
        else:
            jo, ji = sch.split(j, [None, cfg.tile_cols])
    inner = [ii, jp, ji] if cfg.tile_panels > 1 else [ii, ji]
    if pairs:   # each 16 columns of a row over one pair: the tensor intrinsic
        jv, jl = sch.split(ji, [None, BF16_LANES])
        inner = [ii, jv, jl, kp]
    if tiles:   # the whole tile over the depth, or a block of it: the intrinsic
        k, inner = ii, [ji, kt, k2, kp]
        if block:   # (amx.gemm_depth_block)
            kto, kti = sch.split(kt, [None, block])
            inner = [ji, kti, k2, kp]
    outer, io = row_blocks(sch, io, jo, kto, k, inner, cfg, work.symbolic)
    # a task runs its row tiles in order (see the write-back below); over depth
    # blocks the write-back follows the task's last block
    return GemmLoops(outer=outer, tile=outer if kto is not None else io, ii=ii, k=k,
                     inner=tuple(inner), kto=kto, block=block, jv=jv, jl=jl)


def row_blocks(sch, io, jo, kto, k, inner, cfg, symbolic):
    """The packed GEMM's parallel loop: (row block, panel) fused where rows are blocked,
    else the panels; returns it and the row tiles' loop (within a block where blocked)."""
    if cfg.row_block > 1:
        # (row block, panel, row tile): a panel is reused by the block's row tiles,
        # the block's rows of A stay in L2 across panels
        if symbolic and cfg.panel_groups == 1:
            # each of the n blocks takes every n-th tile of the call's, so every
            # block holds real rows whatever the call's length (see default_config)
            io, ib = sch.split(io, [cfg.row_block, None])
        else:
            ib, io = sch.split(io, [None, cfg.row_block])
        rows = [io] if kto is None else [kto, io]   # AMX depth blocks outside
        if cfg.panel_groups > 1:
            jg, jo = sch.split(jo, [cfg.panel_groups, None])
            sch.reorder(jg, ib, jo, *rows, k, *inner)
            return sch.fuse(jg, ib, jo), io
        sch.reorder(ib, jo, *rows, k, *inner)
        return sch.fuse(ib, jo), io
    rows = [io] if kto is None else [kto, io]
    sch.reorder(jo, *rows, k, *inner)   # a weight panel stays in cache across rows
    return jo, io


def batched_loops(sch, loops, cfg):
    """The unfused graphs' batched matmul: a task a tile."""
    # Row tiles stay inside one batch entry: fusing b into the rows before splitting
    # gives tiles that straddle two batches, which the write-back region gets wrong.
    b, i, j, k = loops
    io, ii = sch.split(i, [None, cfg.tile_rows])
    jo, ji = sch.split(j, [None, cfg.tile_cols])
    sch.reorder(b, io, jo, k, ii, ji)
    outer = sch.fuse(b, io, jo)   # (unfused graphs: a task a tile, as before)
    sch.annotate(outer, denormals.TASK, 1)   # x86: P V reads flushed probabilities
    return GemmLoops(outer=outer, tile=outer, ii=ii, k=k, inner=(ii, ji))


def write_back(sch, blk, tile, plan):
    """The accumulator tile in registers and its write-back under `tile`, with the
    element-wise epilogues that follow folded in; returns (the write-back block, the
    epilogue stages it absorbed)."""
    # The accumulator tile lives in registers ("local"); the elementwise consumers (bias,
    # scale, mask) fold into one write-back placed under the tile, so they cost no extra
    # pass over memory. The write-back is computed at the tile, not inlined into a copy
    # of it: when the product runs over padded rows, TVM then guards the rows past the
    # output's end (an inlined copy would store them out of bounds).
    # A parallel task runs many tiles (a row block's tiles of one panel), not one: TVM
    # gets a "local" buffer from TVMBackendAllocWorkspace at the start of the task's
    # body, and with a task per tile every tile paid that call and the free (see
    # benchmarks/PERFORMANCE.md, Schedule decisions).
    absorbed, first = [], None
    consumers = sch.get_consumers(blk)
    while len(consumers) == 1:
        nxt = plan.by_block.get(sch.get(consumers[0]).name_hint)
        if nxt is None or nxt.pattern != "epilogue":
            break
        if first is None:
            first = consumers[0]
        else:
            sch.reverse_compute_inline(consumers[0])
        absorbed.append(nxt.name)
        consumers = sch.get_consumers(first)
    if first is None:
        first = sch.cache_write(blk, 0, "local")
    else:
        sch.set_scope(blk, 0, "local")
    sch.reverse_compute_at(first, tile, preserve_unit_loops=True)
    return first, absorbed


def amx_products(sch, blk, first, tiled, work):
    """The row tile's products on AMX tiles (amx.intrinsic), over the depth or its blocks."""
    ii, kto = tiled.ii, tiled.kto
    init = sch.decompose_reduction(blk, kto if kto is not None else ii)
    sch.tensorize(ii, amx.intrinsic(tiled.block, accumulate=True) if kto is not None else
                  amx.intrinsic(work.depth // amx.DEPTH))
    sch.annotate(tiled.outer, amx.TASK, 1)   # the tile configuration: with_task_config
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(first)[-1])


def vector_products(sch, blk, first, tiled, cfg, pairs):
    """The register tile: rows unrolled, columns vectorised, or on bf16 pairs the
    vdpbf16ps intrinsic (bf16_dot.py)."""
    sch.unroll(tiled.ii)
    if cfg.tile_panels > 1:
        sch.unroll(tiled.inner[1])
    if pairs:
        init = sch.decompose_reduction(blk, tiled.k)
        sch.tensorize(tiled.jl, BF16_DOT)
        sch.unroll(tiled.jv)
        sch.annotate(tiled.outer, IMPORT, HELPERS)   # the intrinsic's LLVM IR (bf16_dot.py)
        sch.vectorize(sch.get_loops(init)[-1])
    else:
        sch.vectorize(tiled.inner[-1])
        sch.decompose_reduction(blk, tiled.k)
    sch.vectorize(sch.get_loops(first)[-1])
