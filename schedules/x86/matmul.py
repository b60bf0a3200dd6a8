"""Register-blocked matmul C[b,i,j] = sum_k A[b,i,k] B[k,j] for CPUs with wide vectors.

Loop nest: parallel over (row tile, column tile); inside, k; inside, a tile_rows x tile_cols
accumulator kept in registers (rows unrolled, columns vectorised). Elementwise epilogues that
follow (bias, scale, mask) are folded into the tile's write-back, so they cost no extra pass.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class MatmulConfig:
    tile_rows: int
    """rows of C per register tile (unrolled): each row is one broadcast of A."""
    tile_cols: int
    """columns of C per register tile (vectorised): a multiple of the vector lanes."""


class MatmulRule:
    name = "matmul"

    def applies(self, stage, target):
        return stage.pattern == "matmul"

    def default_config(self, stage, target):
        lanes = target.lanes
        cols = stage.workload["cols"]
        # Two vectors wide when the columns allow it, else one (head widths of 40 or 64).
        tile_cols = 2 * lanes if cols >= 2 * lanes and cols % (2 * lanes) == 0 else lanes
        # Accumulators: tile_rows * tile_cols / lanes registers out of 32 (16 for AVX2).
        registers = 32 if target.vector_bits >= 512 else 16
        tile_rows = max(1, min(8, (registers - 4) * lanes // tile_cols, stage.workload["rows"]))
        return MatmulConfig(tile_rows=tile_rows, tile_cols=tile_cols)

    def apply(self, sch, stage, cfg, plan):
        blk = sch.get_sblock(stage.blocks[0])
        b, i, j, k = sch.get_loops(blk)
        # Row tiles stay inside one batch entry: fusing b into the rows before splitting
        # gives tiles that straddle two batches, which the write-back region gets wrong.
        io, ii = sch.split(i, [None, cfg.tile_rows])
        jo, ji = sch.split(j, [None, cfg.tile_cols])
        sch.reorder(b, io, jo, k, ii, ji)
        outer = sch.fuse(b, io, jo)
        sch.parallel(outer)
        acc = blk  # accumulates into a local tile; write_back copies the tile out
        write_back = sch.cache_write(blk, 0, "local")
        absorbed = []
        while True:  # fold the elementwise consumers (bias, scale, mask) into the write-back
            consumers = sch.get_consumers(write_back)
            if len(consumers) != 1:
                break
            nxt = plan.by_block.get(sch.get(consumers[0]).name_hint)
            if nxt is None or nxt.pattern != "epilogue":
                break
            sch.reverse_compute_inline(consumers[0])
            absorbed.append(nxt.name)
        sch.reverse_compute_at(write_back, outer)
        sch.unroll(ii)
        sch.vectorize(ji)
        sch.decompose_reduction(acc, k)
        wb_loops = sch.get_loops(write_back)
        sch.vectorize(wb_loops[-1])
        return absorbed
