"""The attention core on CPUs (mhagen/ir/core.py: query, key and value heads as a model hands
them over): the existing attention templates reading the caller's tensors in place.

Three kernels a core (mhagen/lower/core.py), all reading q [batch, heads, q_len, head_dim]
and k, v [batch, kv_heads, kv_len, head_dim] with the caller's strides (only head_dim must
be contiguous: Hugging Face hands transposed views; the data needs only the element's
alignment) and writing out [batch * q_len, heads * head_dim] (Hugging Face's [batch, q_len,
heads, head_dim]); nothing is copied:

  core_step     one query a batch row (decoding), and
  core          any q_len <= kv_len (new tokens after cached ones, a long prompt): the
                split-KV decode template (decode*.py), whose K/V reads are already in this
                layout (its cache's). Where it asks its params record (CoreParams):
                  q_lane     a query value from q (not qkv's panels): lanes past head_dim
                             read as 0 where head_dim is not whole vectors (DP > d)
                  q_pos      query t is at kv_len - q_len + t (bottom-right)
                  kv_len_of  the call's kv_len, or a row's kv_lens[b] with key padding
                  out_value  the output rounded to a half core's dtype
  core_prefill  q_len == kv_len (a prompt without cache, an encoder): the prefill template
                (attention*.py: register tiles of S^T = K Q^T and P V, a block table that
                skips hidden key blocks), per task over one batch row's K and V
                (buffer views with the caller's strides: CoreLayout.k_at and v_lane read
                them), Q^T copied from q, out through out_value. Built for prompts up to
                the build's max_seq_len (the block table's extent); longer ones run `core`.

With key padding the mask stage also hides keys before kv_starts[b] (CoreScoreRules), and
the prefill kernel skips key blocks before it, as it skips those past kv_lens[b]. The
decode kernels' partial results follow the call's size (their first axis is an expression
of the scalars), so the module sizes them per call, not for a maximum.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from tvm import tirx
from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL, SKIP, conjuncts
from mhagen.errors import TargetError
from mhagen.ir import expr as ex
from mhagen.lower.te import LOG2E, score_table_buffers
from mhagen.schedules.attention_common import ScoreRules
from mhagen.schedules.cpu.attention_kernel import (ON_STACK, finish_macro, key_block_macro,
                                                   task_tile)
from mhagen.schedules.cpu.attention_layout import KernelLayout, kernel_layout
from mhagen.schedules.cpu.attention_tiles import default_tiles
from mhagen.schedules.cpu.decode_kernel import task_macros
from mhagen.schedules.cpu.decode_params import DecodeParams
from mhagen.schedules.cpu.decode_tiles import (default_decode_config, keys_in_flight,
                                               rows_in_lanes)
from mhagen.schedules.cpu.fast_math import EXP2_HELPER, SCORE_MATH, f32
from mhagen.schedules.tvmscript import cheap_stack
from mhagen.schedules.x86 import denormals
from mhagen.schedules.x86.bf16_dot import with_llvm_ir
from mhagen.workloads import AttentionWorkload


def core_rule(backend):
    """The core template's rule for a backend: CPU families (those with the decode
    template); TargetError elsewhere."""
    if backend.device != "cpu" or backend.decode is None:
        raise TargetError(f"the attention core (mhagen.attention_core) compiles for CPU "
                          f"targets only; {backend.target.name} is {backend.family}: build "
                          "it for x86 or aarch64")
    return CoreRule(flush=backend.flushes_denormals,
                    x86_helpers=bool(getattr(backend.attention, "x86_helpers", False)))


class CoreRule:
    """The attention core's kernels (CoreWorkload): the decode template (step, core) or
    the prefill template (prefill)."""
    name = "attention_core"

    def __init__(self, flush: bool = False, x86_helpers: bool = False):
        self.flush = flush               # x86: tasks run with denormals flushed
        self.x86_helpers = x86_helpers   # x86: LLVM IR helpers (EXP2_16 on AVX-512)

    def default_config(self, workload, target):
        """The decode template's default for the kernel's largest call (row tiles of up to
        16 query rows, one worker a core), or the prefill template's (query tiles and key
        blocks from the largest prompt and the mask)."""
        if workload.prefill:
            return default_tiles(prefill_workload(workload), target)
        return default_decode_config(workload, target)

    def build(self, w, cfg, target):
        if w.prefill:
            return build_core_prefill(w, cfg, target.lanes, self.flush, self.x86_helpers)
        return build_core(w, cfg, target.vector_registers, self.flush)


@dataclass(frozen=True)
class CoreParams(DecodeParams):
    """DecodeParams of a core kernel, its reads of q and positions its own."""
    KV: object = None        # the call's kv_len (a scalar)
    DT: str = "float32"      # q, k, v and out
    padding: bool = False    # kv_lens per call

    def q_lane(self, q, cu, b, h, t, ch, ln):
        col = ch * self.LN + ln
        if self.NCH * self.LN == self.d:    # head_dim in whole vectors
            return self.loaded(q[b, h, t, col])
        # lanes past head_dim: 0, their reads clamped inside the row
        return T.Select(col < self.d, self.loaded(q[b, h, t, T.min(col, self.d - 1)]),
                        self.zero)

    def q_pos(self, kv_lens, cu, b, t):
        return self.KV - self.S + t

    def kv_len_of(self, kv_lens, cu, b):
        return T.min(kv_lens[b], self.KV) if self.padding else self.KV

    def out_value(self, value):
        return value if self.DT == "float32" else T.Cast(self.DT, value)


class CoreScoreRules(ScoreRules):
    """ScoreRules of a core kernel: the call's batch, q_len and kv_len as scalars (q_len
    fixed at 1 in a step kernel); with key padding, keys before kv_starts[b] are hidden
    (kv_starts: a buffer of the kernel, appended to its parameters)."""

    def __init__(self, w, math, batch, seq, kv_seq, key_padding: bool):
        self.math = math
        self.symbolic = True
        self.batch, self.seq, self.kv_seq = batch, seq, kv_seq
        self.mask, self.score_mod = w.mask, w.score_mod
        self.tables = [(v, tirx.decl_buffer(b.shape, "float32", name=b.name))
                       for v, b in score_table_buffers(self.score_mod)]
        self.table_batch = self.table_heads = 1
        self.lengths = self.skip_by_length = bool(key_padding)
        self.starts = (tirx.decl_buffer((batch,), "int32", name="kv_starts")
                       if key_padding else None)
        self.varlen = False     # a core's calls are never packed

    def visible(self, b, h, qi, kj, lens=None, kv_len=None):
        cond = super().visible(b, h, qi, kj, lens, kv_len)
        return cond if self.starts is None else tirx.all(cond, kj >= self.starts[b])


def core_params(w, cfg, registers, flush, scalars) -> CoreParams:
    """The params record of core workload w under cfg (scalars: the call's batch, q_len,
    kv_len vars; q_len is 1 in a step kernel)."""
    B, S_var, KV = scalars
    S = 1 if w.step else S_var
    H, G, d, DP = w.heads, w.kv_heads, w.head_dim, w.head_dim_padded
    RT, KB, LN = cfg.row_tile, cfg.kv_block, cfg.lanes
    assert KB % LN == 0 and DP % LN == 0 and LN in (4, 8, 16), (KB, DP, LN)
    GROUP = H // G
    R = GROUP * S
    NRT = (R + RT - 1) // RT
    NG = B * G * NRT
    causal = w.mask is not None and any(p == ex.causal() for p in conjuncts(w.mask))
    return CoreParams(
        B=B, S=S, H=H, G=G, GROUP=GROUP, d=d, DP=DP, HD=H * d, N=KV, CD=w.dtype,
        PW=LN, NP=1, M=1, MA=B * S, Q_BASE=0, R=R, NRT=NRT, NG=NG, NP_MAX=NG + cfg.workers - 1,
        RT=RT, C=cfg.workers, KB=KB, LN=LN, NCH=d // LN, TAIL=d % LN, QCH=DP // LN,
        ROW_LANES=rows_in_lanes(RT, LN), JU=keys_in_flight(RT, LN, registers, KB),
        causal=causal, c_log2e=f32(w.scale * LOG2E), neg_inf=f32(float("-inf")),
        zero=f32(0.0), flush=flush, packed=False, BS=None, GT=G, GROUPT=GROUP, KV=KV,
        DT=w.dtype, padding=bool(w.key_padding))


def build_core(w, cfg, registers=16, flush=False):
    """The core PrimFunc: (q, [kv_lens,] k, v, part_o, part_ml, out, [kv_starts,] [score
    tables,] batch, seq, kv_seq)."""
    scalars = tuple(tirx.Var(n, "int32") for n in ("batch", "seq", "kv_seq"))
    rules = CoreScoreRules(w, SCORE_MATH, scalars[0], 1 if w.step else scalars[1], scalars[2],
                           w.key_padding)
    prm = core_params(w, cfg, registers, flush, scalars)
    with cheap_stack():
        func = _core_function(prm, rules)
    extra = ([rules.starts] if rules.starts is not None else []) + [b for _, b in rules.tables]
    func = tirx.PrimFunc(list(func.params) + extra + list(scalars), func.body,
                         func.ret_type, func.attrs)
    return with_llvm_ir(func, denormals.HELPERS if flush else "")


def _strided(prefix):
    """Stride vars of a 4-D tensor whose last axis is contiguous (bound from the caller's
    DLPack strides at each call)."""
    return tuple(tirx.Var(f"{prefix}_stride{i}", "int32") for i in range(3)) + (1,)


def _core_function(prm, rules):
    worker_task, merge_tile = task_macros(prm, rules)
    B, S, H, G, d, HD, KV, DT = prm.B, prm.S, prm.H, prm.G, prm.d, prm.HD, prm.KV, prm.DT
    NP_MAX, RT, DP, C, NG = prm.NP_MAX, prm.RT, prm.DP, prm.C, prm.NG
    align = 4 if DT == "float32" else 2           # the element's: any view is taken
    q_strides, k_strides, v_strides = _strided("q"), _strided("k"), _strided("v")

    if prm.padding:
        @T.prim_func(check_well_formed=False)   # free scalars until they become parameters
        def attention(q: T.Buffer((B, H, S, d), DT, strides=q_strides, align=align,
                                  offset_factor=1),
                      kv_lens: T.Buffer((B,), "int32"),
                      k: T.Buffer((B, G, KV, d), DT, strides=k_strides, align=align,
                                  offset_factor=1),
                      v: T.Buffer((B, G, KV, d), DT, strides=v_strides, align=align,
                                  offset_factor=1),
                      part_o: T.Buffer((NP_MAX, RT, DP), "float32"),
                      part_ml: T.Buffer((NP_MAX, 2, RT), "float32"),
                      out: T.Buffer((B * S, HD), DT, align=align, offset_factor=1)):
            T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
            # never packed nor paged: no cu_seqlens, no block tables
            for worker in T.parallel(C):
                worker_task(q, kv_lens, None, None, k, v, part_o, part_ml, worker)
            for tile in T.parallel(NG):
                merge_tile(kv_lens, None, part_o, part_ml, out, tile)
        return attention

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((B, H, S, d), DT, strides=q_strides, align=align,
                              offset_factor=1),
                  k: T.Buffer((B, G, KV, d), DT, strides=k_strides, align=align,
                              offset_factor=1),
                  v: T.Buffer((B, G, KV, d), DT, strides=v_strides, align=align,
                              offset_factor=1),
                  part_o: T.Buffer((NP_MAX, RT, DP), "float32"),
                  part_ml: T.Buffer((NP_MAX, 2, RT), "float32"),
                  out: T.Buffer((B * S, HD), DT, align=align, offset_factor=1)):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        # without key padding the template's lengths argument is never read: q stands in
        for worker in T.parallel(C):
            worker_task(q, q, None, None, k, v, part_o, part_ml, worker)
        for tile in T.parallel(NG):
            merge_tile(q, None, part_o, part_ml, out, tile)
    return attention


# -- prompts: the prefill template ----------------------------------------------------------

def prefill_workload(w) -> AttentionWorkload:
    """The prefill template's workload of a core prefill kernel: q, k and v as if they were
    one head's columns of a panel as wide as the padded head (K_PANELS where head_dim is
    whole vectors); lengths: key padding (the mask then ends with kv_idx < kv_len)."""
    DP = w.head_dim_padded
    return AttentionWorkload(
        batch=w.batch, seq=w.seq, heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim,
        head_dim_padded=DP, q_base=0, k_base=0, v_base=0, rows=1, att_rows=1, qkv_width=DP,
        panel=DP, scale=w.scale, mask=w.mask, score_mod=w.score_mod,
        lengths=bool(w.key_padding), symbolic=True, row_tile=1,
        table_batch=w.table_batch, table_heads=w.table_heads,
        skip_by_length=bool(w.key_padding))


@dataclass(frozen=True)
class CoreLayout(KernelLayout):
    """KernelLayout of a core prefill kernel: K and V read from one batch row's views
    [kv_heads, len, head_dim] (kv, vv), the output rounded to a half core's dtype."""
    DT: str = "float32"

    def loaded(self, value):
        return value if self.DT == "float32" else T.Cast("float32", value)

    def k_at(self, kv, g, cp, ci, row):
        return self.loaded(kv[g, row, cp * self.CW + ci])

    def v_lane(self, vv, g, co, row, cc):
        return self.loaded(vv[g, row, co * self.NV + cc])

    def out_value(self, value):
        return value if self.DT == "float32" else T.Cast(self.DT, value)


