"""Lower an attention core (mhagen/ir/core.py) to its kernels: no projections, so no GEMMs,
only the attention, on the core template (schedules/cpu/core.py) over the caller's q, k
and v:

  core_step     one query a batch row (q_len 1: a decoding step): the decode template, row
                tiles of the query heads of a K/V head
  core          any q_len <= kv_len (new tokens after cached ones, prompts longer than the
                block table): the decode template, row tiles sized for the largest call
  core_prefill  q_len == kv_len up to max_seq (a prompt without cache, an encoder): the
                prefill template and a block table built here for max_batch x max_seq

The decode kernels take (q, [kv_lens,] k, v, part_o, part_ml, out, [kv_starts,] [score
tables,] batch, seq, kv_seq), the prefill kernel (q, [kv_lens,] k, v, blocks, out,
[kv_starts,] [score tables,] batch, seq, kv_seq): every length is the call's (TVM symbolic
shapes), q, k and v are read with their own strides, and the decode kernels' partial
results are sized per call.
"""
from __future__ import annotations

from dataclasses import replace

from mhagen.blockmask import KEY_PADDING, block_table
from mhagen.lower.te import score_table_buffers
from mhagen.program import Buffer, Kernel, Program, Stage
from mhagen.workloads import CoreWorkload

SCALARS = ("batch", "seq", "kv_seq")
KERNELS = ("core_step", "core", "core_prefill")


def lower_core(core, rule, backend, max_batch: int, max_seq: int, max_kv_seq: int) -> Program:
    """The core's Program: buffers (shapes at the maxima, for the record; the block table
    a param with its value) and its kernels (no `core` kernel where max_seq is 1, no
    `core_prefill` where head_dim is not whole P V vectors); rule: the backend's core rule
    (its default configs)."""
    target = backend.target
    tables = [b for _, b in score_table_buffers(core.score_mod)]
    padding = ["kv_lens"] if core.key_padding else []
    after = (["kv_starts"] if core.key_padding else []) + [b.name for b in tables] + \
        list(SCALARS)
    common = dict(batch=max_batch, kv_seq=max_kv_seq, heads=core.num_heads,
                  kv_heads=core.kv_heads, head_dim=core.head_dim,
                  head_dim_padded=backend.head_dim_padded(core.head_dim), scale=core.scale,
                  mask=core.full_mask, score_mod=core.score_mod,
                  key_padding=core.key_padding, dtype=core.dtype)
    kernels, lines, table = [], [], None
    for name in KERNELS:
        if name == "core" and max_seq == 1:
            continue
        work = CoreWorkload(seq=1 if name == "core_step" else max_seq,
                            step=name == "core_step", **common)
        if name == "core_prefill":
            work = replace(work, prefill=True, kv_seq=max_seq, mask=_prefill_mask(core))
            cfg = rule.default_config(work, target)
            if core.head_dim % cfg.out_cols:
                # P V's vectors would read past a row's head_dim: prompts run `core`
                lines.append(f"{name}: none (head_dim {core.head_dim} is not whole P V "
                             f"vectors of {cfg.out_cols}); prompts run core")
                continue
            table = block_table(work.mask, max_batch, core.num_heads, max_seq, cfg.q_tile,
                                cfg.kv_block, lengths=core.key_padding, symbolic=True)
            work = replace(work, table_batch=table.shape[0], table_heads=table.shape[1])
            args = ["q"] + padding + ["k", "v", "blocks", "out"] + after
            lines.append(f"{name}: out = attention(q, k, v)  # prefill template, q_len == "
                         f"kv_len <= {max_seq}: query tiles of {cfg.q_tile}, key blocks of "
                         f"{cfg.kv_block}; block table {table.shape}: "
                         f"{int((table == 0).sum())} of {table.size} blocks skipped")
        else:
            cfg = rule.default_config(work, target)
            args = ["q"] + padding + ["k", "v", "part_o", "part_ml", "out"] + after
            lines.append(f"{name}: out = attention(q, k, v)  # split-KV template, "
                         f"{'q_len 1' if work.step else 'any q_len'}: row tiles of "
                         f"{cfg.row_tile}, {cfg.workers} workers, key blocks of "
                         f"{cfg.kv_block}")
        kernels.append(Kernel(name, args, template="core", workload=work, config=cfg,
                              stages=[Stage("attention", "core_template", core.name, (),
                                            work)]))
    d, dt = core.head_dim, core.dtype
    buffers = [
        Buffer("q", (max_batch, core.num_heads, max_seq, d), "input", dt,
               doc="queries [batch, heads, q_len, head_dim], any strides (head_dim "
               "contiguous): the last q_len positions"),
        *([Buffer("kv_lens", (max_batch,), "input", "int32",
                  doc="keys visible per batch row end here (default kv_len)")]
          if core.key_padding else []),
        Buffer("k", (max_batch, core.kv_heads, max_kv_seq, d), "input", dt,
               doc="keys [batch, kv_heads, kv_len, head_dim], any strides"),
        Buffer("v", (max_batch, core.kv_heads, max_kv_seq, d), "input", dt,
               doc="values, as k"),
        Buffer("part_o", (1, 1, 1), "temp", doc="partial O per (piece, row): sized per call"),
        Buffer("part_ml", (1, 1, 1), "temp", doc="partial (m, l) per (piece, row)"),
        *([Buffer("blocks", table.shape, "param", "int32", pack={"kind": "constant"},
                  value=table, doc="core_prefill: 0 skip / 1 partial / 2 full per (query "
                  "tile, key block)")] if table is not None else []),
        Buffer("out", (max_batch * max_seq, core.num_heads * d), "output", dt,
               doc="[batch * q_len, heads * head_dim] = [batch, q_len, heads, head_dim]"),
        *([Buffer("kv_starts", (max_batch,), "input", "int32",
                  doc="keys visible per batch row start here (default 0)")]
          if core.key_padding else []),
        *tables]
    return Program({b.name: b for b in buffers}, kernels, "\n".join(lines),
                   fusion="attention core: no projections (templates only)")


def _prefill_mask(core):
    """The prefill kernel's mask: the core's, and kv_idx < kv_len with key padding (the
    template then skips key blocks past a row's kv_lens, and masks the one it cuts)."""
    mask = core.full_mask
    if not core.key_padding:
        return mask
    return KEY_PADDING if mask is None else mask & KEY_PADDING
