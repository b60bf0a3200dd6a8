"""Fused attention template for CPUs with wide vectors (flash-style online softmax).

One parallel task per (batch, head, query tile of q_tile rows). The task works on transposed
scores: rows are keys, vector lanes are queries. So it reads K and V where the QKV GEMM wrote
them (no K^T copy), and every softmax reduction runs down the rows, lane-wise, with no
horizontal reduction. The task first copies its Q tile transposed and scaled by
scale * log2(e) (Q^T, d x q_tile). Then, for each key block of kv_block keys that the block
table does not skip:
    S^T = K Q^T in register tiles of tile_rows keys x tile_cols queries; the tile's write-back
          applies the mask (partial blocks only) and folds in the running max m' = max(m, S^T);
    P^T = 2^(S^T - m'), l = l 2^(m - m') + sum_keys P^T (lane-wise over queries);
    O = O 2^(m - m') + P V in register tiles of at most out_rows queries (their heights one
        apart: q_tile need not be a multiple of out_rows) x out_cols head columns (the
        rescale happens when the tile is loaded), V rows read straight from qkv.
Partial blocks differ from full ones only in the write-back's mask: their key rows stay
affine (no clamp per row, which cost 4 integer instructions per broadcast; see
benchmarks/PERFORMANCE.md, Schedule decisions). Only a block that runs past the last
key is cut: its S^T tiles stop at the tile holding the last key (that tile alone clamps its
rows) and P V stops at the last key: seq 512 in key blocks of 132 computes 4 padded keys in
S^T and none in P V, not 16 in both.
Both register tiles are sized from the target's vector registers (register_tiles): the
accumulators, the vectors they multiply and one broadcast fit without spills.
Finally out = O / l (a row that saw no key gives 0). Memory per task: q_tile x (kv_block +
2 head_dim) floats; the [S, S] score matrix never exists. The block table (built at build
time from the mask expression, like FlexAttention's BlockMask) marks each (query tile, key
block) as 0 skip, 1 partial (apply the mask), 2 full (no mask work): causal masks skip about
half the blocks.
bfloat16 pairs (w.pairs, targets with AVX-512 BF16): qkv is bfloat16; Q^T is copied
unscaled as int32 pairs of head columns and the write-back applies the scale; S^T = K Q^T
and P V run on vdpbf16ps (bf16_dot), P packed into pairs of keys in bfloat16 and the block's
V rows zipped likewise; the softmax stays float32.
AMX tiles (w.amx, AMX-BF16 targets, head_dim whole 32s: amx.py): qkv is bfloat16, Q^T
is copied as for pairs; S^T runs on tiles of 32 x 32 (key tiles and query tiles of 32), its
write-back reads the stored tile; P V runs as O^T = V^T P^T: the softmax's bfloat16 pairs
of P^T are its B tiles as packed, V^T its A tiles (the kernel's first parallel loop
transposes V once a call, into a workspace of V's size); O^T is rescaled lane-wise before
P V accumulates into it and turned back into rows at the task's end.
Packed calls (w.varlen, mhagen/packed.py): the same template over a tile table the call
writes, one task per (head, query tile of one sequence), each sequence's rows and lengths in
place of a batch row's (ScoreRules: key_row, query_base, queries, keys); positions count
from the sequence's start, so the block table of an any-length build holds. No AMX there
(V^T is transposed by batch row): pairs instead.
Pairs and AMX: the softmax writes P^T straight into bfloat16 pairs; without a score
modifier the scores stay unscaled until the softmax's exponent (LATE_SCALE). AVX-512: 2^t
on LLVM IR helpers (fast_math.EXP2_16: vreduceps, a polynomial, vscalefps).

The template by stage, one file each (as FlashAttention 3's hopper/ kernel):
  attention.py           the rule (AttentionRule) and build_attention, the entry
  attention_tiles.py     config, register tiles and the default tiles' heuristics
  attention_layout.py    KernelLayout: the typed record every stage reads
  attention_scores.py    S^T = K Q^T in register tiles or on AMX
  attention_mask.py      the mask, the score modifier and the running max on write-back
  attention_softmax.py   the online softmax
  attention_values.py    P V (register tiles, bfloat16 pairs, AMX)
  attention_kernel.py    the main loop: tasks, Q^T, key blocks, out = O / l
"""
from dataclasses import replace

from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, attention_entry
from mhagen.schedules.x86 import amx, denormals
from mhagen.schedules.cpu.attention_kernel import (ON_STACK, body_macro,  # noqa: F401
                                                   query_tile_order, task_tile)
from mhagen.schedules.cpu.attention_layout import kernel_layout
from mhagen.schedules.cpu.attention_tiles import (  # noqa: F401
    BAND_TILE, AttentionConfig, aligned_key_blocks, attention_tiles, computed_scores,
    default_tiles, longest_tile, narrow_band_tiles, register_tiles, rows_dividing)
from mhagen.schedules.x86.bf16_dot import HELPERS, with_llvm_ir
from mhagen.schedules.cpu.fast_math import EXP2_HELPER, SCORE_MATH
from mhagen.schedules.x86.transpose import transpose