class PrefillScoreRules(CoreScoreRules):
    """CoreScoreRules of a prefill kernel: key rows index one batch row's view; a key block
    before kv_starts[b] is skipped, one it cuts is partial."""

    def key_row(self, b, t, masked):
        return T.min(t, self.kv_seq - 1) if masked else t

    def block_state(self, state, lens, b, k0, kb):
        state = super().block_state(state, lens, b, k0, kb)
        if self.starts is None:
            return state
        start = self.starts[b]
        return T.Select(k0 + kb <= start, SKIP,
                        T.Select(tirx.all(state == FULL, k0 < start), PARTIAL, state))


def build_core_prefill(w, cfg, lanes, flush=False, x86_helpers=False):
    """The core prefill PrimFunc: (q, [kv_lens,] k, v, blocks, out, [kv_starts,] [score
    tables,] batch, seq, kv_seq); q_len == kv_len == seq (kv_seq is not read)."""
    aw = prefill_workload(w)
    scalars = tuple(tirx.Var(n, "int32") for n in ("batch", "seq", "kv_seq"))
    rules = PrefillScoreRules(aw, SCORE_MATH, scalars[0], scalars[1], scalars[1],
                              w.key_padding)
    rules.table_batch, rules.table_heads = w.table_batch, w.table_heads
    n_q, n_kv = -(-w.seq // cfg.q_tile), -(-w.seq // cfg.kv_block)
    base = kernel_layout(aw, cfg, lanes, flush, x86_helpers, rules, n_q, n_kv)
    k = CoreLayout(**{f.name: getattr(base, f.name) for f in fields(KernelLayout)},
                   DT=w.dtype)
    assert not (k.PAIRS or k.AMX) and k.d % k.NV == 0, (k.PAIRS, k.AMX, k.d, k.NV)
    with cheap_stack():
        func = _prefill_function(k, rules)
    extra = ([rules.starts] if rules.starts is not None else []) + [b for _, b in rules.tables]
    func = tirx.PrimFunc(list(func.params) + extra + list(scalars), func.body,
                         func.ret_type, func.attrs)
    return with_llvm_ir(func, (EXP2_HELPER if k.AVX512 else "")
                        + (denormals.HELPERS if flush else ""))


def _prefill_body(k, rules):
    """The kernel's body: one task per (batch row, head, query tile), as the prefill
    template's body_macro, over views of the task's batch row of k and v."""
    key_block, finish = key_block_macro(k, rules), finish_macro(k, rules)
    tb, th, loaded = rules.tb, rules.th, k.loaded
    B, S, H, G, GROUP, NQ, NK = k.B, k.S, k.H, k.G, k.GROUP, k.NQ, k.NK
    d, DP, MQ, KB, MR, NR, OR, NV, LN, DT = (k.d, k.DP, k.MQ, k.KB, k.MR, k.NR, k.OR, k.NV,
                                             k.LN, k.DT)
    flush, neg_inf, zero, c_log2e = k.flush, k.neg_inf, k.zero, k.c_log2e

    @T.macro
    def body(q, kk, vv, blocks, lens, out):
        for task in T.parallel(B * H * NQ):
            csr = T.decl_buffer((1,), "int32")
            if flush:
                csr[0] = T.call_extern("int32", denormals.ENTER)
            q_t = T.decl_buffer((d, MQ), "float32")
            unused32 = T.decl_buffer((1, 1, 1), "int32")   # the pairs' and AMX's buffers
            unused16 = T.decl_buffer((1, 1, 1), "bfloat16")
            s_buf = T.decl_buffer((KB, MQ), "float32")
            o_buf = T.decl_buffer((MQ, DP), "float32")
            m_buf = T.decl_buffer((MQ,), "float32")
            l_buf = T.decl_buffer((MQ,), "float32")
            m_new = T.decl_buffer((MQ,), "float32")
            alpha = T.decl_buffer((MQ,), "float32")
            acc = T.alloc_buffer((MR, NR), "float32", scope="local", annotations=ON_STACK)
            acc_o = T.alloc_buffer((OR, NV), "float32", scope="local", annotations=ON_STACK)
            vec = T.alloc_buffer((4, LN), "float32", scope="local", annotations=ON_STACK)
            b, h, qt = T.meta_var(task_tile(task, B, H, NQ, rules.lengths))
            g = h // GROUP
            q0 = qt * MQ
            # this batch row's keys and values: [kv_heads, len, head_dim] views, strided
            k_b = T.decl_buffer((G, S, d), DT, data=kk.data,
                                elem_offset=kk.elem_offset + b * kk.strides[0],
                                strides=(kk.strides[1], kk.strides[2], 1))
            v_b = T.decl_buffer((G, S, d), DT, data=vv.data,
                                elem_offset=vv.elem_offset + b * vv.strides[0],
                                strides=(vv.strides[1], vv.strides[2], 1))
            # Q^T of the task's queries, scaled to log2 units (rows past S: copies)
            for c in range(d):
                for i in T.vectorized(MQ):
                    q_t[c, i] = loaded(q[b, h, T.min(q0 + i, S - 1), c]) * c_log2e
            for i in T.vectorized(MQ):
                m_buf[i] = neg_inf
                l_buf[i] = zero
            for i in range(MQ):
                for j in T.vectorized(DP):
                    o_buf[i, j] = zero
            for kb in range(NK):
                state = rules.block_state(blocks[tb(b), th(h), qt, kb], lens, b, kb * KB, KB)
                if state == FULL:
                    key_block(False, False, k_b, v_b, lens, q_t, s_buf, o_buf, m_buf, l_buf,
                              m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, unused32,
                              unused32, unused32, unused32, unused16, unused16)
                elif state == PARTIAL:
                    if kb * KB + KB <= S:
                        key_block(True, False, k_b, v_b, lens, q_t, s_buf, o_buf, m_buf,
                                  l_buf, m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB,
                                  unused32, unused32, unused32, unused32, unused16, unused16)
                    else:
                        key_block(True, True, k_b, v_b, lens, q_t, s_buf, o_buf, m_buf,
                                  l_buf, m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB,
                                  unused32, unused32, unused32, unused32, unused16, unused16)
            finish(o_buf, o_buf, l_buf, vec, out, b, h, q0)
            if flush:
                T.evaluate(T.call_extern("int32", denormals.EXIT, csr[0]))

    return body


def _prefill_function(k, rules):
    body = _prefill_body(k, rules)
    B, S, H, G, d, HD, DT, TB, TH, NQT, NKB = (k.B, k.S, k.H, k.G, k.d, k.HD, k.DT, k.TB,
                                               k.TH, k.NQT, k.NKB)
    align = 4 if DT == "float32" else 2
    q_strides, k_strides, v_strides = _strided("q"), _strided("k"), _strided("v")

    if rules.lengths:
        @T.prim_func(check_well_formed=False)   # free scalars until they become parameters
        def attention(q: T.Buffer((B, H, S, d), DT, strides=q_strides, align=align,
                                  offset_factor=1),
                      kv_lens: T.Buffer((B,), "int32"),
                      k: T.Buffer((B, G, S, d), DT, strides=k_strides, align=align,
                                  offset_factor=1),
                      v: T.Buffer((B, G, S, d), DT, strides=v_strides, align=align,
                                  offset_factor=1),
                      blocks: T.Buffer((TB, TH, NQT, NKB), "int32"),
                      out: T.Buffer((B * S, HD), DT, align=align, offset_factor=1)):
            T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
            body(q, k, v, blocks, kv_lens, out)
        return attention

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((B, H, S, d), DT, strides=q_strides, align=align,
                              offset_factor=1),
                  k: T.Buffer((B, G, S, d), DT, strides=k_strides, align=align,
                              offset_factor=1),
                  v: T.Buffer((B, G, S, d), DT, strides=v_strides, align=align,
                              offset_factor=1),
                  blocks: T.Buffer((TB, TH, NQT, NKB), "int32"),
                  out: T.Buffer((B * S, HD), DT, align=align, offset_factor=1)):
        T.func_attr({"global_symbol": "attention", "tirx.noalias": True})
        body(q, k, v, blocks, None, out)
    return attention


__all__ = ["CoreRule", "build_core", "build_core_prefill", "core_rule", "prefill_workload"]
