"""The CPU decode template's tile sizes and heuristics (apart from the kernel, as
FlashAttention 3's tile_size.h).

DecodeConfig           the tuning knobs: row tile, workers, key block, lanes
DecodeSplit            the row tiles, groups and partial results a config cuts a step into
decode_layout          that split for a workload
balanced_share         a worker's even, contiguous share of the call's key blocks
decode_kv_block        keys per online-softmax step
paged_kv_block         that step's keys for a paged cache (a divisor of its block size)
rows_in_lanes          whether a tile's scores put its query rows in the vector lanes
heads_in_tile          whether a paged cache's row tiles run across the K/V heads
default_row_tile       a tile's rows by default
keys_in_flight         keys whose row-lane scores accumulate at once
default_decode_config  the default config
"""
from __future__ import annotations

from dataclasses import dataclass

from mhagen.program import round_up


@dataclass(frozen=True)
class DecodeConfig:
    row_tile: int
    """query rows per task (of the GROUP x S rows that read one K/V head)."""
    workers: int
    """parallel tasks (one a core by default): each takes an even, contiguous share of the
    call's key blocks over all (batch row, K/V head, row tile) groups, in order
    (balanced_share)."""
    kv_block: int
    """keys per online-softmax step."""
    lanes: int
    """floats per vector along head_dim."""


def balanced_share(worker, workers, total):
    """[lo, hi) of the `total` work units (key blocks, every group's in a row) that
    `worker` of `workers` runs: even shares, each a contiguous run. ints or TIR (int32:
    t * total // workers as t * q + t * r // workers, total = q * workers + r, so no
    product exceeds total or workers^2)."""
    def start(t):
        return total // workers * t + total % workers * t // workers
    return start(worker), start(worker + 1)


def decode_kv_block(row_tile, lanes):
    """Keys per online-softmax step. Lanes along head_dim: 8 per query row of the tile, 16
    to 64: a block's fixed cost per row (its max, exp2 and rescale of O) wants many keys
    when rows are many; with one or two rows the step streams the cache, and short blocks
    keep the K and V streams both in flight. Rows in the lanes (rows_in_lanes): 16 keys,
    whose K and V blocks (4 KiB each at head_dim 64) stay in L1 while every row of the tile
    reads V. The measurements: benchmarks/PERFORMANCE.md, Schedule decisions."""
    if rows_in_lanes(row_tile, lanes):
        return round_up(16, lanes)
    return round_up(min(64, max(16, 8 * row_tile)), lanes)


@dataclass(frozen=True)
class DecodeSplit:
    """How a config cuts a decode step: the GROUP x S query rows that read one K/V head, in
    n_row_tiles tiles; groups (batch row, K/V head, row tile); partial results, one a piece
    of a group a worker's share meets."""
    rows: int
    n_row_tiles: int
    groups: int
    partials: int


