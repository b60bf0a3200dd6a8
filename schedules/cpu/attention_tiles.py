"""The CPU attention template's tile sizes and heuristics (apart from the kernel, as
FlashAttention 3's tile_size.h): the config's fields and how the defaults are chosen.

AttentionConfig     the tuning knobs: query tiles, key blocks, the two register tiles
register_tiles      S^T's and P V's register tiles from the target's vector registers
attention_tiles     register_tiles, or AMX's 32 x 32 S^T tiles
default_tiles       the default config (balanced tiles, a task a core, key blocks a goal)
computed_scores     the scores a config computes under the mask's block table
narrow_band_tiles   32 x 32 tiles where a band mask leaves wider ones mostly hidden scores
aligned_key_blocks  key blocks as wide as the query tiles where S^T rows do not divide them
longest_tile        the longest query tile or key block worth having
"""
from dataclasses import dataclass, replace

import numpy as np

from mhagen.blockmask import FULL, PARTIAL, block_table
from mhagen.program import round_up
from mhagen.schedules.x86 import amx
from mhagen.schedules.cpu.matmul import rows_that_fit


@dataclass(frozen=True)
class AttentionConfig:
    q_tile: int
    """query rows per task (a multiple of tile_cols; where out_rows does not divide it, P V
    covers it in tiles one row apart)."""
    kv_block: int
    """keys per block of the online softmax (a multiple of tile_rows)."""
    tile_rows: int
    """keys per S^T register tile (unrolled)."""
    tile_cols: int
    """queries per S^T register tile (vectorised; a multiple of the lanes)."""
    out_rows: int = 8
    """queries per P V register tile (unrolled)."""
    out_cols: int = 32
    """head columns per P V register tile (vectorised; divides the padded head_dim)."""


