"""What a kernel's schedule rule or template is asked to compute: typed, frozen workloads.

Lowering (mhagen/lower/) makes them; schedule rules and templates (schedules/) read their
fields; tuning records key and check configs against them. One class per kind of stage:

  AttentionWorkload  the fused attention / decode / rotary / cache-append templates
  GemmWorkload       a packed GEMM stage of the fused kernels (weights in column panels)
  MatmulWorkload     a batched matmul stage of the unfused kernel (TE, rules)
  RowsWorkload       a row-wise stage of the unfused kernel (softmax over cols)
  ElementwiseWorkload  an element-wise stage (scalar: one value per row, no vector axis);
                     epilogues and packs, whose rules read nothing
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionWorkload:
    """The fused attention of one layer, as its templates read it (qkv in column panels).

    Lengths: batch, seq (the largest call's where symbolic); rows: the qkv temporary's rows
    (batch * seq padded to whole register tiles); att_rows: the att temporary's.
    Heads: heads query heads, kv_heads K/V heads (head h reads K/V head h // (heads //
    kv_heads)), head_dim d, each head padded to head_dim_padded columns in qkv; q_base,
    k_base, v_base: the first Q/K/V column of qkv; qkv_width: qkv's columns, in panels of
    `panel`.
    """
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_padded: int
    q_base: int
    k_base: int
    v_base: int
    rows: int
    att_rows: int
    qkv_width: int
    panel: int
    scale: float
    mask: object = None           # mhagen.ir expression, or None
    score_mod: object = None      # mhagen.ir expression, or None
    rotary: dict | None = None    # {"base", "rotary_dim", ...} of a RoPE layer
    lengths: bool = False         # key lengths per batch row given at call time
    temp_dtype: str = "float32"   # the att temporary's dtype
    pairs: bool = False           # bfloat16 pairs of head columns and keys (AVX-512 BF16)
    amx: bool = False             # S^T = K Q^T and P V on AMX tiles
    symbolic: bool = False        # the kernels take the call's batch and seq
    row_tile: int | None = None   # symbolic: rows are padded to this many
    cross: bool = False           # K/V read from the kv temporary (cross-attention)
    kv_seq: int | None = None     # cross: the context's length
    kv_rows: int | None = None    # cross: kv's rows
    kv_width: int | None = None   # cross: kv's columns
    cache: int | None = None      # decoding: the K/V cache's max_len
    cache_dtype: str = "float32"  # decoding: what the cache stores
    packed: bool = False          # decoding, any number of new tokens: each batch row's
    #                               tokens packed (cu_seqlens [batch + 1]; call scalars batch
    #                               1, seq the call's tokens)
    kv_block_size: int | None = None  # decoding with a paged cache: tokens a pool block
    table_batch: int | None = None    # the block table's batch extent (1: shared)
    table_heads: int | None = None    # the block table's head extent (1: shared)
    skip_by_length: bool = False  # key blocks past a row's length are skipped
    varlen: bool = False          # packed sequences: the query tiles and each tile's keys
    #                               come from a per-call tile table (mhagen/packed.py)


@dataclass(frozen=True)
class GemmWorkload:
    """C = A @ W + bias over `rows` x `depth` x `cols`, W in column panels of `panel`."""
    rows: int
    cols: int
    depth: int
    panel: int
    panel_major: bool = False     # C is [cols / panel, rows, panel]
    pairs: bool = False           # the depth runs in bfloat16 pairs
    amx: bool = False             # on AMX tiles
    head_panels: tuple | None = None   # (sections, heads, panels a head): head by head
    symbolic: bool = False        # rows are the largest call's


@dataclass(frozen=True)
class MatmulWorkload:
    """C[b] = A[b] @ B[b]: batch x rows x depth x cols (the unfused kernel)."""
    batch: int
    rows: int
    cols: int
    depth: int


@dataclass(frozen=True)
class RowsWorkload:
    """A row-wise stage (softmax) over batch x rows rows of cols values."""
    batch: int
    rows: int
    cols: int


@dataclass(frozen=True)
class ElementwiseWorkload:
    """An element-wise stage; scalar: one value per row (no vector axis to split). Also
    the workload of stages whose rule reads nothing (epilogues, packs)."""
    scalar: bool = False


@dataclass(frozen=True)
class CoreWorkload:
    """An attention core's kernel (mhagen/ir/core.py: q, k, v as a model hands them over),
    as the core template (schedules/cpu/core.py) reads it. batch, seq, kv_seq: the largest
    call's (the kernel takes the call's; seq is 1 exactly in a `step` kernel); heads,
    kv_heads, head_dim as the core's, head_dim_padded: the template's rows of O; mask: the
    core's full mask (and kv_idx < kv_len in a prefill kernel with key padding)."""
    batch: int
    seq: int
    kv_seq: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_padded: int
    scale: float
    mask: object = None           # the core's full mask expression, or None
    score_mod: object = None
    key_padding: bool = False     # kv_lens and kv_starts per call
    dtype: str = "float32"        # q, k, v and out
    step: bool = False            # one query a batch row (seq fixed at 1)
    prefill: bool = False         # q_len == kv_len, on the prefill template: seq is the
    #                               largest prompt, the block table's extent
    table_batch: int = 1          # prefill: the block table's batch and head extents
    table_heads: int = 1
    # what the decode template asks of a workload (default_decode_config, decode_layout):
    # a core is never packed nor paged (class attributes, not fields)
    packed = False
    kv_block_size = None
