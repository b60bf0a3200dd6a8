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
"""
from __future__ import annotations

from tvm import te, tirx

from mhagen.dtypes import COMPUTE
from mhagen.blockmask import block_table, split_lengths
from mhagen.errors import GraphError, TargetError
from mhagen.lower.te import call_scalars, cast, rope_table, score_table_buffers
from mhagen.ir.heads import kv_head_map
from mhagen.program import CROSS_SCALARS, Buffer, Kernel, Program, Stage, round_up


class NotFusable(Exception):
    """The fused attention's layout cannot express this graph: lower it unfused."""


def _gemm(name, node, a, wp, bias, rows, depth, cols, nr, panel_major=False, out_rows=None,
          scalars=(), max_rows=None, a_exact=False, pack_tile=None, out_dtype=None,
          pairs=False, on_amx=False, head_panels=None):
    """C = a @ W + bias with W in column panels, wp[n // nr, k, n % nr]: one packed-GEMM
    stage. The product runs over `rows` rows (the backend's gemm_rows: padded to whole
    register tiles or not; rows of `a` past its end are read clamped); C keeps `out_rows`
    of them (default all).
    C is [out_rows, cols], or [cols / nr, out_rows, nr] (column panels) when panel_major.
    Symbolic-length builds (`scalars`: the batch and seq vars): rows are expressions of them,
    at most max_rows; a_exact: `a` has the call's exact rows (an input), not whole tiles.
    pack_tile: first copy `a` into panels of that many rows, k-major (a_p[m // t, k, m % t]),
    so a register tile reads one stream (the backend asks for it where rows of `a` would
    fall in one cache set). Half-precision a or W (a layer's storage dtype) are converted to
    float32 where they are loaded (the pack stage converts as it copies); products accumulate
    in float32; out_dtype: C's dtype (default float32; rounded after the bias).
    pairs: the depth runs in pairs k = 2 * k2 + p (the backend's gemm_pairs: one bfloat16
    dot-product instruction per pair): W is wp[n // nr, k2, n % nr, p] and `a` is always
    packed (pack_tile rows), as a_p[m // t, k2, m % t, p], both bfloat16 (a float32 `a`,
    the attention's output, is rounded by the pack).
    on_amx: on AMX tiles (32 rows x 32 of the depth, schedules/x86/amx.py): W as for pairs,
    `a` packed as a_t[m // 32, k // 32, m % 32, k2, p] (k % 32 = 2 * k2 + p), bfloat16.
    head_panels: (sections, heads, panels a head) where C's panels are Q, K and V of every
    head, each section heads x panels wide: the rule may run them head by head."""
    last = a.shape[0] - 1
    out_dtype = out_dtype or COMPUTE

    def a_row(m, extent=rows):
        """Row m of `a`, for m < extent (clamped where `a` has fewer rows)."""
        if scalars:
            return te.min(m, last) if a_exact else m
        return m if int(last) + 1 >= extent else te.min(m, last)
    t, pack_stages = pack_tile, []
    if pairs and not scalars and int(rows) < t:
        t = int(rows)   # a GEMM of fewer rows than a tile runs one shorter tile (a decode step)
    if on_amx:
        steps = depth // 32
        packed = te.compute((rows // t, steps, t, 16, 2),
                            lambda i, s, r, k2, p: cast(a[a_row(i * t + r), 32 * s + 2 * k2 + p],
                                                        "bfloat16"),
                            name=name + "_pack")
        kt, k2 = te.reduce_axis((0, steps), name="kt"), te.reduce_axis((0, 16), name="k2")
        kp = te.reduce_axis((0, 2), name="kp")
        axes = [kt, k2, kp]

        def term(m, panel, j):
            return (_f32(packed[m // t, kt, m % t, k2, kp])
                    * _f32(wp[panel, kt * 16 + k2, j, kp]))
    elif pairs:
        packed = te.compute((rows // t, depth // 2, t, 2),
                            lambda i, k2, r, p: cast(a[a_row(i * t + r), 2 * k2 + p],
                                                     "bfloat16"),
                            name=name + "_pack")
        k2, kp = te.reduce_axis((0, depth // 2), name="k2"), te.reduce_axis((0, 2), name="kp")
        axes = [k2, kp]

        def term(m, panel, j):
            return _f32(packed[m // t, k2, m % t, kp]) * _f32(wp[panel, k2, j, kp])
    else:
        k = te.reduce_axis((0, depth), name="k")
        axes = [k]
        read = lambda m, kk: _f32(a[a_row(m), kk])   # noqa: E731
        if t:   # whole tiles (a partial last one copies the last row again)
            tiles = rows // t if scalars else -(-int(rows) // t)
            packed = te.compute((tiles, depth, t),
                                lambda i, kk, r: _f32(a[a_row(i * t + r, tiles * t), kk]),
                                name=name + "_pack")
            read = lambda m, kk: packed[m // t, kk, m % t]   # noqa: E731
        else:
            packed = None

        def term(m, panel, j):
            return read(m, k) * _f32(wp[panel, k, j])
    if packed is not None:
        pack_stages = [Stage(packed.op.name, "pack", node, (packed.op.name,))]
    out_rows = out_rows if out_rows is not None else rows
    if panel_major:
        mm = te.compute((cols // nr, rows, nr),
                        lambda p, m, j: te.sum(term(m, p, j), axis=axes),
                        name=name + "_matmul")
        out = te.compute((cols // nr, out_rows, nr),
                         lambda p, m, j: cast(mm[p, m, j] + bias[p * nr + j], out_dtype),
                         name=name)
    else:
        mm = te.compute((rows, cols),
                        lambda m, n: te.sum(term(m, n // nr, n % nr), axis=axes),
                        name=name + "_matmul")
        out = te.compute((out_rows, cols), lambda m, n: cast(mm[m, n] + bias[n], out_dtype),
                         name=name)
    work = {"rows": rows, "cols": cols, "depth": depth, "panel": nr,
            "panel_major": panel_major}
    if pairs:
        work["pairs"] = True
    if on_amx:
        work["amx"] = True
    if head_panels:
        work["head_panels"] = head_panels
    if scalars:   # the rule sizes its row blocks for the largest call
        work.update(rows=max_rows, symbolic=True)
    stages = [Stage(mm.op.name, "packed_matmul", node, (mm.op.name,), work),
              Stage(name, "epilogue", node, (name,))] + pack_stages   # the GEMM rule packs
    return out, stages


def _f32(v):
    return cast(v, COMPUTE)


def lower_fused(graph, batch, seq, target, backend, attention_config=None,
                symbolic=None, kv_seq=None) -> Program:
    """The three kernels, laid out as the target's backend asks (mhagen/backends.py).
    symbolic ({"batch": bool, "seq": bool}, or None): one program for every batch <= batch
    and seq <= seq. Rows stay dense (row b*seq + t for the call's seq); every kernel takes
    the call's batch and seq as scalars (SCALARS) and its row-indexed buffers are TVM shape
    expressions of them; buffers are allocated at the maximum.
    Cross-attention (attention attr cross; kv_seq: the context's length): a second packed
    GEMM projects the context into `kv` (the K/V heads' columns, kv_seq rows per batch row),
    which the attention template reads its keys and values from."""
    by_kind = {n.kind: n for n in graph.nodes}
    att_node, out_node = by_kind["attention"], by_kind["output_projection"]
    nodes = {n.name: n for n in graph.nodes}
    qkv_node = nodes[att_node.inputs[0]]
    x_node = nodes[qkv_node.inputs[0]]
    cross = bool(att_node.attrs.get("cross"))
    kv_node = nodes[att_node.inputs[1]] if cross else None
    # key lengths (or cache lengths) given per call: the attention's last input
    has_lengths = len(att_node.inputs) > 1 + cross
    if cross and not backend.cross:
        raise TargetError(f"cross-attention does not compile fused for {target.name} yet "
                          f"({backend.family}); build it with fuse=False or for a CPU target")
    cache = att_node.attrs.get("cache")     # a decoding layer: {"max_len": N[, "dtype"]}
    cache_dtype = (cache or {}).get("dtype", "float32")   # what its K/V cache stores
    if symbolic and symbolic["batch"] and cache is not None:
        raise GraphError("decoding layers (kv_cache=) run a fixed batch (the cache's): build "
                         "them with batch=B (seq_len=None serves any number of new tokens)")
    if symbolic and not backend.symbolic:
        raise TargetError(f"symbolic lengths (seq_len=None) do not compile for "
                          f"{target.name} yet ({backend.family}); build one module per length")
    d_model = x_node.attrs["shape"][2]
    dtype = graph.dtype      # storage of x, the weights and out; the kernels compute in float32
    rows = batch * seq
    # GEMM rows padded to whole register tiles: a partial one would put a guard on every
    # multiply-add and keep the accumulators in memory (AVX2: 1.4-4x slower)
    _, nr = backend.gemm_tile(target)
    segments = qkv_node.attrs["segments"]
    a = att_node.attrs
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
    k_base, v_base = kv_pairs[0]
    d_out = out_node.attrs["out_features"]
    d_out_p = round_up(d_out, nr)
    hd = heads * d

    def on_amx(depth):
        """Whether a GEMM of this depth runs on AMX tiles (bfloat16; not in decoding layers,
        whose steps' few rows would be padded to a 32-row tile)."""
        return bool(cache is None and backend.gemm_amx
                    and backend.gemm_amx(target, dtype, depth))

    def dot_pairs(depth):
        """Whether the target multiplies bfloat16 pairs of this depth in dot products."""
        return bool(backend.gemm_pairs and backend.gemm_pairs(target, dtype, depth))

    def pairs(depth):
        """Whether a GEMM of this depth multiplies pairs of it (bfloat16 dot products)."""
        return dot_pairs(depth) and not on_amx(depth)

    def row_tile(depth):
        """The register tile rows of the GEMM of this depth (pair and AMX GEMMs have their
        own)."""
        return backend.gemm_tile(target, pairs=pairs(depth), on_amx=on_amx(depth))[0]

    def gemm_rows(rows, depth, cols):
        return backend.gemm_rows(target, rows, depth, cols, pairs=pairs(depth),
                                 on_amx=on_amx(depth))
    # qkv columns: every head's d columns padded to dp, what the attention template reads
    dp = backend.head_dim_padded(d, target)
    n_qkv_p = round_up(len(segments) * dp, nr)
    kv_segments = kv_node.attrs["segments"] if cross else []
    n_kv_p = round_up(len(kv_segments) * dp, nr)
    rows_qkv = gemm_rows(rows, d_model, n_qkv_p)
    rows_att = gemm_rows(rows, hd, d_out_p)
    kv_rows = rows_kv = kv_dim = None
    if cross:
        kv_dim = nodes[kv_node.inputs[0]].attrs["shape"][2]
        kv_rows = batch * kv_seq
        rows_kv = gemm_rows(kv_rows, kv_dim, n_kv_p)
    # symbolic lengths pad each call's rows to one row tile: the shortest of the GEMMs', or
    # an AMX tile where a GEMM has them (those take whole tiles only; the others any rows)
    depths = [depth for depth in (d_model, hd, kv_dim) if depth]
    tile_rows = max([row_tile(depth) for depth in depths if on_amx(depth)]
                    or [min(row_tile(depth) for depth in depths)])

    def pack(depth, half=False):
        """The row tile where a GEMM's rows are packed first: where the backend asks for
        that depth, for half-precision rows (converted to float32 once, by the copy, not
        six times per tile step), and for GEMMs over pairs of the depth."""
        asks = backend.gemm_packs_rows and backend.gemm_packs_rows(target, depth)
        return (row_tile(depth) if asks or paired(depth) or (half and backend.gemm_packs_rows)
                else None)

    def paired(depth):
        """Whether a GEMM's weights are packed in pairs of its depth (pairs or AMX)."""
        return pairs(depth) or on_amx(depth)

    def panels(width, depth):
        """A packed weight's shape and dtype: [width / nr, depth, nr] in the layer's dtype,
        or for a GEMM over pairs of its depth [width / nr, depth / 2, nr, 2] (bfloat16)."""
        if paired(depth):
            return dict(shape=(width // nr, depth // 2, nr, 2), dtype=dtype)
        return dict(shape=(width // nr, depth, nr), dtype=dtype)
    if symbolic:   # allocations: the largest call, padded to whole register tiles
        rows_qkv = rows_att = round_up(rows, tile_rows)
        rows_kv = kv_rows and round_up(kv_rows, tile_rows)

    # the temporaries' dtype: float32, or on GPUs a half layer's own (its GEMMs' tensor cores)
    temp = dtype if backend.half_temps else COMPUTE
    # bfloat16 pairs in the attention too (x86 AVX-512 BF16: the GEMMs' condition on
    # head_dim): qkv and kv hold bfloat16, the template multiplies pairs of head columns and
    # of keys (schedules/x86/attention.py). Not for decoding or rotary layers (their
    # templates read float32 qkv).
    # AMX tiles for the attention's S^T = K Q^T and P V where a GEMM of head_dim's depth
    # would take them (x86 AMX-BF16: d whole 32s, so every K head fills whole qkv panels);
    # qkv in bfloat16 too
    att_amx = bool(cache is None and not a.get("rotary") and backend.gemm_amx
                   and backend.gemm_amx(target, dtype, d, attention=True))
    att_pairs = cache is None and not a.get("rotary") and dot_pairs(d) and not att_amx
    qkv_temp = kv_temp = "bfloat16" if att_pairs or att_amx else temp
    if not (att_pairs or att_amx):
        kv_temp = COMPUTE
    work = {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
            "q_base": q_base // d * dp, "k_base": k_base // d * dp, "v_base": v_base // d * dp,
            "head_dim_padded": dp, "rows": rows_qkv, "att_rows": rows_att,
            "qkv_width": n_qkv_p, "panel": nr, "scale": a["scale"], "mask": a.get("mask"),
            "score_mod": a.get("score_mod"), "rotary": a.get("rotary"),
            "lengths": has_lengths, "temp_dtype": temp,
            **({"pairs": True} if att_pairs else {}), **({"amx": True} if att_amx else {})}
    if symbolic:
        work.update(symbolic=True, row_tile=tile_rows)
    if cross:   # keys and values: kv [n_kv_p / nr, rows_kv, nr], kv_seq rows per batch row
        work.update(cross=True, kv_seq=kv_seq, kv_rows=rows_kv, kv_width=n_kv_p)
    if cache is not None:
        if backend.decode is None:
            raise TargetError(f"decoding layers (kv_cache=) do not compile for {target.name} "
                              f"yet ({backend.family} has no decode template); build them "
                              "for a CPU target")
        work.update(cache=cache["max_len"], lengths=False)
        if cache_dtype != "float32":
            work["cache_dtype"] = cache_dtype
    rule = backend.attention if cache is None else backend.decode
    default = rule.default_config(work, target)
    tuned = attention_config(default, work) if attention_config else None
    cfg = tuned or default

    # param recipes (mhagen.params): every head's d columns at i * dp
    w_qkv, b_qkv = _packed(segments, d_model, n_qkv_p, nr, dp, paired(d_model),
                           on_amx(d_model))
    w_o = {"kind": "panels", "depth": hd, "width": d_out_p, "panel": nr,
           "columns": [{"weight": out_node.attrs["weight"], "at": 0}],
           **({"pairs": True} if paired(hd) else {}), **({"amx": True} if on_amx(hd) else {})}
    bias_o = out_node.attrs.get("bias")
    b_o = {"kind": "vector", "length": d_out_p,
           "pieces": [{"weight": bias_o, "at": 0}] if bias_o else []}

    if cache is None:
        table = block_table(a.get("mask"), batch, heads, seq, cfg.q_tile,
                            kv_block=cfg.kv_block, lengths=has_lengths,
                            symbolic=bool(symbolic), kv_seq=kv_seq)
        work.update(table_batch=table.shape[0], table_heads=table.shape[1],
                    skip_by_length=has_lengths and split_lengths(a.get("mask"))[1])
        attention_buffers = [
            Buffer("blocks", table.shape, "param", dtype="int32", pack={"kind": "constant"},
                   value=table, doc="0 skip / 1 partial / 2 full per (query tile, key block)")]
    else:
        part_o, part_ml = backend.decode.partial_shapes(work, cfg)
        cache_shape = (batch, kv_heads, cache["max_len"], d)
        attention_buffers = [
            Buffer("k_cache", cache_shape, "state", dtype=cache_dtype,
                   doc="keys of every K/V head by position (the caller's KVCache, written "
                   "in place)"),
            Buffer("v_cache", cache_shape, "state", dtype=cache_dtype,
                   doc="values, as k_cache"),
            Buffer("part_o", part_o, "temp", doc="unnormalised output per (task, row)"),
            Buffer("part_ml", part_ml, "temp", doc="running max and sum per (task, row)")]
    # the score modifier's large tables (relative_bias): constant params the template reads
    score_tables = [b for _, b in score_table_buffers(a.get("score_mod"))]
    tables = [b.name for b in score_tables]
    positions = cache["max_len"] if cache else seq
    lengths_doc = ("tokens already cached per batch row, given at call time" if cache else
                   "key lengths per batch row, given at call time")
    buffers = [
        Buffer("x", (rows, d_model), "input", dtype=dtype, doc="x [batch*seq, d_model]",
               symbolic={0: "rows"} if symbolic else None),
        *([Buffer(att_node.inputs[-1], (batch,), "input", "int32",
                  doc=lengths_doc, symbolic={0: "batch"} if symbolic else None)]
          if has_lengths else []),
        Buffer("w_qkv", role="param", **panels(n_qkv_p, d_model), pack=w_qkv,
               doc="every Q/K/V weight side by side, in column panels"),
        Buffer("b_qkv", (n_qkv_p,), "param", pack=b_qkv),
        Buffer("qkv", (n_qkv_p // nr, rows_qkv, nr), "temp", dtype=qkv_temp,
               doc="Q, K, V of every head in column panels, each head padded to the lanes",
               symbolic={1: "padded_rows"} if symbolic else None),
    ] + (_cross_buffers(kv_node.inputs[0], kv_rows, kv_dim, rows_kv, kv_segments, n_kv_p,
                        nr, dp, bool(symbolic), dtype, panels, paired(kv_dim), kv_temp,
                        on_amx(kv_dim))
         if cross else []) + attention_buffers + score_tables + ([
        Buffer("rope", (2, positions, a["rotary"]["rotary_dim"] // 2), "param",
               pack={"kind": "constant"},
               value=rope_table(positions, a["rotary"]["rotary_dim"], a["rotary"]["base"]),
               doc="RoPE cos [0] and sin [1] by position (float64 math, stored float32)"),
    ] if a.get("rotary") else []) + [
        Buffer("att", (rows_att, hd), "temp", dtype=temp,
               doc="attention output, heads side by side "
               "(rows past batch*seq: GEMM padding, never read into the output)",
               symbolic={0: "padded_rows"} if symbolic else None),
        Buffer("w_o", role="param", **panels(d_out_p, hd), pack=w_o),
        Buffer("b_o", (d_out_p,), "param", pack=b_o),
        Buffer("out", (rows, d_out_p), "output", dtype=dtype,
               symbolic={0: "rows"} if symbolic else None),
    ]
    buf = {b.name: b for b in buffers}
    scalars = call_scalars(cross) if symbolic else ()
    ph = _placeholders(buf, scalars, tile_rows)
    extra = list(CROSS_SCALARS[:len(scalars)])    # the scalars' names, in order

    kernels, text = [], []
    # 1. packed QKV GEMM
    x, wqkv, bqkv = ph("x"), ph("w_qkv"), ph("b_qkv")
    qkv, st = _gemm("qkv", qkv_node.name, x, wqkv, bqkv,
                    ph.dims["padded_rows"] if symbolic else rows_qkv, d_model, n_qkv_p, nr,
                    panel_major=True, scalars=scalars, max_rows=rows_qkv, a_exact=True,
                    pack_tile=pack(d_model, dtype != COMPUTE), pairs=pairs(d_model),
                    on_amx=on_amx(d_model), out_dtype=qkv_temp,
                    head_panels=(3, heads, dp // nr) if (
                        cache is None and not cross and kv_heads == heads and dp % nr == 0
                        and (q_base, k_base, v_base) == (0, heads * d, 2 * heads * d)
                        and n_qkv_p == 3 * heads * dp) else None)
    kernels.append(Kernel("qkv_projection", ["x", "w_qkv", "b_qkv", "qkv"] + extra,
                          te.create_prim_func([x, wqkv, bqkv, qkv, *scalars]), st))
    text.append(f"qkv[p, m, j] = sum_k x[m, k] * w_qkv[p, k, j] + b_qkv[p*{nr} + j]"
                f"   # {len(segments)} head projections, one GEMM")
    if cross:   # 1b. the K/V heads' GEMM over the context
        c, wkv, bkv = ph(kv_node.inputs[0]), ph("w_kv"), ph("b_kv")
        kv, st = _gemm("kv", kv_node.name, c, wkv, bkv,
                       ph.dims["kv_padded_rows"] if symbolic else rows_kv, kv_dim, n_kv_p, nr,
                       panel_major=True, scalars=scalars, max_rows=rows_kv, a_exact=True,
                       pack_tile=pack(kv_dim, dtype != COMPUTE), pairs=pairs(kv_dim),
                       on_amx=on_amx(kv_dim), out_dtype=kv_temp)
        kernels.append(Kernel("kv_projection", [c.name, "w_kv", "b_kv", "kv"] + extra,
                              te.create_prim_func([c, wkv, bkv, kv, *scalars]), st))
        text.append(f"kv[p, m, j] = sum_k {c.name}[m, k] * w_kv[p, k, j] + b_kv[p*{nr} + j]"
                    f"   # {len(kv_segments)} K/V head projections of the context")
    # 2. RoPE on qkv's Q and K columns, in place
    lengths = [att_node.inputs[-1]] if has_lengths else []
    if a.get("rotary"):
        r = a["rotary"]
        kernels.append(Kernel("rotary", ["qkv"] + (lengths if cache else []) + ["rope"] + extra,
                              stages=[Stage("rotary", "rotary_template", att_node.name, (), work)],
                              template="rotary", workload=work))
        text.append(f"qkv[Q, K columns] = rope(qkv, base={r['base']:g}, "
                    f"rotary_dim={r['rotary_dim']})  # in place, cos/sin table "
                    f"[2, {positions}, {r['rotary_dim'] // 2}]")
    if cache is not None:
        _decode_kernels(kernels, text, work, cfg, att_node, lengths, extra, tables,
                        tuned=tuned is not None)
    else:   # 3. attention template
        kernels.append(Kernel("attention", ["qkv"] + (["kv"] if cross else []) + ["blocks"] +
                              lengths + ["att"] + tables + extra,
                              stages=[Stage("attention", "attention_template", att_node.name,
                                            (), work)],
                              template="attention", workload=work, config=cfg,
                              tuned=tuned is not None))
        text.append(f"att = attention(qkv)  # template: {heads} heads, {kv_heads} K/V heads, "
                    f"head_dim {d}, scale {a['scale']:.6g}, mask {a.get('mask')!r}; "
                    f"block table {table.shape}: {int((table == 0).sum())} of {table.size} "
                    "blocks skipped")
    program = _output_gemm(kernels, text, buffers, out_node, rows, rows_att, hd, d_out_p, nr,
                           ph if symbolic else None, pack_tile=pack(hd), pairs=pairs(hd),
                           on_amx=on_amx(hd))
    if symbolic:
        program.symbolic = {**symbolic, "max_batch": batch, "max_seq": seq,
                            "row_tile": tile_rows,
                            **({"max_kv_seq": kv_seq} if cross else {})}
    return program


def _packed(segments, depth, width, nr, dp, pairs=False, on_amx=False):
    """The param recipes (mhagen.params) of a packed GEMM's weights and bias: segment i's
    d columns at i * dp (each head padded to what the attention template reads); pairs:
    the weights in pairs of the depth (the GEMM runs over pairs, or on_amx: AMX tiles)."""
    w = {"kind": "panels", "depth": depth, "width": width, "panel": nr,
         "columns": [{"weight": s["weight"], "head": s["head"], "at": i * dp}
                     for i, s in enumerate(segments)], **({"pairs": True} if pairs else {}),
         **({"amx": True} if on_amx else {})}
    b = {"kind": "vector", "length": width,
         "pieces": [{"weight": s["bias"], "head": s["head"], "at": i * dp}
                    for i, s in enumerate(segments) if s.get("bias")]}
    return w, b


def _cross_buffers(context, rows, kv_dim, rows_kv, segments, width, nr, dp, symbolic, dtype,
                   panels, pairs, kv_dtype, on_amx=False):
    """A cross-attention's context input, its K/V GEMM's packed weights and the kv temporary
    (symbolic: their rows follow the call's batch * kv_seq); panels: the packed weight's
    shape and dtype (width, depth) -> dict; pairs: its weights in pairs of the depth
    (on_amx: for AMX tiles); kv_dtype: the kv temporary's."""
    w_kv, b_kv = _packed(segments, kv_dim, width, nr, dp, pairs, on_amx)
    return [Buffer(context, (rows, kv_dim), "input", dtype=dtype,
                   doc="context [batch*kv_seq, kv_dim]: what K and V project",
                   symbolic={0: "kv_rows"} if symbolic else None),
            Buffer("w_kv", role="param", **panels(width, kv_dim), pack=w_kv,
                   doc="every K/V weight side by side, in column panels"),
            Buffer("b_kv", (width,), "param", pack=b_kv),
            Buffer("kv", (width // nr, rows_kv, nr), "temp", dtype=kv_dtype,
                   doc="K, V of every K/V head in column panels (cross-attention)",
                   symbolic={1: "kv_padded_rows"} if symbolic else None)]


def _placeholders(buf, scalars, tile_rows):
    """ph(name): a TE placeholder of buffer `name`; symbolic axes become expressions of the
    scalars (ph.dims: batch, seq, rows, padded_rows, and with a third scalar, the context's
    kv_seq, kv_rows, kv_padded_rows)."""
    dims = {}

    def padded(rows):
        return tirx.floordiv(rows + tile_rows - 1, tile_rows) * tile_rows
    if scalars:
        b, s = scalars[:2]
        dims = {"batch": b, "seq": s, "rows": b * s, "padded_rows": padded(b * s)}
    if len(scalars) == 3:
        dims.update(kv_seq=scalars[2], kv_rows=b * scalars[2],
                    kv_padded_rows=padded(b * scalars[2]))

    def ph(name):
        shape = buf[name].call_shape(dims) if scalars else buf[name].shape
        return te.placeholder(shape, buf[name].dtype, name=name)
    ph.dims, ph.scalars = dims, tuple(scalars)
    return ph


def _decode_kernels(kernels, text, work, cfg, att_node, lengths, extra, tables=(),
                    tuned=False):
    """A decoding layer's cache append and split-KV attention (templates of the backend);
    extra: the scalar arguments of a symbolic-length build; tables: the score modifier's
    large tables (params); tuned: cfg came from a tuning record."""
    kernels.append(Kernel("cache_append", ["qkv"] + lengths + ["k_cache", "v_cache"] + extra,
                          stages=[Stage("cache_append", "cache_append_template",
                                        att_node.name, (), work)],
                          template="cache_append", workload=work))
    text.append("k_cache[b, g, cache_lens[b] + t], v_cache[...] = K, V of qkv row b*seq + t"
                "  # in place")
    kernels.append(Kernel("attention", ["qkv"] + lengths + ["k_cache", "v_cache", "part_o",
                                                            "part_ml", "att"] + list(tables)
                          + extra,
                          stages=[Stage("attention", "decode_template", att_node.name, (),
                                        work)],
                          template="decode", workload=work, config=cfg, tuned=tuned))
    text.append(f"att = decode_attention(qkv, k_cache, v_cache)  # split-KV template: "
                f"{work['heads']} heads, {work['kv_heads']} K/V heads, cache "
                f"{work['cache']}, mask {work.get('mask')!r}; positions from cache_lens")


def _output_gemm(kernels, text, buffers, out_node, rows, rows_att, hd, d_out_p, nr,
                 ph=None, pack_tile=None, pairs=False, on_amx=False):
    """The output projection kernel; returns the finished Program. ph: a symbolic build's
    placeholders (_placeholders)."""
    buf = {b.name: b for b in buffers}
    scalars = ()
    max_rows = rows_att
    if ph is not None:
        scalars = ph.scalars
        rows, rows_att = ph.dims["rows"], ph.dims["padded_rows"]
    else:
        ph = _placeholders(buf, (), 0)
    att, wo, bo = ph("att"), ph("w_o"), ph("b_o")
    y, st = _gemm("out", out_node.name, att, wo, bo, rows_att, hd, d_out_p, nr, out_rows=rows,
                  scalars=scalars, max_rows=max_rows, pack_tile=pack_tile,
                  out_dtype=buf["out"].dtype, pairs=pairs, on_amx=on_amx)
    kernels.append(Kernel("output_projection", ["att", "w_o", "b_o", "out"] +
                          list(CROSS_SCALARS[:len(scalars)]),
                          te.create_prim_func([att, wo, bo, y, *scalars]), st))
    text.append(f"out[m, n] = sum_k att[m, k] * w_o[n // {nr}, k, n % {nr}] + b_o[n]")
    return Program(buf, kernels, "\n".join(text))