def register_tiles(target, head_dim_padded, panel):
    """(tile_rows, tile_cols, out_rows, out_cols) for this target's registers.
    S^T: two vectors of queries, as many key rows as fit, at most 8: AVX-512 (32 zmm)
    8 x 32, AVX2 (16 ymm) 6 x 16, NEON 8 x 8 (the GEMMs' AVX-512 tile is 12 rows; key
    blocks here are whole S^T tiles, and 8 divides the block sizes and windows of 32 the
    defaults take). P V: the width (of 32, 16, 8 head columns dividing the padded head_dim
    and the panel) with the most accumulators: AVX-512 8 x 32, AVX2 6 x 16."""
    lanes, regs = target.lanes, target.vector_registers
    tile_rows, tile_cols = rows_that_fit(2, regs), 2 * lanes
    best = None
    for width in (32, 16, 8):
        if head_dim_padded % width or panel % width or width % lanes:
            continue
        rows = rows_that_fit(width // lanes, regs)
        if best is None or rows * width > best[0] * best[1]:
            best = (rows, width)
    out_rows, out_cols = best or (rows_that_fit(1, regs), lanes)
    return tile_rows, tile_cols, out_rows, out_cols


BAND_TILE = 32


def computed_scores(workload, cfg, states=(PARTIAL, FULL)) -> int:
    """Scores the template computes under cfg: the query tiles' rows x the key blocks the
    mask's block table does not skip (the first batch row and head where the table has
    several); states=(PARTIAL,): those it computes through the mask."""
    w = workload
    table = block_table(w.mask, w.batch, w.heads, w.seq, cfg.q_tile,
                        cfg.kv_block, lengths=bool(w.lengths),
                        symbolic=bool(w.symbolic))[0, 0]
    rows = np.minimum(cfg.q_tile, w.seq - cfg.q_tile * np.arange(table.shape[0]))
    return int((np.isin(table, states).sum(axis=1) * rows).sum() * cfg.kv_block)


def rows_dividing(n, most):
    """The most S^T key rows, at most `most` and at least 4, that divide n (None: none do):
    4 for AVX2's 6 and query tiles or bands of 16, 32 or 64."""
    return next((r for r in range(most, 3, -1) if n % r == 0), None)


def narrow_band_tiles(workload, cfg):
    """Query tiles and key blocks of BAND_TILE, aligned (S^T tiles of fewer key rows where
    the target's do not divide it: AVX2 4 x 16), when the mask's block table leaves them at
    most 0.8x the scores of cfg to compute: a band of keys per query, as a sliding window,
    whose wider tiles compute mostly hidden scores. A causal mask saves too little: cfg
    stays (the measurements: benchmarks/PERFORMANCE.md, Schedule decisions). None: keep
    cfg."""
    tr = rows_dividing(BAND_TILE, cfg.tile_rows)
    if BAND_TILE % cfg.tile_cols or tr is None or cfg.q_tile == cfg.kv_block == BAND_TILE:
        return None
    fine = replace(cfg, q_tile=BAND_TILE, kv_block=BAND_TILE, tile_rows=tr)
    if computed_scores(workload, fine) <= 0.8 * computed_scores(workload, cfg):
        return fine
    return None


def aligned_key_blocks(workload, cfg):
    """Key blocks as wide as the query tiles where the S^T tile's key rows do not divide
    them (AVX2's 6 rows, query tiles of 16, 32 or 64), with S^T tiles of the most rows up to
    cfg's that do (AVX2: 4), where that computes at most 3/4 of the scores through the mask:
    blocks of 36 or 66 keys straddle a causal diagonal's query tiles, each of which then
    meets two partial blocks, not one (measured: benchmarks/PERFORMANCE.md, Schedule
    decisions). None: keep cfg."""
    rows = rows_dividing(cfg.q_tile, cfg.tile_rows)
    if rows is None or rows == cfg.tile_rows:
        return None
    fine = replace(cfg, kv_block=cfg.q_tile, tile_rows=rows)
    if (computed_scores(workload, fine, (PARTIAL,))
            <= 0.75 * computed_scores(workload, cfg, (PARTIAL,))):
        return fine
    return None


def _balanced(total, goal, unit):
    """A tile size: a multiple of `unit` within [goal/2, 1.5 goal] (at least one unit) that
    covers `total` with the least padding, the closest to `goal` among those. Padding is
    work thrown away: 128 keys in blocks of 96 waste a third (benchmarks/PERFORMANCE.md,
    Schedule decisions)."""
    import math
    sizes = [k * unit for k in range(1, int(1.5 * goal) // unit + 1) if k * unit >= goal / 2]
    sizes = sizes or [unit]
    return min(sizes, key=lambda n: (-(-total // n) * n, abs(math.log2(n / goal))))


def attention_tiles(workload, target):
    """(tile_rows, tile_cols, out_rows, out_cols): register_tiles, or on AMX S^T in
    tiles of 32 keys x 32 queries."""
    tiles = register_tiles(target, workload.head_dim_padded, workload.panel)
    if workload.amx:
        return (amx.ROWS, amx.COLS) + tiles[2:]
    return tiles


def default_tiles(workload, target):
    """The default config: query tiles, key blocks and register tiles from the sequence, the
    mask, the target's registers and cores (the reasons below; the measurements in
    benchmarks/PERFORMANCE.md, Schedule decisions)."""
    seq = workload.seq
    keys = workload.kv_seq or seq    # the context's length in cross-attention
    tr, tc, orows, ocols = attention_tiles(workload, target)
    # q_tile: whole S^T tiles (P V covers it in tiles one row apart where out_rows does
    # not divide it: AVX2's query tiles of 64, not 48, pad fewer queries; see
    # benchmarks/PERFORMANCE.md, Schedule decisions)
    q_tile = _balanced(seq, 64 if seq >= 256 else 32, tc)
    if seq < 256 and workload.mask is None:
        # unmasked and short: ~64 where that pads no more queries and leaves every core 4
        # tasks; masked layers keep 32: a causal one skips more blocks (measured:
        # benchmarks/PERFORMANCE.md, Schedule decisions)
        wider = _balanced(seq, 64, tc)
        tasks = workload.batch * workload.heads * -(-seq // wider)
        if (round_up(seq, wider) <= round_up(seq, q_tile)
                and tasks >= 4 * target.cores):
            q_tile = wider
    # a task a core at least: smaller query tiles (down to one S^T tile wide) where the
    # (batch, head, query tile) tasks would leave cores idle (8 heads at seq 256 on 64
    # cores: 32 tasks of 64 queries, or 64 of 32)
    while q_tile > tc and workload.batch * workload.heads * -(-seq // q_tile) \
            < target.cores:
        q_tile = max(tc, q_tile // 2 // tc * tc)
    # key blocks of ~128 keys (~96 with 16 registers: smaller tiles, and a 32 KiB L1);
    # ~256 on AMX tiles: P V then loads and stores its O^T tiles, and rescales O^T, once
    # per 8 steps of 32 keys, not 4; ~512 on bfloat16 pairs, for the same reason (see
    # benchmarks/PERFORMANCE.md, Schedule decisions); fewer keys than the goal: one
    # block of them
    kv_goal = (256 if workload.amx else 512 if workload.pairs
               else 128 if target.vector_registers >= 32 else 96)
    kv_block = (_balanced(keys, min(kv_goal, keys), tr) if keys >= 128
                else round_up(keys, tr))
    if workload.mask is not None and keys == seq:
        # key blocks as wide as the query tiles: a causal diagonal block then wastes a
        # quarter of a 64 x 64 tile, not of 64 x 128, and a short causal sequence skips
        # blocks at all (see benchmarks/PERFORMANCE.md, Schedule decisions)
        kv_block = round_up(q_tile, tr)
    cfg = AttentionConfig(q_tile=q_tile, kv_block=kv_block, tile_rows=tr, tile_cols=tc,
                          out_rows=orows, out_cols=ocols)
    if workload.mask is not None and keys == seq:
        return (narrow_band_tiles(workload, cfg) or aligned_key_blocks(workload, cfg)
                or cfg)
    return cfg


def longest_tile(length, multiple):
    """The longest query tile or key block worth having over `length` rows: twice the
    length (at least 16), rounded up to whole register tiles of `multiple` rows."""
    return round_up(2 * max(length, 8), multiple)
