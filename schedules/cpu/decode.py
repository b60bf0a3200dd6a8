"""Decoding with a K/V cache on CPUs (x86 and aarch64 alike): the cache append and a
split-KV ("flash-decoding") attention template.

cache_append  the new tokens' K and V rows (where the QKV GEMM wrote them, each head
              padded to the lanes) copied into k_cache / v_cache [B, G, max_len, d] at row
              cache_lens[b] + t; one parallel task per new token.
attention     a decode step has one query per head (or a few: S new tokens x the query heads
              sharing a K/V head), too few to fill the prefill template's vector lanes
              (there lanes are queries). Here lanes run along head_dim instead (a score is
              a dot product and a horizontal sum; tiles of 8 or more rows, the query heads
              of a K/V head x the tokens, put the rows in the lanes for the scores:
              rows_in_lanes), and the keys are split ("flash-decoding"): the call's key
              blocks, group after group (a group: batch row, K/V head, row tile, where the
              rows are the GROUP x S queries that read that K/V head), are cut into
              `workers` even, contiguous shares (balanced_share), one parallel task each
              (one a core by default), as Stream-K cuts a GEMM's k loops.
              A task walks the pieces of groups its share meets with the online softmax
              (scores in log2 units, as the prefill template), each leaving an unnormalised
              partial (O, m, l); a second parallel loop merges each group's pieces: O = sum_p
              2^(m_p - m) O_p, l = sum_p 2^(m_p - m) l_p, out = O / l (0 for a row that saw
              no key). Only the call's keys (kv_len = cache_lens[b] + S) count, so every
              thread runs the same work whatever the rows' cache lengths (splits of the
              cache had left a thread the long row), and each task streams one stretch of
              the cache (not splits interleaved with the rows or with each other; measured:
              benchmarks/PERFORMANCE.md, Schedule decisions).
              Each K and V row is read from memory once per piece (the rows of a tile reuse
              it from L1): the step is bound by reading the cache.
Positions are absolute: query t of row b is at q_idx = cache_lens[b] + t; every score goes
through the mask (no block table: the cache length is known only per call).
Packed calls (built for any number of new tokens): row b adds its own count of tokens, rows
cu_seqlens[b] .. cu_seqlens[b+1]-1 of qkv and att; its groups are its own row tiles (none
for a row without new tokens), and a tile's rows find their heads and positions once, at
the start of a piece. A paged cache (kv_block_size): k_cache and v_cache are pools [blocks,
G, block, d] read through block_tables [batch, max_len / block], one table read a key block
(whose keys lie in one pool block: the key block divides the pool's); where a K/V head's
rows would keep the lanes along head_dim, the row tiles run across the K/V heads
(heads_in_tile), so a tile reads each pool block's K and V in one stretch.

The templates by stage, one file each:
  decode.py          the rules (DecodeRule, CacheAppendRule), build_decode, cache_append
  decode_tiles.py    config, the split into groups and partials, the default's heuristics
  decode_params.py   DecodeParams: the typed record every stage reads
  decode_rows.py     row primitives: lane reductions, dot products, O-row updates
  decode_blocks.py   a key block's scores, softmax and values (rows in lanes, or not)
  decode_kernel.py   pieces, workers' shares, the merge of partials, the PrimFunc
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import tirx
from tvm.script import tirx as T

from mhagen.lower.te import call_scalars
from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, with_scalars
from mhagen.schedules.x86 import denormals
from mhagen.schedules.x86.bf16_dot import with_llvm_ir
from mhagen.schedules.cpu.decode_kernel import decode_function, with_buffers
from mhagen.schedules.cpu.decode_params import decode_params, sequence_of_macro
from mhagen.schedules.cpu.decode_tiles import (  # noqa: F401
    DecodeConfig, DecodeSplit, balanced_share, decode_kv_block, decode_layout,
    default_decode_config, keys_in_flight, rows_in_lanes)
from mhagen.schedules.cpu.fast_math import SCORE_MATH


class DecodeRule:
    """The split-KV attention of decoding layers (mhagen/lower/fused.py, cache branch)."""
    name = "decode_attention"
    flush_denormals = False   # the x86 backend's rule flushes them (schedules/x86/denormals.py)

    def applies(self, stage, target):
        return stage.pattern == "decode_template"

    def default_config(self, workload, target):
        return default_decode_config(workload, target)

    def make_config(self, values: dict, target, workload) -> DecodeConfig:
        """A config from a tuning record, checked against the template's constraints and
        bounded by the workload (an edited record's row tile of 10^6 rows hung the build;
        2^31 workers overflowed its int32 indices)."""
        cfg = DecodeConfig(**{k: int(values[k]) for k in
                              ("row_tile", "workers", "kv_block", "lanes")})
        rows = decode_layout(workload, cfg).rows if cfg.row_tile >= 1 else 0
        if (min(cfg.row_tile, cfg.workers, cfg.kv_block) < 1 or cfg.lanes != target.lanes
                or cfg.kv_block % cfg.lanes
                or cfg.row_tile > round_up(max(rows, 16), cfg.lanes)
                or cfg.workers > 64 * max(1, target.cores)
                or cfg.kv_block > max(round_up(workload.cache, cfg.lanes), 128)
                or (workload.kv_block_size and workload.kv_block_size % cfg.kv_block)):
            raise ValueError(f"{cfg} breaks the template's constraints for {target.name} "
                             f"({target.lanes} lanes)")
        return cfg

    def candidates(self, workload, target) -> list:
        """Configs worth measuring (the tuning space of this template), the default first:
        1, 2, 4 or 8 tasks a core; key blocks of 16 to 128 (whole vectors); row tiles of
        the default's, and of 4 and 8 rows where a K/V head has more query rows (smaller
        tiles read the head's keys once per tile, but give more tasks)."""
        default = self.default_config(workload, target)
        cores = max(1, target.cores)
        tiles = [default.row_tile] + [t for t in (8, 4) if t < default.row_tile]
        out = [default]
        for row_tile in tiles:
            for per_core in (1, 2, 4, 8):
                for kv_goal in (16, 32, 64, 128):
                    c = replace(default, row_tile=row_tile, workers=per_core * cores,
                                kv_block=round_up(kv_goal, target.lanes))
                    if workload.kv_block_size and workload.kv_block_size % c.kv_block:
                        continue     # a paged cache's key blocks lie in one pool block
                    if c not in out:
                        out.append(c)
        return out

    def build(self, w, cfg, target):
        return build_decode(w, cfg, target.vector_registers, flush=self.flush_denormals)

    def partial_shapes(self, w, cfg):
        """Shapes of the two temporaries of partial results: O [partials, row_tile, padded
        d] and (m, l) [partials, 2, row_tile]."""
        n = decode_layout(w, cfg).partials
        return (n, cfg.row_tile, w.head_dim_padded), (n, 2, cfg.row_tile)


