"""What every attention template (x86, CUDA) computes the same way, from the workload: which
scores a mask keeps, the score modifier in the templates' log2 units, key rows, block-table
indices. (mhagen/lower/fused.py describes the workload's fields.)"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL, SKIP
from mhagen.lower.te import (LN2, LOG2E, call_scalars, mask_to_tir, score_table_buffers,
                             score_to_tir)
from mhagen.schedules.tvmscript import cheap_stack


class ScoreRules:
    """Python helpers the TIR templates call while they are parsed."""

    def __init__(self, w, math=None):
        self.math = math     # vectorisable tanh/exp for score modifiers (score_to_tir)
        # symbolic-length builds: the call's batch and seq are scalar arguments (free vars
        # while the template is parsed, made parameters by attention_entry / with_scalars)
        self.symbolic = bool(w.symbolic)
        if self.symbolic:
            self.scalars = call_scalars(bool(w.cross))
            self.batch, self.seq = self.scalars[:2]
        else:
            self.batch, self.seq = w.batch, w.seq
            self.scalars = ()
        # the keys' length: the context's in cross-attention, else the queries'
        self.kv_seq = w.kv_seq or self.seq
        if self.symbolic and w.cross:
            self.kv_seq = self.scalars[2]
        self.mask, self.score_mod = w.mask, w.score_mod
        # the modifier's large tables: the lowering's params (same names and shapes), free
        # buffers while the template is parsed, parameters after with_scalars
        self.tables = [(v, tirx.decl_buffer(b.shape, "float32", name=b.name))
                       for v, b in score_table_buffers(self.score_mod)]
        # block-table extents (templates without a table, as the decode one: 1)
        self.table_batch, self.table_heads = w.table_batch or 1, w.table_heads or 1
        self.lengths = bool(w.lengths)   # key lengths per batch row, given per call
        self.skip_by_length = bool(w.skip_by_length)   # the mask has kv_idx < kv_len
        # packed sequences (mhagen/packed.py): the per-call tile table [tiles, 5] takes the
        # key lengths' parameter (a packed call has none), its first axis bound by the call;
        # a task's `b` is then its PackedSequence
        self.varlen = bool(w.varlen)

    def visible(self, b, h, qi, kj, lens=None, kv_len=None):
        """The key exists and the mask keeps it. Prefill: keys kj < kv_seq (seq, or the
        context's length), the mask reads kv_len = lens[b] when the layer takes key lengths,
        else kv_seq. Decoding: kv_len (the cached keys and the new ones) is both the bound
        and what the mask reads."""
        S, T = self.queries(b), self.keys(b)
        if kv_len is None:
            bound, kv_len = T, (T if lens is None else lens[b])
        else:
            bound = kv_len
        cond = kj < bound
        if self.mask is not None:
            cond = tirx.all(cond, mask_to_tir(self.mask, self.batch_index(b), h, qi, kj, S,
                                              kv_len))
        return cond

    def queries(self, b):
        """Batch row b's queries: the call's seq, or a packed sequence's own length."""
        return b.q_len if self.varlen else self.seq

    def keys(self, b):
        """Batch row b's keys: the call's kv_seq, or a packed sequence's own keys."""
        return b.k_len if self.varlen else self.kv_seq

    def batch_index(self, b):
        """What masks and score modifiers read as `batch` (packed sequences: 0, each runs as
        if alone; layers whose masks read it take no packed calls)."""
        return 0 if self.varlen else b

    def query_base(self, b):
        """The qkv (and att) row of batch row b's first query."""
        return b.q_start if self.varlen else b * self.seq

    def block_state(self, state, lens, b, k0, kb):
        """A key block's state from the build-time table, corrected by the call's key
        length (or, symbolic builds, the call's seq): blocks past it are skipped, a FULL
        block it cuts becomes PARTIAL (its scores masked one by one)."""
        if lens is not None and self.skip_by_length:
            length = lens[b]
        elif self.varlen:
            length = b.k_len
        elif self.symbolic:
            length = self.kv_seq
        else:
            return state
        return T.Select(k0 >= length, SKIP,
                        T.Select(tirx.all(state == FULL, k0 + kb > length), PARTIAL, state))

    def modified(self, x, b, h, qi, kj, kv_len=None):
        """Scores are in log2 units (scale * log2(e) folded into Q): the modifier sees the
        scaled score x * ln 2 and its result returns to log2 units. kv_len: a decoding
        layer's keys (else seq)."""
        if self.score_mod is None:
            return x
        S = self.queries(b)
        loads = {v: (lambda buf: lambda i: buf[i])(buf) for v, buf in self.tables}
        return score_to_tir(self.score_mod, x * T.float32(LN2), self.batch_index(b), h, qi,
                            kj, S, self.keys(b) if kv_len is None else kv_len,
                            self.math, loads) * T.float32(LOG2E)

    def key_row(self, b, t, masked):
        """Key t of batch row b (rows b * kv_seq + t): full blocks hold keys < kv_seq only;
        partial ones may run past it (clamped, masked)."""
        if self.varlen:
            return b.k_start + (T.min(t, b.k_len - 1) if masked else t)
        S = self.kv_seq
        return b * S + (T.min(t, S - 1) if masked else t)

    def tb(self, b):
        return b if self.table_batch > 1 and not self.varlen else 0

    def th(self, h):
        return h if self.table_heads > 1 else 0


def with_scalars(func, scalars, tables=()):
    """A template's PrimFunc with `tables` (ScoreRules.tables: the score modifier's large
    tables, buffers) and then `scalars` (the call's batch and seq vars of a symbolic-length
    build, or ()) appended as parameters; the template was parsed with them free
    (check_well_formed=False; tvm.compile checks the result)."""
    if not scalars and not tables:
        return func
    return tirx.PrimFunc(list(func.params) + [buf for _, buf in tables] + list(scalars),
                         func.body, func.ret_type, func.attrs)


class PackedSequence:
    """A packed call's task's sequence (ScoreRules.varlen): its first query row and number
    of queries, its first key row and number of keys, as TIR vars bound from its tile
    table row; the templates pass it where a padded call passes the batch row."""

    def __init__(self, q_start, q_len, k_start, k_len):
        self.q_start, self.q_len, self.k_start, self.k_len = q_start, q_len, k_start, k_len


def attention_entry(*args, **kwargs):
    """The attention PrimFunc (_parse_attention), parsed under schedules/tvmscript.py's
    cheap stack: without it TVM's frame lookups took most of each template parse."""
    with cheap_stack():
        return _parse_attention(*args, **kwargs)


def _parse_attention(body, rules, qkv_shape, table_shape, batch, out_shape, kv_shape=None,
                     dtype="float32", out_dtype=None):
    """The attention PrimFunc around a template's body macro body(qkv, kv, blocks, lens, out):
    (qkv, [kv,] blocks, [kv_lens,] out [, batch, seq]), with kv (the keys' and values'
    buffer, kv_shape) only for cross-attention (else the body reads them from qkv too),
    kv_lens only for layers that take key lengths per call (a packed call's kernel: its
    tile table `tiles` [n_tiles, 5] there, handed to the body as lens) and the scalars only
    in symbolic-length builds. Parsed without the well-formedness check (the scalars are free
    until with_scalars); tvm.compile checks the finished function. dtype: qkv's and kv's
    (float32, or a half layer's: on GPUs, and x86's bfloat16 pairs); out_dtype: out's
    (default dtype)."""
    out_dtype = out_dtype or dtype
    lens_shape = (tirx.Var("n_tiles", "int32"), 5) if rules.varlen else (batch,)
    if kv_shape is not None and (rules.lengths or rules.varlen):
        @T.prim_func(check_well_formed=False)
        def attention(qkv: T.Buffer(qkv_shape, dtype), kv: T.Buffer(kv_shape, dtype),
                      blocks: T.Buffer(table_shape, "int32"),
                      kv_lens: T.Buffer(lens_shape, "int32"),
                      out: T.Buffer(out_shape, out_dtype)):
            T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
            body(qkv, kv, blocks, kv_lens, out)
        return with_scalars(attention, rules.scalars, rules.tables)
    if kv_shape is not None:
        @T.prim_func(check_well_formed=False)
        def attention(qkv: T.Buffer(qkv_shape, dtype), kv: T.Buffer(kv_shape, dtype),
                      blocks: T.Buffer(table_shape, "int32"),
                      out: T.Buffer(out_shape, out_dtype)):
            T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
            body(qkv, kv, blocks, None, out)
        return with_scalars(attention, rules.scalars, rules.tables)
    if rules.lengths or rules.varlen:
        @T.prim_func(check_well_formed=False)
        def attention(qkv: T.Buffer(qkv_shape, dtype),
                      blocks: T.Buffer(table_shape, "int32"),
                      kv_lens: T.Buffer(lens_shape, "int32"),
                      out: T.Buffer(out_shape, out_dtype)):
            T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
            body(qkv, qkv, blocks, kv_lens, out)
        return with_scalars(attention, rules.scalars, rules.tables)

    @T.prim_func(check_well_formed=False)
    def attention(qkv: T.Buffer(qkv_shape, dtype),
                  blocks: T.Buffer(table_shape, "int32"),
                  out: T.Buffer(out_shape, out_dtype)):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        body(qkv, qkv, blocks, None, out)
    return with_scalars(attention, rules.scalars, rules.tables)
