"""Lower an attention core (mhagen/ir/core.py) to its kernels: no projections, so no GEMMs,
only the attention, on the core template (schedules/cpu/core.py, the decode template over
the caller's q, k and v):

  core_step   one query a batch row (q_len 1: a decoding step); row tiles of the query
              heads of a K/V head
  core        any q_len (a prompt, or several new tokens); row tiles sized for the
              largest call (16 query rows in the vector lanes where there are that many)

Both take (q, [kv_lens,] k, v, part_o, part_ml, out, [kv_starts,] [score tables,] batch,
seq, kv_seq): every length is the call's (TVM symbolic shapes), q, k and v are read with
their own strides, and the partial results' temporaries are sized per call.
"""
from __future__ import annotations

from mhagen.lower.te import score_table_buffers
from mhagen.program import Buffer, Kernel, Program, Stage
from mhagen.workloads import CoreWorkload

SCALARS = ("batch", "seq", "kv_seq")


def lower_core(core, rule, backend, max_batch: int, max_seq: int, max_kv_seq: int) -> Program:
    """The core's Program: buffers (shapes at the maxima, for the record) and its kernels
    (a step kernel, and a kernel for any q_len unless max_seq is 1); rule: the backend's
    core rule (its default configs)."""
    target = backend.target
    tables = [b for _, b in score_table_buffers(core.score_mod)]
    args = (["q"] + (["kv_lens"] if core.key_padding else []) + ["k", "v", "part_o",
                                                                  "part_ml", "out"]
            + (["kv_starts"] if core.key_padding else []) + [b.name for b in tables]
            + list(SCALARS))
    kernels, lines = [], []
    shapes = [("core_step", 1, True)] + ([("core", max_seq, False)] if max_seq > 1 else [])
    for name, seq, step in shapes:
        work = CoreWorkload(
            batch=max_batch, seq=seq, kv_seq=max_kv_seq, heads=core.num_heads,
            kv_heads=core.kv_heads, head_dim=core.head_dim,
            head_dim_padded=backend.head_dim_padded(core.head_dim), scale=core.scale,
            mask=core.full_mask, score_mod=core.score_mod, key_padding=core.key_padding,
            dtype=core.dtype, step=step)
        cfg = rule.default_config(work, target)
        kernels.append(Kernel(name, list(args),
                              stages=[Stage("attention", "core_template", core.name, (), work)],
                              template="core", workload=work, config=cfg))
        lines.append(f"{name}: out = attention(q, k, v)  # split-KV template, "
                     f"{'q_len 1' if step else 'any q_len'}: row tiles of {cfg.row_tile}, "
                     f"{cfg.workers} workers, key blocks of {cfg.kv_block}")
    d, dt = core.head_dim, core.dtype
    buffers = [
        Buffer("q", (max_batch, core.num_heads, max_seq, d), "input", dt,
               doc="queries [batch, heads, q_len, head_dim], any strides (head_dim "
               "contiguous); the last q_len positions"),
        *([Buffer("kv_lens", (max_batch,), "input", "int32",
                  doc="keys visible per batch row end here (default kv_len)")]
          if core.key_padding else []),
        Buffer("k", (max_batch, core.kv_heads, max_kv_seq, d), "input", dt,
               doc="keys [batch, kv_heads, kv_len, head_dim], any strides"),
        Buffer("v", (max_batch, core.kv_heads, max_kv_seq, d), "input", dt,
               doc="values, as k"),
        Buffer("part_o", (1, 1, 1), "temp", doc="partial O per (piece, row): sized per call"),
        Buffer("part_ml", (1, 1, 1), "temp", doc="partial (m, l) per (piece, row)"),
        Buffer("out", (max_batch * max_seq, core.num_heads * d), "output", dt,
               doc="[batch * q_len, heads * head_dim] = [batch, q_len, heads, head_dim]"),
        *([Buffer("kv_starts", (max_batch,), "input", "int32",
                  doc="keys visible per batch row start here (default 0)")]
          if core.key_padding else []),
        *tables]
    return Program({b.name: b for b in buffers}, kernels, "\n".join(lines),
                   fusion="attention core: no projections (template only)")
