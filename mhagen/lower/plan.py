"""The fused kernels' plan: everything decided about their layout (heads and their grouping,
padding, row counts, each GEMM's path, the temporaries' dtypes) before any TE is written.
The backend answers the target-specific questions (mhagen/backends.py); mhagen/lower/fused.py
turns the plan into buffers and kernels."""
from __future__ import annotations

from dataclasses import dataclass

from mhagen.dtypes import COMPUTE
from mhagen.errors import GraphError, TargetError
from mhagen.ir.heads import kv_head_map
from mhagen.program import round_up
from mhagen.workloads import AttentionWorkload


class NotFusable(Exception):
    """The fused attention's layout cannot express this graph: lower it unfused."""


@dataclass(frozen=True)
class GemmPath:
    """How one packed GEMM of the fused kernels multiplies (the backend's gemm_path)."""
    depth: int
    pairs: bool              # bfloat16 pairs of its depth in one instruction
    amx: bool                # on AMX tiles
    row_tile: int            # its register tile's rows
    pack_tile: int | None    # rows of A are first copied into panels of this many (or not)

    @property
    def paired(self) -> bool:
        """Its weights are packed in pairs of the depth (pairs or AMX)."""
        return self.pairs or self.amx


@dataclass(frozen=True)
class FusedPlan:
    """The layout of one layer's fused kernels on one backend.

    Rows: `rows` = batch * seq; rows_qkv / rows_att / rows_kv: the rows the qkv, att and kv
    temporaries hold (the GEMMs' padded rows; symbolic builds: the largest call's, padded to
    tile_rows). Columns: each head's head_dim columns padded to head_dim_padded; qkv_width,
    kv_width, out_width: the packed GEMMs' columns in panels of `panel`. The *_base offsets
    are the graph's (unpadded) first Q/K/V columns."""
    qkv_node: object
    att_node: object
    out_node: object
    kv_node: object | None       # cross-attention: the K/V projection of the context
    dtype: str                   # storage of x, the weights and out
    batch: int
    seq: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_padded: int
    q_base: int
    k_base: int
    v_base: int
    panel: int
    qkv_width: int
    out_width: int
    rows: int
    rows_qkv: int
    rows_att: int
    tile_rows: int               # symbolic builds pad each call's rows to this many
    qkv_gemm: GemmPath
    out_gemm: GemmPath
    temp: str                    # the att temporary's dtype
    qkv_temp: str
    kv_temp: str
    attention_path: str | None   # "pairs", "amx" or None (float32): the attention's products
    has_lengths: bool            # key (or cache) lengths given per call
    symbolic: dict | None
    cache: dict | None           # a decoding layer's {"max_len": N[, "dtype"]}
    cross: bool = False
    kv_seq: int | None = None
    kv_dim: int | None = None
    kv_width: int = 0
    kv_rows: int | None = None   # batch * kv_seq
    rows_kv: int | None = None
    kv_gemm: GemmPath | None = None
    kv_block_size: int | None = None   # a paged cache's tokens a block (mhagen.PagedKVCache)

    @property
    def packed(self) -> bool:
        """A decoding layer of any number of new tokens: its kernels take each batch row's
        count packed (cu_seqlens), the call's rows being all the rows' tokens."""
        return self.cache is not None and bool(self.symbolic and self.symbolic.get("seq"))

    @property
    def max_blocks(self) -> int:
        """A paged cache's block-table width: blocks of one sequence of max_len tokens."""
        return -(-self.cache["max_len"] // self.kv_block_size)

    @property
    def attrs(self) -> dict:
        return self.att_node.attrs

    @property
    def cache_dtype(self) -> str:
        return (self.cache or {}).get("dtype", "float32")

    @property
    def lengths_input(self) -> list:
        """The per-call lengths input's name, in a list (empty when there is none)."""
        return [self.att_node.inputs[-1]] if self.has_lengths else []

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim


def plan_fused(graph, batch, seq, backend, symbolic=None, kv_seq=None,
               kv_block_size=None) -> FusedPlan:
    """The plan of a fused graph (qkv_projection -> attention -> output_projection); raises
    TargetError / GraphError where the backend or the options refuse it, NotFusable where
    the heads are not in the regular grouped order. kv_block_size: a decoding layer's
    paged cache (tokens a block)."""
    nodes = {n.name: n for n in graph.nodes}
    by_kind = {n.kind: n for n in graph.nodes}
    att_node, out_node = by_kind["attention"], by_kind["output_projection"]
    qkv_node = nodes[att_node.inputs[0]]
    a = att_node.attrs
    cross, cache = bool(a.get("cross")), a.get("cache")
    kv_node = nodes[att_node.inputs[1]] if cross else None
    check_support(backend, cross, cache, symbolic)
    heads, kv_heads, (k_base, v_base) = head_groups(a)
    check_decode(backend, cache)
    check_paged(cache, kv_block_size)
    d_model = nodes[qkv_node.inputs[0]].attrs["shape"][2]
    kv_dim = nodes[kv_node.inputs[0]].attrs["shape"][2] if cross else None
    d, dtype = a["head_dim"], graph.dtype
    _, nr = backend.gemm_tile()
    dp = backend.head_dim_padded(d)
    gemms = {depth: _gemm_path(backend, dtype, depth, cache is not None)
             for depth in (d_model, heads * d, kv_dim) if depth}
    att_path = None if cache is not None or a.get("rotary") else \
        backend.attention_path(dtype, d)
    temp = dtype if backend.half_temps else COMPUTE
    d_out_p = round_up(out_node.attrs["out_features"], nr)
    layout = dict(
        qkv_node=qkv_node, att_node=att_node, out_node=out_node, kv_node=kv_node,
        dtype=dtype, batch=batch, seq=seq, d_model=d_model, heads=heads, kv_heads=kv_heads,
        head_dim=d, head_dim_padded=dp, q_base=a["q_offsets"][0], k_base=k_base,
        v_base=v_base, panel=nr, qkv_width=round_up(len(qkv_node.attrs["segments"]) * dp, nr),
        out_width=d_out_p, temp=temp, attention_path=att_path,
        qkv_temp="bfloat16" if att_path else temp, kv_temp="bfloat16" if att_path else COMPUTE,
        has_lengths=len(att_node.inputs) > 1 + cross, symbolic=symbolic, cache=cache,
        qkv_gemm=_packing(backend, gemms[d_model], dtype != COMPUTE),
        out_gemm=_packing(backend, gemms[heads * d]), kv_block_size=kv_block_size)
    if cross:
        layout.update(cross=True, kv_seq=kv_seq, kv_dim=kv_dim,
                      kv_width=round_up(len(kv_node.attrs["segments"]) * dp, nr),
                      kv_gemm=_packing(backend, gemms[kv_dim], dtype != COMPUTE))
    return FusedPlan(**layout, **_row_counts(backend, layout, gemms))


def check_support(backend, cross, cache, symbolic) -> None:
    """Refuse what the backend or the options do not compile fused: cross-attention where
    the backend's template does not take it, symbolic batches of decoding layers, symbolic
    lengths where the backend's kernels do not take them."""
    target = backend.target
    if cross and not backend.cross_attention:
        raise TargetError(f"cross-attention does not compile fused for {target.name} yet "
                          f"({backend.family}); build it with fuse=False or for a CPU target")
    if symbolic and symbolic["batch"] and cache is not None:
        raise GraphError("decoding layers (kv_cache=) run a fixed batch (the cache's): build "
                         "them with batch=B (seq_len=None serves any number of new tokens)")
    if symbolic and not backend.symbolic:
        raise TargetError(f"symbolic lengths (seq_len=None) do not compile for "
                          f"{target.name} yet ({backend.family}); build one module per length")


def check_decode(backend, cache) -> None:
    """A decoding layer needs the backend's decode template."""
    if cache is not None and backend.decode is None:
        raise TargetError(f"decoding layers (kv_cache=) do not compile for "
                          f"{backend.target.name} yet ({backend.family} has no decode "
                          "template); build them for a CPU target")


PAGE_MULTIPLE = 16   # a paged block holds whole key blocks of the decode template (16 or more
#                      keys, whole vectors of up to 16 lanes)


def check_paged(cache, kv_block_size) -> None:
    """A paged cache (kv_block_size) needs a decoding layer and blocks of a multiple of
    PAGE_MULTIPLE tokens: the decode template reads a key block from one pool block."""
    if kv_block_size is None:
        return
    if cache is None:
        raise GraphError("kv_block_size= builds a decoding layer for a paged K/V cache: "
                         "build mhagen.mha(..., kv_cache=max_len), or drop kv_block_size")
    if isinstance(kv_block_size, bool) or not isinstance(kv_block_size, int) \
            or kv_block_size < PAGE_MULTIPLE or kv_block_size % PAGE_MULTIPLE:
        raise GraphError(f"kv_block_size must be a multiple of {PAGE_MULTIPLE} (tokens a "
                         f"block of the paged cache; 16 or 32 are usual), got "
                         f"{kv_block_size!r}")


def head_groups(a: dict) -> tuple:
    """(heads, kv_heads, (k_base, v_base)) of an attention's attrs; NotFusable unless query
    head h reads K/V head h // (heads // kv_heads) and every head's columns follow the
    previous one's."""
    d, heads = a["head_dim"], len(a["q_offsets"])
    kv_pairs = list(dict.fromkeys(zip(a["k_offsets"], a["v_offsets"])))
    kv_heads = len(kv_pairs)
    q_base = a["q_offsets"][0]
    if (heads % kv_heads or a["q_offsets"] != [q_base + h * d for h in range(heads)]
            or [kv_pairs.index(p) for p in zip(a["k_offsets"], a["v_offsets"])]
            != kv_head_map(heads, kv_heads)
            or [p[0] for p in kv_pairs] != [kv_pairs[0][0] + g * d for g in range(kv_heads)]
            or [p[1] for p in kv_pairs] != [kv_pairs[0][1] + g * d for g in range(kv_heads)]):
        raise NotFusable("query heads do not read K/V heads in the regular grouped order "
                         "(head h reads K/V head h // (heads // kv_heads))")
    return heads, kv_heads, kv_pairs[0]


def _gemm_path(backend, dtype, depth, decoding) -> GemmPath:
    """A GEMM of this depth: AMX tiles, bfloat16 pairs or float32 (the backend's answer;
    not AMX in decoding layers, whose steps' few rows would be padded to a 32-row tile),
    its register tile rows, no packing yet (_packing)."""
    path = backend.gemm_path(dtype, depth, tiles=not decoding)
    pairs, amx = path == "pairs", path == "amx"
    return GemmPath(depth, pairs, amx, backend.gemm_tile(pairs=pairs, on_amx=amx)[0], None)


def _packing(backend, path: GemmPath, half=False) -> GemmPath:
    """The GEMM path with its rows packed first where the backend asks for that depth (or
    for half-precision rows: converted to float32 once, by the copy) and for GEMMs over
    pairs of the depth."""
    packs = backend.packs_rows(path.depth, half) or path.paired
    return GemmPath(path.depth, path.pairs, path.amx, path.row_tile,
                    path.row_tile if packs else None)


def _row_counts(backend, layout: dict, gemms: dict) -> dict:
    """The temporaries' rows: each GEMM's (padded to whole register tiles where the backend
    asks), or for symbolic lengths the largest call's padded to one row tile: the shortest
    of the GEMMs', or an AMX tile where a GEMM has them (those take whole tiles only)."""
    batch, seq, kv_seq = layout["batch"], layout["seq"], layout.get("kv_seq")
    rows, kv_rows = batch * seq, batch * kv_seq if layout.get("cross") else None
    out = {"rows": rows, "kv_rows": kv_rows,
           "rows_qkv": _gemm_rows(backend, rows, layout["qkv_gemm"], layout["qkv_width"]),
           "rows_att": _gemm_rows(backend, rows, layout["out_gemm"], layout["out_width"]),
           "rows_kv": _gemm_rows(backend, kv_rows, layout["kv_gemm"], layout["kv_width"])
           if kv_rows else None,
           "tile_rows": max([p.row_tile for p in gemms.values() if p.amx]
                            or [min(p.row_tile for p in gemms.values())])}
    if layout["symbolic"]:   # allocations: the largest call, padded to whole register tiles
        tile = out["tile_rows"]
        out.update(rows_qkv=round_up(rows, tile), rows_att=round_up(rows, tile),
                   rows_kv=kv_rows and round_up(kv_rows, tile))
    return out


def _gemm_rows(backend, rows, path: GemmPath, cols):
    """The rows a packed GEMM runs over (the backend's gemm_rows for its path)."""
    return backend.gemm_rows(rows, path.depth, cols, pairs=path.pairs, on_amx=path.amx)


def attention_workload(plan: FusedPlan) -> AttentionWorkload:
    """What the attention (decode, rotary, cache-append) templates read of the plan."""
    a, d, dp = plan.attrs, plan.head_dim, plan.head_dim_padded
    return AttentionWorkload(
        batch=plan.batch, seq=plan.seq, heads=plan.heads, kv_heads=plan.kv_heads,
        head_dim=d, head_dim_padded=dp, q_base=plan.q_base // d * dp,
        k_base=plan.k_base // d * dp, v_base=plan.v_base // d * dp, rows=plan.rows_qkv,
        att_rows=plan.rows_att, qkv_width=plan.qkv_width, panel=plan.panel,
        scale=a["scale"], mask=a.get("mask"), score_mod=a.get("score_mod"),
        rotary=a.get("rotary"), lengths=plan.has_lengths and plan.cache is None,
        temp_dtype=plan.temp, pairs=plan.attention_path == "pairs",
        amx=plan.attention_path == "amx", symbolic=bool(plan.symbolic),
        row_tile=plan.tile_rows if plan.symbolic else None, cross=plan.cross,
        kv_seq=plan.kv_seq if plan.cross else None, kv_rows=plan.rows_kv,
        kv_width=plan.kv_width if plan.cross else None,
        cache=plan.cache["max_len"] if plan.cache is not None else None,
        cache_dtype=plan.cache_dtype, packed=plan.packed, kv_block_size=plan.kv_block_size)
