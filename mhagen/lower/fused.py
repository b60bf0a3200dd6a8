"""Lower a fused graph (qkv_projection -> attention -> output_projection) to three kernels:

  qkv_projection  x [M, D] @ W_qkv (packed [N/NR, D, NR]) + b_qkv -> qkv [N/NR, M, NR]
                  (TE, GEMM; the output stays in column panels: a head's rows are contiguous)
  rotary          (RoPE layers only) qkv's Q and K columns rotated in place by position, cos/sin
                  from a constant table [2, seq, rotary_dim / 2]          (template, per backend)
  attention       qkv, block table -> att [M, H*d]  (template, flash-style; reads Q, K, V
                  where the GEMM wrote them)
  output_proj     att @ W_O (packed) + b_o -> y [M, DO]                           (TE, GEMM)
with M = batch * seq. Weights are repacked once, when they are bound, by the
params' recipes (mhagen.params).

Decoding layers (attention with a `cache`) run instead, after the GEMM and the rotary kernel
(whose positions then start at cache_lens[b]):
  cache_append    qkv's new K and V rows -> k_cache, v_cache [B, G, max_len, d] at
                  cache_lens[b] + t (the caller's state, written in place)
  attention       qkv (Q), the caches, cache_lens -> att, split-KV (the backend's decode
                  template; partial results in two temporaries)
Built for any number of new tokens (seq_len=None) they are packed: each batch row's tokens
follow the previous row's (cu_seqlens [batch + 1], row b's at cu_seqlens[b]..), the kernels'
scalars are batch 1 and seq the call's tokens. Built for a paged cache (kv_block_size), the
caches are pools [num_blocks, kv_heads, block, d] (num_blocks: the call's) read and written
through block_tables [batch, max_len / block].
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import te, tirx

from mhagen.blockmask import block_table, split_lengths
from mhagen.lower.gemm import GemmShape, packed_gemm
from mhagen.lower.plan import FusedPlan, NotFusable, attention_workload, plan_fused
from mhagen.lower.te import call_scalars, rope_table, score_table_buffers
from mhagen.ir.reference import packed_refusal
from mhagen.packed import TILE_FIELDS
from mhagen.program import CROSS_SCALARS, Buffer, Kernel, Program, Stage

__all__ = ["NotFusable", "lower_fused", "fused_buffers"]


def lower_fused(graph, batch, seq, backend, attention_config=None, symbolic=None,
                kv_seq=None, kv_block_size=None, packed_config=None) -> Program:
    """The kernels, laid out as the target's backend asks (mhagen/backends.py): plan ->
    buffers -> kernels.
    symbolic ({"batch": bool, "seq": bool}, or None): one program for every batch <= batch
    and seq <= seq. Rows stay dense (row b*seq + t for the call's seq); every kernel takes
    the call's batch and seq as scalars (SCALARS) and its row-indexed buffers are TVM shape
    expressions of them; buffers are allocated at the maximum.
    Cross-attention (attention attr cross; kv_seq: the context's length): a second packed
    GEMM projects the context into `kv` (the K/V heads' columns, kv_seq rows per batch row),
    which the attention template reads its keys and values from.
    attention_config: (default config, workload) -> a tuned config, or None.
    kv_block_size: a decoding layer's paged cache, tokens a block (mhagen.PagedKVCache).
    Packed calls (mhagen/packed.py): a symbolic build of a prefill layer that can take them
    also holds the kernels of a packed call, Program.packed: the same GEMMs over the packed
    tokens (batch 1, seq the total), RoPE at each token's position in its own sequence
    (rotary_varlen) and the attention template over a per-call tile table
    (attention_varlen, its config from packed_config as attention_config gives the padded
    one's). (A decoding layer built with seq_len=None packs its rows' new tokens instead,
    through the decode template: cu_seqlens in its kernels, Program.packed None.)"""
    plan = plan_fused(graph, batch, seq, backend, symbolic, kv_seq, kv_block_size)
    work = attention_workload(plan)
    rule = backend.attention if plan.cache is None else backend.decode
    default = rule.default_config(work, backend.target)
    tuned = attention_config(default, work) if attention_config else None
    cfg = tuned or default
    table = None
    if plan.cache is None:
        table = block_table(plan.attrs.get("mask"), batch, plan.heads, seq, cfg.q_tile,
                            kv_block=cfg.kv_block, lengths=plan.has_lengths,
                            symbolic=bool(symbolic), kv_seq=kv_seq)
        work = replace(work, table_batch=table.shape[0], table_heads=table.shape[1],
                       skip_by_length=plan.has_lengths
                       and split_lengths(plan.attrs.get("mask"))[1])
    packed = None
    if symbolic and plan.cache is None and packed_refusal(graph) is None:
        packed = packed_attention(plan, work, backend, cfg, table, packed_config)
    buffers = fused_buffers(plan, table, backend.decode.partial_shapes(work, cfg)
                            if plan.cache is not None else None, packed)
    ph = Placeholders(buffers, call_scalars(plan.cross) if symbolic else (), plan.tile_rows)
    made = [qkv_kernel(plan, ph)] + ([kv_kernel(plan, ph)] if plan.cross else [])
    if plan.attrs.get("rotary"):
        made.append(rotary_kernel(plan, work, ph))
    if plan.cache is not None:
        made += decode_kernels(plan, work, cfg, ph, tuned=tuned is not None)
    else:
        made.append(attention_kernel(plan, work, cfg, ph, table, tuned=tuned is not None))
    made.append(output_kernel(plan, ph))
    extra = packed_kernels(plan, packed, ph) if packed is not None else []
    program = Program({b.name: b for b in buffers}, [k for k, _ in made],
                      "\n".join(text for _, text in made + extra))
    if packed is not None:   # the padded call's kernels, the packed ones in their place
        swap = {"rotary": extra[0][0]} if len(extra) == 2 else {}
        swap["attention"] = extra[-1][0]
        program.packed = [swap.get(k.name, k) for k in program.kernels]
        program.packed_q_tile = packed.cfg.q_tile
    if symbolic:
        program.symbolic = {**symbolic, "max_batch": batch, "max_seq": seq,
                            "row_tile": plan.tile_rows,
                            **({"max_kv_seq": kv_seq} if plan.cross else {})}
    return program


# -- buffers ---------------------------------------------------------------------------

def fused_buffers(plan: FusedPlan, table=None, partial_shapes=None, packed=None) -> list:
    """The program's buffers in call-argument order of first use: x (and the lengths),
    the QKV GEMM's weights and qkv, a cross-attention's context, weights and kv, the
    attention's (block table, or a decoding layer's caches and partial results), the score
    modifier's tables, the RoPE table, att, the output GEMM's weights and out.
    partial_shapes: the decode template's (part_o, part_ml) shapes. packed (a
    PackedAttention): then last, what only packed calls read (the tile table, the tokens'
    positions, the varlen kernel's own block table where its tiles differ)."""
    a, symbolic = plan.attrs, plan.symbolic
    w_qkv, b_qkv = _packed(plan.qkv_node.attrs["segments"], plan, plan.qkv_width,
                           plan.qkv_gemm)
    return [
        Buffer("x", (plan.rows, plan.d_model), "input", dtype=plan.dtype,
               doc="x [batch*seq, d_model]", symbolic={0: "rows"} if symbolic else None),
        *_lengths_buffers(plan),
        Buffer("w_qkv", role="param", **_panels(plan, plan.qkv_width, plan.qkv_gemm),
               pack=w_qkv, doc="every Q/K/V weight side by side, in column panels"),
        Buffer("b_qkv", (plan.qkv_width,), "param", pack=b_qkv),
        Buffer("qkv", (plan.qkv_width // plan.panel, plan.rows_qkv, plan.panel), "temp",
               dtype=plan.qkv_temp,
               doc="Q, K, V of every head in column panels, each head padded to the lanes",
               symbolic={1: "padded_rows"} if symbolic else None),
        *(_cross_buffers(plan) if plan.cross else []),
        *(_table_buffers(table) if plan.cache is None else _cache_buffers(plan,
                                                                          partial_shapes)),
        *[b for _, b in score_table_buffers(a.get("score_mod"))],
        *(_rope_buffers(plan) if a.get("rotary") else []),
        *_output_buffers(plan),
        *(_packed_buffers(plan, packed) if packed is not None else [])]


def _packed_buffers(plan, packed) -> list:
    """A packed call's tile table (at most a query tile per token), its tokens' positions
    (RoPE layers) and the varlen kernel's own block table (where it has one)."""
    out = [Buffer("tiles", (plan.rows, len(TILE_FIELDS)), "temp", "int32",
                  doc="a packed call's query tiles: " + ", ".join(TILE_FIELDS)
                  + " (mhagen/packed.py), written per call", symbolic={0: "tiles"})]
    if plan.attrs.get("rotary"):
        out.append(Buffer("positions", (plan.rows,), "temp", "int32",
                          doc="each packed token's position in its own sequence, written "
                          "per call", symbolic={0: "rows"}))
    if packed.table is not None:
        out.append(Buffer(packed.blocks, packed.table.shape, "param", dtype="int32",
                          pack={"kind": "constant"}, value=packed.table,
                          doc="the packed calls' block table (their config's tiles)"))
    return out


def _lengths_buffers(plan) -> list:
    if not plan.has_lengths:
        return []
    doc = ("tokens already cached per batch row, given at call time" if plan.cache else
           "key lengths per batch row, given at call time")
    # a decoding layer's batch is fixed (its cache rows): packed calls run batch 1
    fixed = plan.cache is not None and plan.packed
    out = [Buffer(plan.att_node.inputs[-1], (plan.batch,), "input", "int32", doc=doc,
                  symbolic={0: "batch"} if plan.symbolic and not fixed else None)]
    if plan.packed:
        out.append(Buffer("cu_seqlens", (plan.batch + 1,), "input", "int32",
                          doc="row b's new tokens are rows cu_seqlens[b] .. cu_seqlens[b+1]-1 "
                          "of x, given at call time"))
    if plan.kv_block_size:
        out.append(Buffer("block_tables", (plan.batch, plan.max_blocks), "input", "int32",
                          doc="the pool blocks of each batch row's sequence, in order, given "
                          "at call time"))
    return out


def _panels(plan, width, path) -> dict:
    """A packed weight's shape and dtype: [width / nr, depth, nr] in the layer's dtype, or
    for a GEMM over pairs of its depth [width / nr, depth / 2, nr, 2] (bfloat16)."""
    nr, depth = plan.panel, path.depth
    if path.paired:
        return dict(shape=(width // nr, depth // 2, nr, 2), dtype=plan.dtype)
    return dict(shape=(width // nr, depth, nr), dtype=plan.dtype)


def _packed(segments, plan, width, path):
    """The param recipes (mhagen.params) of a packed GEMM's weights and bias: segment i's
    d columns at i * dp (each head padded to what the attention template reads); pairs:
    the weights in pairs of the depth (the GEMM runs over pairs, or on AMX tiles)."""
    dp = plan.head_dim_padded
    w = {"kind": "panels", "depth": path.depth, "width": width, "panel": plan.panel,
         "columns": [{"weight": s["weight"], "head": s["head"], "at": i * dp}
                     for i, s in enumerate(segments)],
         **({"pairs": True} if path.paired else {}), **({"amx": True} if path.amx else {})}
    b = {"kind": "vector", "length": width,
         "pieces": [{"weight": s["bias"], "head": s["head"], "at": i * dp}
                    for i, s in enumerate(segments) if s.get("bias")]}
    return w, b


def _cross_buffers(plan) -> list:
    """A cross-attention's context input, its K/V GEMM's packed weights and the kv temporary
    (symbolic: their rows follow the call's batch * kv_seq)."""
    width, symbolic = plan.kv_width, bool(plan.symbolic)
    w_kv, b_kv = _packed(plan.kv_node.attrs["segments"], plan, width, plan.kv_gemm)
    return [Buffer(plan.kv_node.inputs[0], (plan.kv_rows, plan.kv_dim), "input",
                   dtype=plan.dtype, doc="context [batch*kv_seq, kv_dim]: what K and V project",
                   symbolic={0: "kv_rows"} if symbolic else None),
            Buffer("w_kv", role="param", **_panels(plan, width, plan.kv_gemm), pack=w_kv,
                   doc="every K/V weight side by side, in column panels"),
            Buffer("b_kv", (width,), "param", pack=b_kv),
            Buffer("kv", (width // plan.panel, plan.rows_kv, plan.panel), "temp",
                   dtype=plan.kv_temp,
                   doc="K, V of every K/V head in column panels (cross-attention)",
                   symbolic={1: "kv_padded_rows"} if symbolic else None)]


def _table_buffers(table) -> list:
    return [Buffer("blocks", table.shape, "param", dtype="int32", pack={"kind": "constant"},
                   value=table, doc="0 skip / 1 partial / 2 full per (query tile, key block)")]


def _cache_buffers(plan, partial_shapes) -> list:
    part_o, part_ml = partial_shapes
    shape = (plan.batch, plan.kv_heads, plan.cache["max_len"], plan.head_dim)
    doc, symbolic = ("keys of every K/V head by position (the caller's KVCache, written "
                     "in place)"), None
    if plan.kv_block_size:   # a pool of the call's size (shape[0]: a placeholder)
        shape = (1, plan.kv_heads, plan.kv_block_size, plan.head_dim)
        doc, symbolic = ("keys of every K/V head in pool blocks (the caller's PagedKVCache, "
                         "written in place; its num_blocks the call's)"), {0: "pool_blocks"}
    return [Buffer("k_cache", shape, "state", dtype=plan.cache_dtype, doc=doc,
                   symbolic=symbolic),
            Buffer("v_cache", shape, "state", dtype=plan.cache_dtype, doc="values, as k_cache",
                   symbolic=symbolic),
            Buffer("part_o", part_o, "temp", doc="unnormalised output per (task, row)"),
            Buffer("part_ml", part_ml, "temp", doc="running max and sum per (task, row)")]


def _positions(plan) -> int:
    return plan.cache["max_len"] if plan.cache else plan.seq


def _rope_buffers(plan) -> list:
    r, positions = plan.attrs["rotary"], _positions(plan)
    return [Buffer("rope", (2, positions, r["rotary_dim"] // 2), "param",
                   pack={"kind": "constant"},
                   value=rope_table(positions, r["rotary_dim"], r["base"]),
                   doc="RoPE cos [0] and sin [1] by position (float64 math, stored float32)")]


def _output_buffers(plan) -> list:
    symbolic, bias = plan.symbolic, plan.out_node.attrs.get("bias")
    w_o = {"kind": "panels", "depth": plan.attention_width, "width": plan.out_width,
           "panel": plan.panel, "columns": [{"weight": plan.out_node.attrs["weight"], "at": 0}],
           **({"pairs": True} if plan.out_gemm.paired else {}),
           **({"amx": True} if plan.out_gemm.amx else {})}
    b_o = {"kind": "vector", "length": plan.out_width,
           "pieces": [{"weight": bias, "at": 0}] if bias else []}
    return [Buffer("att", (plan.rows_att, plan.attention_width), "temp", dtype=plan.temp,
                   doc="attention output, heads side by side "
                   "(rows past batch*seq: GEMM padding, never read into the output)",
                   symbolic={0: "padded_rows"} if symbolic else None),
            Buffer("w_o", role="param", **_panels(plan, plan.out_width, plan.out_gemm),
                   pack=w_o),
            Buffer("b_o", (plan.out_width,), "param", pack=b_o),
            Buffer("out", (plan.rows, plan.out_width), "output", dtype=plan.dtype,
                   symbolic={0: "rows"} if symbolic else None)]


class Placeholders:
    """TE placeholders of the program's buffers: ph(name). Symbolic axes become expressions
    of the scalars (dims: batch, seq, rows, padded_rows, and with a third scalar, the
    context's kv_seq, kv_rows, kv_padded_rows)."""

    def __init__(self, buffers, scalars, tile_rows):
        self.buffers = {b.name: b for b in buffers}
        self.scalars, self.dims = tuple(scalars), {}
        if scalars:
            b, s = scalars[:2]
            self.dims = {"batch": b, "seq": s, "rows": b * s,
                         "padded_rows": _padded(b * s, tile_rows)}
        if len(scalars) == 3:
            self.dims.update(kv_seq=scalars[2], kv_rows=b * scalars[2],
                             kv_padded_rows=_padded(b * scalars[2], tile_rows))

    def __call__(self, name):
        buf = self.buffers[name]
        shape = buf.call_shape(self.dims) if self.scalars else buf.shape
        return te.placeholder(shape, buf.dtype, name=name)

    @property
    def names(self) -> list:
        """The scalars' names, in order (the kernels' last arguments)."""
        return list(CROSS_SCALARS[:len(self.scalars)])


def _padded(rows, tile_rows):
    return tirx.floordiv(rows + tile_rows - 1, tile_rows) * tile_rows


# -- kernels ---------------------------------------------------------------------------

def qkv_kernel(plan, ph) -> tuple:
    """1. The packed QKV GEMM: (Kernel, its line of the program's text)."""
    heads, d, dp, nr = plan.heads, plan.head_dim, plan.head_dim_padded, plan.panel
    by_head = (plan.cache is None and not plan.cross and plan.kv_heads == heads
               and dp % nr == 0 and (plan.q_base, plan.k_base, plan.v_base)
               == (0, heads * d, 2 * heads * d) and plan.qkv_width == 3 * heads * dp)
    shape = GemmShape(ph.dims["padded_rows"] if plan.symbolic else plan.rows_qkv,
                      plan.qkv_width, nr, panel_major=True, scalars=ph.scalars,
                      max_rows=plan.rows_qkv, a_exact=True,
                      head_panels=(3, heads, dp // nr) if by_head else None)
    x, wqkv, bqkv = ph("x"), ph("w_qkv"), ph("b_qkv")
    qkv, stages = packed_gemm("qkv", plan.qkv_node.name, x, wqkv, bqkv, shape, plan.qkv_gemm,
                              out_dtype=plan.qkv_temp)
    kernel = Kernel("qkv_projection", ["x", "w_qkv", "b_qkv", "qkv"] + ph.names,
                    te.create_prim_func([x, wqkv, bqkv, qkv, *ph.scalars]), stages)
    segments = plan.qkv_node.attrs["segments"]
    return kernel, (f"qkv[p, m, j] = sum_k x[m, k] * w_qkv[p, k, j] + b_qkv[p*{nr} + j]"
                    f"   # {len(segments)} head projections, one GEMM")


def kv_kernel(plan, ph) -> tuple:
    """1b. A cross-attention's K/V heads' GEMM over the context."""
    nr = plan.panel
    c, wkv, bkv = ph(plan.kv_node.inputs[0]), ph("w_kv"), ph("b_kv")
    shape = GemmShape(ph.dims["kv_padded_rows"] if plan.symbolic else plan.rows_kv,
                      plan.kv_width, nr, panel_major=True, scalars=ph.scalars,
                      max_rows=plan.rows_kv, a_exact=True)
    kv, stages = packed_gemm("kv", plan.kv_node.name, c, wkv, bkv, shape, plan.kv_gemm,
                             out_dtype=plan.kv_temp)
    kernel = Kernel("kv_projection", [c.name, "w_kv", "b_kv", "kv"] + ph.names,
                    te.create_prim_func([c, wkv, bkv, kv, *ph.scalars]), stages)
    segments = plan.kv_node.attrs["segments"]
    return kernel, (f"kv[p, m, j] = sum_k {c.name}[m, k] * w_kv[p, k, j] + b_kv[p*{nr} + j]"
                    f"   # {len(segments)} K/V head projections of the context")


def rotary_kernel(plan, work, ph) -> tuple:
    """2. RoPE on qkv's Q and K columns, in place (the backend's rotary template)."""
    r = plan.attrs["rotary"]
    lengths = plan.lengths_input + (["cu_seqlens"] if plan.packed else []) if plan.cache \
        else []
    kernel = Kernel("rotary", ["qkv"] + lengths + ["rope"] + ph.names,
                    stages=[Stage("rotary", "rotary_template", plan.att_node.name, (), work)],
                    template="rotary", workload=work)
    return kernel, (f"qkv[Q, K columns] = rope(qkv, base={r['base']:g}, "
                    f"rotary_dim={r['rotary_dim']})  # in place, cos/sin table "
                    f"[2, {_positions(plan)}, {r['rotary_dim'] // 2}]")


def attention_kernel(plan, work, cfg, ph, table, tuned=False) -> tuple:
    """3. The attention template over qkv (and kv) and the block table."""
    a = plan.attrs
    tables = [b.name for _, b in score_table_buffers(a.get("score_mod"))]
    args = (["qkv"] + (["kv"] if plan.cross else []) + ["blocks"] + plan.lengths_input
            + ["att"] + tables + ph.names)
    kernel = Kernel("attention", args,
                    stages=[Stage("attention", "attention_template", plan.att_node.name, (),
                                  work)],
                    template="attention", workload=work, config=cfg, tuned=tuned)
    return kernel, (f"att = attention(qkv)  # template: {plan.heads} heads, {plan.kv_heads} "
                    f"K/V heads, head_dim {plan.head_dim}, scale {a['scale']:.6g}, mask "
                    f"{a.get('mask')!r}; block table {table.shape}: "
                    f"{int((table == 0).sum())} of {table.size} blocks skipped")


def decode_kernels(plan, work, cfg, ph, tuned=False) -> list:
    """A decoding layer's cache append and split-KV attention (templates of the backend);
    tuned: cfg came from a tuning record."""
    tables = [b.name for _, b in score_table_buffers(plan.attrs.get("score_mod"))]
    lengths, node = plan.lengths_input, plan.att_node.name
    lengths = lengths + (["cu_seqlens"] if plan.packed else []) + (
        ["block_tables"] if plan.kv_block_size else [])
    append = Kernel("cache_append", ["qkv"] + lengths + ["k_cache", "v_cache"] + ph.names,
                    stages=[Stage("cache_append", "cache_append_template", node, (), work)],
                    template="cache_append", workload=work)
    attend = Kernel("attention", ["qkv"] + lengths + ["k_cache", "v_cache", "part_o",
                                                      "part_ml", "att"] + tables + ph.names,
                    stages=[Stage("attention", "decode_template", node, (), work)],
                    template="decode", workload=work, config=cfg, tuned=tuned)
    return [(append, "k_cache[b, g, cache_lens[b] + t], v_cache[...] = K, V of qkv row "
                     "b*seq + t  # in place"),
            (attend, f"att = decode_attention(qkv, k_cache, v_cache)  # split-KV template: "
                     f"{work.heads} heads, {work.kv_heads} K/V heads, cache "
                     f"{work.cache}, mask {work.mask!r}; positions from cache_lens")]


@dataclass(frozen=True)
class PackedAttention:
    """The attention of a build's packed calls: its workload (varlen; bfloat16 pairs where
    the padded kernel takes AMX tiles, whose V^T is laid out by batch row), its config
    (tuned: from a record), its block table's buffer name and, where its tiles differ from
    the padded kernel's, that table (else None: it reads `blocks`)."""
    work: object
    cfg: object
    tuned: bool
    blocks: str
    table: object


def packed_attention(plan, work, backend, cfg, table, packed_config) -> PackedAttention:
    """The packed calls' attention beside the padded kernel's (work, cfg, table)."""
    vwork = replace(work, varlen=True, lengths=False, skip_by_length=False, amx=False,
                    pairs=work.pairs or work.amx)
    default = backend.attention.default_config(vwork, backend.target)
    tuned = packed_config(default, vwork) if packed_config else None
    vcfg = tuned or default
    if (vcfg.q_tile, vcfg.kv_block) == (cfg.q_tile, cfg.kv_block):
        return PackedAttention(vwork, vcfg, tuned is not None, "blocks", None)
    # the padded kernel's table (key lengths or not) is that of the parts that read no
    # length, as a packed call's
    own = block_table(plan.attrs.get("mask"), plan.batch, plan.heads, plan.seq, vcfg.q_tile,
                      kv_block=vcfg.kv_block, lengths=plan.has_lengths, symbolic=True,
                      kv_seq=plan.kv_seq)
    return PackedAttention(vwork, vcfg, tuned is not None, "blocks_varlen", own)


def packed_kernels(plan, packed, ph) -> list:
    """The kernels only packed calls run: [rotary_varlen (RoPE layers),] attention_varlen."""
    out = []
    if plan.attrs.get("rotary"):
        work = replace(packed.work, pairs=False)
        out.append((Kernel("rotary_varlen", ["qkv", "positions", "rope"] + ph.names,
                           stages=[Stage("rotary_varlen", "rotary_template",
                                         plan.att_node.name, (), work)],
                           template="rotary", workload=work),
                    "qkv[Q, K columns] = rope(qkv)  # packed calls: at positions[token], "
                    "each token's position in its own sequence"))
    tables = [b.name for _, b in score_table_buffers(plan.attrs.get("score_mod"))]
    args = (["qkv"] + (["kv"] if plan.cross else []) + [packed.blocks, "tiles", "att"] + tables
            + ph.names)
    out.append((Kernel("attention_varlen", args,
                       stages=[Stage("attention_varlen", "attention_template",
                                     plan.att_node.name, (), packed.work)],
                       template="attention", workload=packed.work, config=packed.cfg,
                       tuned=packed.tuned),
                f"att = attention(qkv)  # packed calls: a task per (head, query tile of one "
                f"sequence) of the tile table; {packed.blocks}"))
    return out


def output_kernel(plan, ph) -> tuple:
    """The output projection kernel."""
    nr = plan.panel
    rows, rows_att = plan.rows, plan.rows_att
    if plan.symbolic:
        rows, rows_att = ph.dims["rows"], ph.dims["padded_rows"]
    shape = GemmShape(rows_att, plan.out_width, nr, out_rows=rows, scalars=ph.scalars,
                      max_rows=plan.rows_att)
    att, wo, bo = ph("att"), ph("w_o"), ph("b_o")
    y, stages = packed_gemm("out", plan.out_node.name, att, wo, bo, shape, plan.out_gemm,
                            out_dtype=ph.buffers["out"].dtype)
    kernel = Kernel("output_projection", ["att", "w_o", "b_o", "out"] + ph.names,
                    te.create_prim_func([att, wo, bo, y, *ph.scalars]), stages)
    return kernel, f"out[m, n] = sum_k att[m, k] * w_o[n // {nr}, k, n % {nr}] + b_o[n]"
