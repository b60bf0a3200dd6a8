"""The attention core on CPUs (mhagen/ir/core.py: query, key and value heads as a model hands
them over): the split-KV decode template (decode*.py) reading the caller's tensors in place.

The decode template already reads K and V in Hugging Face's layout ([batch, kv_heads, len,
head_dim]: its cache) and writes its output as [rows, heads x head_dim] with row b * S + t
(Hugging Face's [batch, q_len, heads, head_dim]). The core differs only where the template
asks its params record (CoreParams):
  q_lane      a query value from q [batch, heads, q_len, head_dim] (not qkv's panels): lanes
              past head_dim read as 0 where head_dim is not whole vectors (DP > d)
  q_pos       query t is at kv_len - q_len + t (bottom-right), not after cached keys
  kv_len_of   the call's kv_len, or a row's kv_lens[b] with key padding
  out_value   the output rounded to a half core's dtype
and the mask stage (CoreScoreRules.visible) also hides keys before kv_starts[b] (key
padding). q, k and v are buffers with the caller's strides (only head_dim must be
contiguous: Hugging Face hands transposed views), read where they lie; their data needs
only the element's alignment. Nothing is copied: the template streams K and V once per row
tile, as it streams a cache.

Two kernels a core (mhagen/lower/core.py): `core_step`, one query a batch row (decoding;
rows per tile: the query heads of a K/V head), and `core`, any q_len (a prompt: row tiles
of 16 query rows in the lanes, causal tiles stopping at their last query's position).
The partial results' temporaries follow the call's size (their first axis is an
expression of the scalars), so the module sizes them per call, not for a maximum.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from mhagen.blockmask import conjuncts
from mhagen.errors import TargetError
from mhagen.ir import expr as ex
from mhagen.lower.te import LOG2E, score_table_buffers
from mhagen.schedules.attention_common import ScoreRules
from mhagen.schedules.cpu.decode_kernel import task_macros
from mhagen.schedules.cpu.decode_params import DecodeParams
from mhagen.schedules.cpu.decode_tiles import (DecodeConfig, default_decode_config,
                                               keys_in_flight, rows_in_lanes)
from mhagen.schedules.cpu.fast_math import SCORE_MATH, f32
from mhagen.schedules.tvmscript import cheap_stack
from mhagen.schedules.x86 import denormals
from mhagen.schedules.x86.bf16_dot import with_llvm_ir


def core_rule(backend):
    """The core template's rule for a backend: CPU families (those with the decode
    template); TargetError elsewhere."""
    if backend.device != "cpu" or backend.decode is None:
        raise TargetError(f"the attention core (mhagen.attention_core) compiles for CPU "
                          f"targets only; {backend.target.name} is {backend.family}: build "
                          "it for x86 or aarch64")
    return CoreRule(flush=backend.flushes_denormals)


class CoreRule:
    """The attention core's kernels (CoreWorkload) on the decode template."""
    name = "attention_core"

    def __init__(self, flush: bool = False):
        self.flush = flush    # x86: tasks run with denormals flushed (x86/denormals.py)

    def default_config(self, workload, target) -> DecodeConfig:
        """The decode template's default for the kernel's largest call (row tiles of up to
        16 query rows, one worker a core)."""
        return default_decode_config(workload, target)

    def build(self, w, cfg, target):
        return build_core(w, cfg, target.vector_registers, self.flush)


@dataclass(frozen=True)
class CoreParams(DecodeParams):
    """DecodeParams of a core kernel, its reads of q and positions its own."""
    KV: object = None        # the call's kv_len (a scalar)
    DT: str = "float32"      # q, k, v and out
    padding: bool = False    # kv_lens per call

    def q_lane(self, q, b, h, t, ch, ln):
        col = ch * self.LN + ln
        if self.NCH * self.LN == self.d:    # head_dim in whole vectors
            return self.loaded(q[b, h, t, col])
        # lanes past head_dim: 0, their reads clamped inside the row
        return T.Select(col < self.d, self.loaded(q[b, h, t, T.min(col, self.d - 1)]),
                        self.zero)

    def q_pos(self, kv_lens, b, t):
        return self.KV - self.S + t

    def kv_len_of(self, kv_lens, b):
        return T.min(kv_lens[b], self.KV) if self.padding else self.KV

    def out_value(self, value):
        return value if self.DT == "float32" else T.Cast(self.DT, value)


class CoreScoreRules(ScoreRules):
    """ScoreRules of a core kernel: the call's batch, q_len and kv_len as scalars (q_len
    fixed at 1 in a step kernel); with key padding, keys before kv_starts[b] are hidden
    (kv_starts: a buffer of the kernel, appended to its parameters)."""

    def __init__(self, w, math, batch, seq, kv_seq):
        self.math = math
        self.symbolic = True
        self.batch, self.seq, self.kv_seq = batch, seq, kv_seq
        self.mask, self.score_mod = w.mask, w.score_mod
        self.tables = [(v, tirx.decl_buffer(b.shape, "float32", name=b.name))
                       for v, b in score_table_buffers(self.score_mod)]
        self.table_batch = self.table_heads = 1
        self.lengths, self.skip_by_length = bool(w.key_padding), False
        self.starts = (tirx.decl_buffer((batch,), "int32", name="kv_starts")
                       if w.key_padding else None)

    def visible(self, b, h, qi, kj, lens=None, kv_len=None):
        cond = super().visible(b, h, qi, kj, lens, kv_len)
        return cond if self.starts is None else tirx.all(cond, kj >= self.starts[b])


def core_params(w, cfg, registers, flush, rules, scalars) -> CoreParams:
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
        zero=f32(0.0), flush=flush, KV=KV, DT=w.dtype, padding=bool(w.key_padding))


def build_core(w, cfg, registers=16, flush=False):
    """The core PrimFunc: (q, [kv_lens,] k, v, part_o, part_ml, out, [kv_starts,] [score
    tables,] batch, seq, kv_seq)."""
    scalars = tuple(tirx.Var(n, "int32") for n in ("batch", "seq", "kv_seq"))
    rules = CoreScoreRules(w, SCORE_MATH, scalars[0], 1 if w.step else scalars[1], scalars[2])
    prm = core_params(w, cfg, registers, flush, rules, scalars)
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
            for worker in T.parallel(C):
                worker_task(q, kv_lens, k, v, part_o, part_ml, worker)
            for tile in T.parallel(NG):
                merge_tile(kv_lens, part_o, part_ml, out, tile)
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
            worker_task(q, q, k, v, part_o, part_ml, worker)
        for tile in T.parallel(NG):
            merge_tile(q, part_o, part_ml, out, tile)
    return attention


__all__ = ["CoreRule", "build_core", "core_rule"]