@dataclass(frozen=True)
class CacheAppendConfig:
    lanes: int
    """floats per vector copied along head_dim."""


class CacheAppendRule:
    name = "cache_append"

    def applies(self, stage, target):
        return stage.pattern == "cache_append_template"

    def default_config(self, workload, target):
        return CacheAppendConfig(lanes=target.lanes)

    def build(self, w, cfg, target):
        return build_cache_append(w, cfg)


def _chunks(d, lanes):
    """(whole vectors, tail floats) covering d columns."""
    return d // lanes, d % lanes


def build_cache_append(w, cfg):
    """cache_append (qkv, cache_lens, [cu_seqlens,] [block_tables,] k_cache, v_cache) for
    workload w: one task a new token (a packed call's: the call's tokens, each finding its
    batch row), its K and V rows at position cache_lens[b] + t of row b's cache, or (paged)
    of the pool block the block table gives."""
    B, S, G, d, DP = w.batch, w.seq, w.kv_heads, w.head_dim, w.head_dim_padded
    N, PW = w.cache, w.panel
    NP, M = w.qkv_width // PW, w.rows
    PACKED, PAGED, BS = w.packed, w.kv_block_size is not None, w.kv_block_size
    assert PACKED or not w.symbolic    # decoding layers run any number of new tokens packed
    scalars = ()
    tokens = B * S
    if PACKED:      # the call's tokens (scalars batch 1, seq the tokens); B: the cache's rows
        scalars = call_scalars()
        tokens = scalars[0] * scalars[1]
        M = (tokens + w.row_tile - 1) // w.row_tile * w.row_tile
    K_BASE, V_BASE = w.k_base, w.v_base
    LN = cfg.lanes
    NCH, TAIL = _chunks(d, LN)
    CD = w.cache_dtype
    assert PW % LN == 0 and DP % LN == 0 and K_BASE % LN == 0 and V_BASE % LN == 0
    cache_shape = (tirx.Var("num_blocks", "int32"), G, BS, d) if PAGED else (B, G, N, d)
    cu = tirx.decl_buffer((B + 1,), "int32", name="cu_seqlens") if PACKED else None
    tables = tirx.decl_buffer((B, -(-N // BS)), "int32", name="block_tables") \
        if PAGED else None
    sequence_of = sequence_of_macro(B)

    def stored(value):
        """A K/V value as the cache stores it (a half cache: rounded, nearest even)."""
        return value if CD == "float32" else T.Cast(CD, value)

    @T.macro
    def copy_head(qkv, cache, base, row, kr, g, pos):
        # K/V head g of qkv row `row` -> cache[kr, g, pos] (kr: the batch row or pool block)
        for ch in range(NCH):
            for ln in T.vectorized(LN):
                cache[kr, g, pos, ch * LN + ln] = stored(qkv[(base + g * DP + ch * LN) // PW,
                                                             row,
                                                             (base + g * DP + ch * LN) % PW
                                                             + ln])
        if TAIL > 0:
            for ln in T.vectorized(TAIL):
                cache[kr, g, pos, NCH * LN + ln] = stored(qkv[(base + g * DP + NCH * LN)
                                                              // PW, row,
                                                              (base + g * DP + NCH * LN) % PW
                                                              + ln])

    @T.macro
    def append_token(qkv, k_cache, v_cache, row, b, pos):
        if pos < N:       # the caller checks lens + S <= max_len; never write past it
            if PAGED:     # the pool block of position pos (the caller allocated it)
                kr = tables[b, pos // BS]
                for g in range(G):
                    copy_head(qkv, k_cache, K_BASE, row, kr, g, pos % BS)
                    copy_head(qkv, v_cache, V_BASE, row, kr, g, pos % BS)
            else:
                for g in range(G):
                    copy_head(qkv, k_cache, K_BASE, row, b, g, pos)
                    copy_head(qkv, v_cache, V_BASE, row, b, g, pos)

    @T.prim_func(check_well_formed=False)   # free scalars until they become parameters
    def cache_append(qkv: T.Buffer((NP, M, PW), "float32"),
                     cache_lens: T.Buffer((B,), "int32"),
                     k_cache: T.Buffer(cache_shape, CD),
                     v_cache: T.Buffer(cache_shape, CD)):
        T.func_attr({"global_symbol": "cache_append", "tirx.noalias": True})
        for task in T.parallel(tokens):
            if PACKED:    # token `task` of the call: batch row found, t = task - cu[b]
                found = T.decl_buffer((1,), "int32")
                sequence_of(cu, task, found)
                append_token(qkv, k_cache, v_cache, task, found[0],
                             cache_lens[found[0]] + task - cu[found[0]])
            else:
                b = task // S
                t = task % S
                pos = cache_lens[b] + t
                append_token(qkv, k_cache, v_cache, b * S + t, b, pos)

    return with_scalars(with_buffers(cache_append, 2, [x for x in (cu, tables) if x is not None]),
                        scalars)


def build_decode(w, cfg, registers=16, flush=False):
    """The decode attention PrimFunc (qkv, cache_lens, [cu_seqlens,] [block_tables,]
    k_cache, v_cache, part_o, part_ml, att) for workload w; registers: the target's vector registers; flush: the workers run
    with denormals flushed to zero (x86: denormals.py)."""
    rules = ScoreRules(w, SCORE_MATH)   # the mask and modifier, as the prefill template
    attention = decode_function(decode_params(w, cfg, registers, flush, rules), rules)
    attention = with_llvm_ir(attention, denormals.HELPERS if flush else "")   # MXCSR helpers
    return with_scalars(attention, rules.scalars, rules.tables)
