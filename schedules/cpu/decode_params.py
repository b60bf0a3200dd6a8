"""The CPU decode template's parameters: one typed, frozen record of every size, base column
and switch its stages read (as FlashAttention 3's one params struct), made once a build.

decode_params   the record (DecodeParams) of workload w under cfg
sequence_of_macro  the batch row of a packed call's token (cache append, rotary)
DecodeParams    its fields, and what every stage computes the same way: loaded (a cache
                value as float32), count, first_row, rows_of, tiles_of (a batch row's new
                tokens, its first row of qkv and att, its query rows and row tiles), kv_len_of
                and n_blocks (its keys and key blocks in this call), key_block and key_slot
                (where a key block and a key lie in the cache: contiguous, or a pool block
                through the block table)

The stages (decode_rows.py, decode_blocks.py, decode_kernel.py) unpack the fields they use
into the short names of the template's TIR.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.blockmask import conjuncts
from mhagen.ir import expr as ex
from mhagen.lower.te import LOG2E
from mhagen.schedules.cpu.decode_tiles import (decode_layout, heads_in_tile, keys_in_flight,
                                               rows_in_lanes)
from mhagen.schedules.cpu.fast_math import f32


@dataclass(frozen=True)
class DecodeParams:
    """Sizes in the template's short names (ints, or TIR expressions of the call's batch and
    seq in symbolic-length builds)."""
    B: object            # batch rows (the call's where symbolic)
    S: object            # new tokens a batch row (the call's where symbolic)
    H: int               # query heads
    G: int               # K/V heads; head h reads K/V head h // GROUP
    GROUP: int
    d: int               # head_dim
    DP: int              # columns a head in qkv (head_dim padded to the lanes)
    HD: int              # att's columns: H * d
    N: int               # the cache's max_len
    CD: str              # what the cache stores
    # qkv [NP, M, PW], att [MA, HD]
    PW: int
    NP: int
    M: object
    MA: object
    Q_BASE: int
    # the split (decode_layout): R query rows a K/V head in NRT tiles of RT, NG groups,
    # NP_MAX partials; C workers; KB keys a block
    R: object
    NRT: object
    NG: object
    NP_MAX: int
    RT: int
    C: int
    KB: int
    # vectors: LN lanes; a head_dim row as NCH whole vectors and TAIL floats, an O row as QCH
    # vectors; rows in the lanes (ROW_LANES) with JU keys' scores in flight
    LN: int
    NCH: int
    TAIL: int
    QCH: int
    ROW_LANES: bool
    JU: int
    causal: bool         # the mask has kv_idx <= q_idx: a tile's keys end at its last query
    c_log2e: object      # scale * log2(e)
    neg_inf: object
    zero: object
    flush: bool          # workers run with denormals flushed to zero (x86: denormals.py)
    # packed: row b's new tokens are rows cu_seqlens[b] .. cu_seqlens[b+1]-1 of qkv and att
    # (S is then the call's tokens in all, NRT and NG bounds); BS: a paged cache's block
    # (k_cache, v_cache are pools [blocks, G, BS, d] read through block_tables), else None
    packed: bool = False
    BS: int | None = None
    # the groups' K/V heads and query heads: G and GROUP, or with tiles across the K/V heads
    # (heads_in_tile, a paged cache) 1 and H, each row then reading head h // GROUP
    GT: int = 0
    GROUPT: int = 0

    @property
    def across(self) -> bool:
        """Row tiles run across the K/V heads (decode_tiles.heads_in_tile)."""
        return self.GT != self.G

    def kv_head(self, g, h):
        """The K/V head query head h (of group head g) reads."""
        return h // self.GROUP if self.across else g

    def loaded(self, value):
        """A K/V value read from the cache, as float32 (a half cache converts it)."""
        return value if self.CD == "float32" else T.Cast("float32", value)

    def count(self, cu, b):
        """New tokens of batch row b in this call."""
        return cu[b + 1] - cu[b] if self.packed else self.S

    def first_row(self, cu, b):
        """Batch row b's first row of qkv and att (its token 0)."""
        return cu[b] if self.packed else b * self.S

    def rows_of(self, cu, b):
        """Query rows of batch row b that read one K/V head (GROUP heads x its tokens)."""
        return self.GROUPT * self.count(cu, b) if self.packed else self.R

    def tiles_of(self, cu, b):
        """Row tiles of batch row b (groups a K/V head; 0 for a row without new tokens)."""
        return (self.rows_of(cu, b) + self.RT - 1) // self.RT if self.packed else self.NRT

    def q_len(self, cu, b):
        """What masks and score modifiers read as q_len (None: the rules' own seq)."""
        return self.count(cu, b) if self.packed else None

    def kv_len_of(self, cache_lens, cu, b):
        """The keys batch row b sees in this call: its cached keys and the new ones."""
        return T.min(cache_lens[b] + self.count(cu, b), self.N)

    def n_blocks(self, cache_lens, cu, b):
        """Key blocks of batch row b in this call."""
        return (self.kv_len_of(cache_lens, cu, b) + self.KB - 1) // self.KB

    def key_block(self, tables, b, k0):
        """(the cache's first index, the position in it) of key k0 of batch row b, a key
        block's first: row b at k0, or in a paged cache the pool block the block table
        gives at k0 % BS (KB divides BS: a key block lies in one pool block)."""
        if self.BS is None:
            return b, k0
        return tables[b, k0 // self.BS], k0 % self.BS

    def key_slot(self, base, *offsets):
        """The position of key base + offsets in its cache row or pool block (clamped to
        the contiguous cache's rows: a last key block may run past max_len, masked)."""
        at = base
        for o in offsets:
            at = at + o
        return at if self.BS is not None else T.min(at, self.N - 1)


def sequence_of_macro(batch):
    """sequence_of(cu, row, found): found[0] = the batch row whose packed tokens hold `row`
    (the last b with cu[b] <= row: rows without new tokens are passed over), for the cache
    append and rotary kernels of packed decoding calls."""
    @T.macro
    def sequence_of(cu, row, found):
        found[0] = 0
        for bb in range(1, batch):
            if cu[bb] <= row:
                found[0] = bb

    return sequence_of


def decode_params(w, cfg, registers, flush, rules):
    """The record of workload w (typed) under cfg; registers: the target's vector registers;
    rules: the workload's ScoreRules (the call's lengths in symbolic builds)."""
    H, G, d, DP, PW = w.heads, w.kv_heads, w.head_dim, w.head_dim_padded, w.panel
    split = decode_layout(w, cfg)
    RT, KB, LN = cfg.row_tile, cfg.kv_block, cfg.lanes
    assert KB % LN == 0 and PW % LN == 0 and DP % LN == 0 and w.q_base % LN == 0
    assert LN in (4, 8, 16), LN
    R, NRT, NG, M, MA = split.rows, split.n_row_tiles, split.groups, w.rows, w.att_rows
    B, S, GROUP = rules.batch, rules.seq, H // G
    across = heads_in_tile(w, LN)
    GT, GROUPT = (1, H) if across else (G, GROUP)
    if rules.symbolic:
        R = GROUPT * S
        NRT = (R + RT - 1) // RT
        NG = B * GT * NRT
        M = MA = (B * S + w.row_tile - 1) // w.row_tile * w.row_tile
    if w.packed:    # the rows of every batch row (the cache's, fixed) in the call's S rows
        B, NG = w.batch, GT * ((GROUPT * S + RT - 1) // RT + w.batch)
    # a causal part (kv_idx <= q_idx) bounds a row tile's keys by its last query's position:
    # a prompt's tile skips the blocks above the diagonal, as the prefill template does
    causal = w.mask is not None and any(p == ex.causal() for p in conjuncts(w.mask))
    return DecodeParams(
        B=B, S=S, H=H, G=G, GROUP=GROUP, d=d, DP=DP, HD=H * d, N=w.cache, CD=w.cache_dtype,
        PW=PW, NP=w.qkv_width // PW, M=M, MA=MA, Q_BASE=w.q_base, R=R, NRT=NRT, NG=NG,
        NP_MAX=split.partials, RT=RT, C=cfg.workers, KB=KB, LN=LN, NCH=d // LN, TAIL=d % LN,
        # O rows go a vector at a time: see rescaled_row
        QCH=DP // LN, ROW_LANES=rows_in_lanes(RT, LN) and not across,
        JU=keys_in_flight(RT, LN, registers, KB),
        causal=causal, c_log2e=f32(w.scale * LOG2E), neg_inf=f32(float("-inf")),
        zero=f32(0.0), flush=flush, packed=w.packed, BS=w.kv_block_size, GT=GT,
        GROUPT=GROUPT)