def heads_in_tile(w, lanes) -> bool:
    """Whether a paged cache's row tiles run across K/V heads: their rows every query head x
    the new tokens (a row reads its own head's keys), where the tiles of one K/V head's rows
    would keep the lanes along head_dim (fewer than 8 rows: rows_in_lanes). A pool block
    holds every head's rows of its tokens side by side ([blocks, kv_heads, block, d]): a
    tile across the heads reads a block's K (and V) in one stretch, where a tile of one head
    read a few KiB a block, each stretch apart from the last, and waited on memory at every
    one (measured: benchmarks/PERFORMANCE.md)."""
    if not w.kv_block_size or w.kv_heads == 1:
        return False
    return not rows_in_lanes(default_row_tile(w.heads // w.kv_heads * w.seq, lanes), lanes)


def decode_layout(w, cfg) -> DecodeSplit:
    """The split of workload w under cfg. Packed calls (w.packed: each batch row's own number
    of new tokens, w.batch * w.seq in all at most) bound their groups: sum_b kv_heads *
    ceil(GROUP n_b / row_tile) <= kv_heads * (ceil(GROUP * total / row_tile) + batch).
    Tiles across the K/V heads (heads_in_tile): one group of heads x tokens rows a batch row's
    row tile."""
    across = heads_in_tile(w, cfg.lanes)
    heads, group_heads = (1, w.heads) if across else (w.kv_heads, w.heads // w.kv_heads)
    rows = group_heads * w.seq
    n_row_tiles = -(-rows // cfg.row_tile)
    groups = w.batch * heads * n_row_tiles
    if w.packed:
        groups = heads * (-(-rows * w.batch // cfg.row_tile) + w.batch)
    # a group's blocks split over the workers whose shares meet them: group j's piece of
    # worker t is partial j + t (shares are contiguous runs, so no two pieces meet there)
    return DecodeSplit(rows=rows, n_row_tiles=n_row_tiles, groups=groups,
                       partials=groups + cfg.workers - 1)


def rows_in_lanes(row_tile, lanes):
    """Whether a tile's scores put its query rows in the vector lanes (8, 12 or 16 rows:
    the query heads of a K/V head x the new tokens): a multiply-add per head_dim column
    then makes a score for every row, with no horizontal sum per score; fewer than 8 rows
    keep the lanes along head_dim, where they ran faster. A row vector fits one register or
    is whole registers: 12 rows on 8 lanes (AVX2) came out of LLVM as lane inserts through
    the stack. The measurements: benchmarks/PERFORMANCE.md, Schedule decisions."""
    return row_tile >= 8 and row_tile % 4 == 0 and (row_tile <= lanes or row_tile % lanes == 0)


def keys_in_flight(row_tile, lanes, registers, kv_block):
    """Keys whose row-lane scores accumulate at once: as many as the registers hold (4 kept
    for Q^T and K's broadcasts), at most 8, a power of two dividing kv_block (fewer were
    slower: benchmarks/PERFORMANCE.md, Schedule decisions). A key's row vector
    takes whole registers: 12 rows on 8 lanes take 2 (8 keys of them spilled)."""
    fit = max(1, (registers - 4) // -(-row_tile // lanes))
    ju = 1
    while ju * 2 <= min(8, fit) and kv_block % (ju * 2) == 0:
        ju *= 2
    return ju


def paged_kv_block(kv_block, lanes, block_size):
    """A paged cache's key block: the largest multiple of the lanes up to kv_block that
    divides the pool's block size, so a key block lies in one pool block (its address read
    once from the block table)."""
    best = lanes
    for kb in range(lanes, min(kv_block, block_size) + 1, lanes):
        if block_size % kb == 0:
            best = kb
    return best


def default_row_tile(rows, lanes):
    """Query rows a tile of the `rows` that read one K/V head: up to 16, rows in the lanes
    where a few copied rows allow it."""
    row_tile = min(rows, 16)
    padded = round_up(row_tile, lanes)
    if (row_tile >= 8 and not rows_in_lanes(row_tile, lanes) and padded <= 16
            and rows_in_lanes(padded, lanes) and 3 * padded <= 4 * row_tile):
        # rows in the lanes pay for a few copied rows (AVX2, 12 rows a K/V head in a
        # tile of 16: benchmarks/PERFORMANCE.md, Schedule decisions)
        row_tile = padded
    return row_tile


def default_decode_config(workload, target):
    """The default config: row tiles of up to 16 query rows (rows in the lanes where a few
    copied rows allow it), one worker a core, key blocks by decode_kv_block (a paged cache:
    dividing its block size, paged_kv_block; with tiles across the K/V heads, the whole
    pool block)."""
    rows = workload.heads // workload.kv_heads * workload.seq
    row_tile = default_row_tile(rows, target.lanes)
    across = heads_in_tile(workload, target.lanes)
    if across:    # every head's rows, lanes along head_dim
        row_tile = min(workload.heads * workload.seq, 16)
    # one task a core: TVM runs a parallel loop's tasks in static, contiguous chunks a
    # thread, so more tasks balance nothing and add partials to merge (against 4 a
    # core: benchmarks/PERFORMANCE.md, Schedule decisions)
    kv_block = decode_kv_block(row_tile, target.lanes)
    if across:
        # the rows read a pool block head after head: a key block of the whole pool block
        # reads it in one stretch, where a part of it read each head's rows a stride
        # apart (the hardware prefetchers lost the stream at every head)
        kv_block = workload.kv_block_size
    if workload.kv_block_size:
        kv_block = paged_kv_block(kv_block, target.lanes, workload.kv_block_size)
    return DecodeConfig(row_tile=row_tile, workers=max(1, target.cores), kv_block=kv_block,
                        lanes=target.lanes)