class AttentionRule:
    name = "attention"
    flush_denormals = False   # the x86 backend's rule flushes them (schedules/x86/denormals.py)
    # the x86 backend's rule links x86 LLVM IR helpers: EXP2_16 (AVX-512) and Q^T's copy
    # through register transposes (schedules/x86/transpose.py)
    x86_helpers = False

    def applies(self, stage, target):
        return stage.pattern == "attention_template"

    @staticmethod
    def tiles(workload, target):
        """(tile_rows, tile_cols, out_rows, out_cols): attention_tiles.py."""
        return attention_tiles(workload, target)

    def default_config(self, workload, target):
        return default_tiles(workload, target)

    def make_config(self, values: dict, target, workload) -> AttentionConfig:
        """A config from a tuning record, checked against the template's constraints for
        this workload (a record edited by hand met an assertion in build_attention)."""
        cfg = AttentionConfig(**{k: int(values[k]) for k in
                                 ("q_tile", "kv_block", "tile_rows", "tile_cols", "out_rows",
                                  "out_cols")})
        lanes, w = target.lanes, workload
        keys = w.kv_seq or w.seq
        most = 4 * target.vector_registers     # accumulators of a register tile, spilled or not
        broken = (min(cfg.q_tile, cfg.kv_block, cfg.tile_rows, cfg.tile_cols, cfg.out_rows,
                      cfg.out_cols) < 1
                  # tiles within twice the sequence (as candidates) and register tiles
                  # within reason
                  or cfg.q_tile > longest_tile(w.seq, cfg.tile_cols)
                  or cfg.kv_block > max(longest_tile(keys, cfg.tile_rows),
                                        round_up(cfg.q_tile, cfg.tile_rows))
                  or cfg.out_rows > cfg.q_tile
                  or cfg.tile_rows * cfg.tile_cols > most * lanes
                  or cfg.out_rows * cfg.out_cols > most * lanes
                  or cfg.q_tile % cfg.tile_cols or cfg.kv_block % cfg.tile_rows
                  or cfg.tile_cols % lanes or cfg.out_cols % lanes
                  # a P V vector lies inside one qkv panel and one head
                  or w.panel % cfg.out_cols or w.v_base % cfg.out_cols
                  or w.head_dim_padded % cfg.out_cols
                  or (w.amx and (cfg.tile_rows, cfg.tile_cols) != (amx.ROWS, amx.COLS)))
        if broken:
            raise ValueError(f"{cfg} breaks the template's tiling constraints")
        return cfg

    def candidates(self, workload, target) -> list:
        """Configs worth measuring for a workload (the tuning space of this template): query
        tiles of about 32, 64, 128 and key blocks of about 64, 128, 256, in whole tiles.
        (P V tiles of 4 rows instead of AVX2's 6 were candidates while query tiles had to be
        whole P V tiles; with P V tiles one row apart they measured the same at 1x128.)"""
        seq = workload.seq
        default = self.default_config(workload, target)
        # the grid in the register tile's rows (the default may take fewer: aligned tiles)
        rows = self.tiles(workload, target)[0]
        out = []
        for q_goal in (32, 64, 128):
            for kv_goal in (64, 128, 256):
                kv_block = round_up(kv_goal, rows)
                q_tile = max(default.tile_cols, q_goal // default.tile_cols * default.tile_cols)
                # make_config's key bound (a 64-key goal on AVX2 at seq 32: 66 keys)
                if q_tile > 2 * seq or kv_block > longest_tile(seq, rows):
                    continue
                c = replace(default, q_tile=q_tile, kv_block=kv_block, tile_rows=rows)
                if c not in out:
                    out.append(c)
        return [default] + [c for c in out if c != default]

    def build(self, w, cfg, target):
        return build_attention(w, cfg, target.lanes, flush=self.flush_denormals,
                               x86_helpers=self.x86_helpers)


def padded_head_dim(head_dim, lanes):
    """Columns per head in qkv (the lowering pads them with zeros): a multiple of the vector
    lanes, so P V vectors over head_dim are whole vectors (head_dim 40: 48 on AVX-512, 40 on
    AVX2)."""
    return round_up(head_dim, lanes)


def build_attention(w, cfg, lanes, flush=False, x86_helpers=False):
    """The attention PrimFunc for workload w (see mhagen/workloads.py for its fields).
    flush: each task runs with denormals flushed to zero (x86: denormals.py); x86_helpers:
    the x86 LLVM IR helpers are linked where they apply (AVX-512's EXP2_16, Q^T's copy
    through register transposes)."""
    rules = ScoreRules(w, SCORE_MATH)
    # the block table's extents (the lowering builds the table with the same)
    n_q_tiles = -(-w.seq // cfg.q_tile)
    n_kv_blocks = -(-(w.kv_seq or w.seq) // cfg.kv_block)
    k = kernel_layout(w, cfg, lanes, flush, x86_helpers, rules, n_q_tiles, n_kv_blocks)
    func = attention_entry(body_macro(k, rules), rules, (k.NP, k.M, k.PW),
                           (k.TB, k.TH, k.NQT, k.NKB), k.B, (k.MA, k.HD),
                           kv_shape=k.KV_SHAPE, dtype=k.QKV_DTYPE, out_dtype="float32")
    # LLVM IR linked into the kernel: the dot product (bf16_dot.py), the MXCSR helpers
    return with_llvm_ir(func, (HELPERS if k.QT_PAIRS else "") + (EXP2_HELPER if k.AVX512 else "")
                        + (amx.HELPERS if k.AMX else "")
                        + (transpose(k.QT_TRANSPOSE, k.LN, "i32", "i64") if k.QT_SHUFFLE else "")
                        + (denormals.HELPERS if flush else ""))
