"""Lower a fused graph (qkv_projection -> attention -> output_projection) to four kernels:

  qkv_projection  x [M, D] @ W_qkv (packed [N/NR, D, NR]) + b_qkv -> qkv [M, N]    (TE, GEMM)
  kv_layout       qkv -> K^T in key blocks [B, G, NKB, d, KB], V padded [B, G, TP, DP] (TE)
  attention       qkv, K^T, V, block table -> att [M, H*d]         (template, flash-style)
  output_proj     att @ W_O (packed) + b_o -> y [M, DO]                           (TE, GEMM)
with M = batch * seq. Weights are repacked once, when they are bound (Buffer.make).
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from mhagen.blockmask import block_table, table_dims
from mhagen.lower.program import Buffer, Kernel, Program, Stage, round_up


def pack_panels(w: np.ndarray, nr: int) -> np.ndarray:
    """[K, N] -> [ceil(N/nr), K, nr] zero-padded: each GEMM column panel contiguous."""
    k, n = w.shape
    padded = np.zeros((k, round_up(n, nr)), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, -1, nr).transpose(1, 0, 2))


def _gemm(name, node, a, wp, bias, rows, depth, cols, nr):
    """C[m, n] = sum_k a[m, k] wp[n // nr, k, n % nr] (+ bias[n]): one packed-GEMM stage."""
    k = te.reduce_axis((0, depth), name="k")
    mm = te.compute((rows, cols), lambda m, n: te.sum(a[m, k] * wp[n // nr, k, n % nr], axis=k),
                    name=name + "_matmul")
    out = te.compute((rows, cols), lambda m, n: mm[m, n] + bias[n], name=name)
    stages = [Stage(mm.op.name, "packed_matmul", node, (mm.op.name,),
                    {"rows": rows, "cols": cols, "depth": depth, "panel": nr}),
              Stage(name, "epilogue", node, (name,))]
    return out, stages


def lower_fused(graph, batch, seq, target, attention_rule, attention_config=None) -> Program:
    from mhagen.schedules.x86.attention import layout
    x_node, qkv_node, att_node, out_node = graph.nodes
    d_model = x_node.attrs["shape"][2]
    rows = batch * seq
    nr = 2 * target.lanes
    segments = qkv_node.attrs["segments"]
    n_qkv = sum(s["width"] for s in segments)
    n_qkv_p = round_up(n_qkv, nr)
    a = att_node.attrs
    d, heads = a["head_dim"], len(a["q_offsets"])
    kv_pairs = list(dict.fromkeys(zip(a["k_offsets"], a["v_offsets"])))
    kv_heads = len(kv_pairs)
    group = heads // kv_heads
    q_base = a["q_offsets"][0]
    if (a["q_offsets"] != [q_base + h * d for h in range(heads)]
            or [kv_pairs.index(p) for p in zip(a["k_offsets"], a["v_offsets"])]
            != [h // group for h in range(heads)]
            or [p[0] for p in kv_pairs] != [kv_pairs[0][0] + g * d for g in range(kv_heads)]
            or [p[1] for p in kv_pairs] != [kv_pairs[0][1] + g * d for g in range(kv_heads)]):
        raise NotImplementedError("attention with irregular head offsets")
    k_base, v_base = kv_pairs[0]
    d_out = out_node.attrs["out_features"]
    d_out_p = round_up(d_out, nr)
    hd = heads * d

    work = {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
            "qkv_width": n_qkv_p, "q_base": q_base, "scale": a["scale"], "mask": a.get("mask")}
    cfg = attention_config or attention_rule.default_config(work, target)
    lay = layout(work, cfg)
    tb, th = table_dims(a.get("mask"), batch, heads)
    work.update(table_batch=tb, table_heads=th)
    nkb, tp, dp = lay["n_kv_blocks"], lay["seq_padded"], lay["head_dim_padded"]
    kb = cfg.kv_block

    def make_wqkv(w):
        cols = [w[s["weight"]][s["head"]] for s in segments]
        return pack_panels(np.concatenate(cols, axis=1).astype(np.float32), nr)

    def make_bqkv(w):
        b = np.zeros(n_qkv_p, np.float32)
        for i, s in enumerate(segments):
            if s.get("bias"):
                b[i * d:(i + 1) * d] = w[s["bias"]][s["head"]]
        return b

    def make_wo(w):
        return pack_panels(np.asarray(w[out_node.attrs["weight"]], np.float32), nr)

    def make_bo(w):
        b = np.zeros(d_out_p, np.float32)
        if out_node.attrs.get("bias"):
            b[:d_out] = w[out_node.attrs["bias"]]
        return b

    table = block_table(a.get("mask"), batch, heads, seq, cfg.q_tile, kv_block=kb)
    buffers = [
        Buffer("x", (rows, d_model), "input", doc="x [batch*seq, d_model]"),
        Buffer("w_qkv", (n_qkv_p // nr, d_model, nr), "param", make=make_wqkv,
               doc="every Q/K/V weight side by side, in column panels"),
        Buffer("b_qkv", (n_qkv_p,), "param", make=make_bqkv),
        Buffer("qkv", (rows, n_qkv_p), "temp"),
        Buffer("k_t", (batch, kv_heads, nkb, d, kb), "temp", doc="K^T per key block"),
        Buffer("v", (batch, kv_heads, tp, dp), "temp"),
        Buffer("blocks", table.shape, "param", dtype="int32", make=lambda w: table,
               doc="0 skip / 1 partial / 2 full per (query tile, key block)"),
        Buffer("att", (rows, hd), "temp", doc="attention output, heads side by side"),
        Buffer("w_o", (d_out_p // nr, hd, nr), "param", make=make_wo),
        Buffer("b_o", (d_out_p,), "param", make=make_bo),
        Buffer("out", (rows, d_out_p), "output"),
    ]
    buf = {b.name: b for b in buffers}

    def ph(name):
        return te.placeholder(buf[name].shape, buf[name].dtype, name=name)

    kernels, text = [], []
    # 1. packed QKV GEMM
    x, wqkv, bqkv = ph("x"), ph("w_qkv"), ph("b_qkv")
    qkv, st = _gemm("qkv", qkv_node.name, x, wqkv, bqkv, rows, d_model, n_qkv_p, nr)
    kernels.append(Kernel("qkv_projection", ["x", "w_qkv", "b_qkv", "qkv"],
                          te.create_prim_func([x, wqkv, bqkv, qkv]), st))
    text.append(f"qkv[m, n] = sum_k x[m, k] * w_qkv[n // {nr}, k, n % {nr}] + b_qkv[n]"
                f"   # {len(segments)} head projections, one GEMM")
    # 2. K^T / V layout for the attention template
    q_in = ph("qkv")
    zero = tirx.const(0.0, "float32")
    k_t = te.compute(buf["k_t"].shape, lambda b, g, blk, c, j: tirx.if_then_else(
        blk * kb + j < seq, q_in[b * seq + tirx.min(blk * kb + j, seq - 1), k_base + g * d + c],
        zero), name="k_t")
    v = te.compute(buf["v"].shape, lambda b, g, t, c: tirx.if_then_else(
        tirx.all(t < seq, c < d), q_in[b * seq + tirx.min(t, seq - 1),
                                      v_base + g * d + tirx.min(c, d - 1)], zero), name="v")
    kernels.append(Kernel("kv_layout", ["qkv", "k_t", "v"], te.create_prim_func([q_in, k_t, v]),
                          [Stage("k_t", "elementwise", att_node.name, ("k_t",)),
                           Stage("v", "elementwise", att_node.name, ("v",))]))
    text.append(f"k_t[b, g, blk, c, j] = qkv[b*{seq} + blk*{kb} + j, {k_base} + g*{d} + c]  "
                f"(0 past seq);  v[b, g, t, c] = qkv[b*{seq} + t, {v_base} + g*{d} + c]")
    # 3. attention template
    kernels.append(Kernel("attention", ["qkv", "k_t", "v", "blocks", "att"],
                          stages=[Stage("attention", "attention_template", att_node.name,
                                        (), work)],
                          template="attention", workload=work, config=cfg,
                          tuned=attention_config is not None))
    text.append(f"att = attention(qkv)  # template: {heads} heads, {kv_heads} K/V heads, "
                f"head_dim {d}, scale {a['scale']:.6g}, mask {a.get('mask')!r}; "
                f"block table {table.shape}: {int((table == 0).sum())} of {table.size} "
                "blocks skipped")
    # 4. output projection
    att, wo, bo = ph("att"), ph("w_o"), ph("b_o")
    y, st = _gemm("out", out_node.name, att, wo, bo, rows, hd, d_out_p, nr)
    kernels.append(Kernel("output_projection", ["att", "w_o", "b_o", "out"],
                          te.create_prim_func([att, wo, bo, y]), st))
    text.append(f"out[m, n] = sum_k att[m, k] * w_o[n // {nr}, k, n % {nr}] + b_o[n]")
    return Program({b.name: b for b in buffers}, kernels, "\n".join(text))
