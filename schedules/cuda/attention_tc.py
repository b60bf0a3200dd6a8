"""Fused attention for float16 layers on tensor cores (WMMA 16x16x16, fp32 accumulation).

The same algorithm, block table, signature and thread layout as the float32 template
(schedules/cuda/attention.py: one block per (batch, head, query tile), q_tile / 4 x 8 threads,
a thread owning 4 query rows and every 8th column of them), with both products on tensor
cores. Warp w owns query rows [16 w, 16 w + 16) -- the rows its threads own -- so each warp
multiplies its own strip:
    S = Q K^T    Q and K tiles float16 in shared memory (Q unscaled: the scale is applied to
                 the fp32 scores, scale * log2(e)), K read as a column-major B fragment;
                 S stored as float32 to shared memory;
    softmax      as the float32 template, on S from shared memory; P stored as float16;
    O += P V     a fragment per 16 columns, stored to the warp's rows of a float32 scratch
                 (as many columns as fit) and added by the threads into their O registers
                 (rescaled by the online softmax's alpha first): O never leaves registers.
Shared memory: the Q, K and V tiles (read by the tensor cores only) in one dynamic buffer;
S, P, the P V scratch and the row partials in static buffers of their own, at most 48 KiB
(TVM's sync planner treats all dynamic shared memory as one buffer, so the elementwise
softmax stays out of it). Together above 48 KiB, the kernel opts in (the launch table carries
both sizes, libmha.so sets the attribute) up to the GPU's limit. Float16 only: TVM's WMMA
codegen has no bfloat16 fragments, so bfloat16 layers keep the float32 template.

By stage: tc_layout (TcLayout, the typed record); product_macros (the K and V tiles into
shared memory, S = Q K^T and O += P V on tensor cores); key_block_macro (a key block: those
and the float32 template's mask, softmax and rescale, rows.py); body_macro (blocks, the Q
tile, the key blocks the table keeps, the write-out); build_attention_tc (the entry).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL
from mhagen.lower.te import LOG2E
from mhagen.schedules.attention_common import ScoreRules, attention_entry
from mhagen.schedules.cuda.rows import CT, RT, RowMacros, coordinates
from mhagen.schedules.cuda.nvcc import shared_limit

F = 16                 # the WMMA fragment: 16 x 16 x 16
HALF_PAD, FLOAT_PAD = 8, 4    # row padding of the tiles (bank conflicts; WMMA ldm rules)
STATIC_SHARED = 48 * 1024     # static shared memory per block, on every GPU

# (q_tile, kv_block), most work per block first
TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))


def threads(cfg) -> int:
    return cfg.q_tile // RT * CT


def dynamic_bytes(cfg, dp) -> int:
    """The Q, K and V tiles (float16), read by the tensor cores only."""
    return 2 * (cfg.q_tile + 2 * cfg.kv_block) * (dp + HALF_PAD)


def static_bytes(cfg, ow) -> int:
    """S (float32), P (float16), the P V scratch of ow columns (float32), row max and sum."""
    mq, kb = cfg.q_tile, cfg.kv_block
    return (4 * mq * (kb + FLOAT_PAD) + 2 * mq * (kb + HALF_PAD) + 4 * mq * (ow + FLOAT_PAD)
            + 8 * mq * (CT + 1))


def output_chunk(cfg, dp) -> int:
    """Columns of P V per pass through the scratch: the widest that fits static memory
    (whole fragments dividing dp), 0 if none."""
    fit = [ow for ow in range(dp, 0, -F) if dp % ow == 0 and static_bytes(cfg, ow)
           <= STATIC_SHARED]
    return fit[0] if fit else 0


def fits(cfg, workload, target) -> bool:
    """cfg (a CudaAttentionConfig) tiles by whole fragments and fits the shared memory."""
    dp = workload.head_dim_padded
    ow = output_chunk(cfg, dp) if dp % F == 0 else 0
    return (cfg.q_tile % F == 0 and cfg.kv_block % F == 0 and ow > 0
            and dynamic_bytes(cfg, dp) + static_bytes(cfg, ow) <= shared_limit(target))


@dataclass(frozen=True)
class TcLayout:
    """The tensor-core template's sizes in its TIR's short names."""
    B: int
    S: int
    H: int
    GROUP: int
    DP: int
    HD: int
    MQ: int              # queries a block
    KB: int              # keys a block of the online softmax
    NT: int              # threads a block
    SC: int              # scores a thread row
    OC: int              # output columns a thread row
    OW: int              # P V columns a pass through the scratch
    NQT: int
    NKB: int
    PW: int              # qkv is [NP, M, PW]; att [MA, HD]
    NP: int
    M: int
    MA: int
    Q_BASE: int
    K_BASE: int
    V_BASE: int
    TB: int
    TH: int
    Q_LOADS: int         # loads a thread of the Q tile, of a K or V tile
    KV_LOADS: int
    LDH: int             # row strides of the float16 tiles, S, P and the scratch
    LDS: int
    LDP: int
    LDO: int
    OQ: int              # the Q, K and V tiles in the dynamic float16 buffer
    OK: int
    OV: int
    c_log2e: object
    TEMP: str


def tc_layout(w, cfg) -> TcLayout:
    """The layout of workload w (typed, float16) under cfg."""
    B, S, H, G, d = w.batch, w.seq, w.heads, w.kv_heads, w.head_dim
    DP = w.head_dim_padded
    MQ, KB = cfg.q_tile, cfg.kv_block
    NT = threads(cfg)
    OW = output_chunk(cfg, DP)
    assert MQ % F == 0 and KB % F == 0 and DP % F == 0 and OW, (MQ, KB, DP)
    LDH = DP + HALF_PAD
    assert w.temp_dtype == "float16", w.temp_dtype
    return TcLayout(
        B=B, S=S, H=H, GROUP=H // G, DP=DP, HD=H * d, MQ=MQ, KB=KB, NT=NT, SC=KB // CT,
        OC=DP // CT, OW=OW, NQT=-(-S // MQ), NKB=-(-S // KB), PW=w.panel,
        NP=w.qkv_width // w.panel, M=w.rows, MA=w.att_rows, Q_BASE=w.q_base, K_BASE=w.k_base,
        V_BASE=w.v_base, TB=w.table_batch, TH=w.table_heads, Q_LOADS=-(-MQ * DP // NT),
        KV_LOADS=-(-KB * DP // NT), LDH=LDH, LDS=KB + FLOAT_PAD, LDP=KB + HALF_PAD,
        LDO=OW + FLOAT_PAD, OQ=0, OK=MQ * LDH, OV=(MQ + KB) * LDH,
        c_log2e=T.float32(w.scale * LOG2E), TEMP=w.temp_dtype)


def build_attention_tc(w, cfg):
    """The float16 attention PrimFunc for workload w on tensor cores."""
    k = tc_layout(w, cfg)
    rules = ScoreRules(w)
    row = RowMacros(w, rules, k.SC, k.OC)
    return attention_entry(body_macro(k, rules, row), rules, (k.NP, k.M, k.PW),
                           (k.TB, k.TH, k.NQT, k.NKB), k.B, (k.MA, k.HD), dtype=k.TEMP)


def product_macros(k, rules):
    """(load_keys_values, scores, values): the tensor-core stages of a key block, for
    layout k (TcLayout) and the workload's ScoreRules.
      load_keys_values  the block's K and V rows into the dynamic shared buffer
      scores            S = Q K^T for the warp's 16 rows, stored float32 to shared memory
      values            O += P V, OW columns a pass through the scratch into registers"""
    key_row = rules.key_row
    KV_LOADS, NT, KB, DP, LDH, OK, OV, OQ = (k.KV_LOADS, k.NT, k.KB, k.DP, k.LDH, k.OK, k.OV,
                                             k.OQ)
    K_BASE, V_BASE, PW, LDS, LDP, LDO, OW = k.K_BASE, k.V_BASE, k.PW, k.LDS, k.LDP, k.LDO, k.OW

    @T.macro
    def load_keys_values(masked, qkv, hv, b, g, k0, tid):
        for it in range(KV_LOADS):
            if it * NT + tid < KB * DP:
                hv[OK + (it * NT + tid) // DP * LDH + (it * NT + tid) % DP] = qkv[
                    (K_BASE + g * DP + (it * NT + tid) % DP) // PW,
                    key_row(b, k0 + (it * NT + tid) // DP, masked),
                    (K_BASE + g * DP + (it * NT + tid) % DP) % PW]
                hv[OV + (it * NT + tid) // DP * LDH + (it * NT + tid) % DP] = qkv[
                    (V_BASE + g * DP + (it * NT + tid) % DP) // PW,
                    key_row(b, k0 + (it * NT + tid) // DP, masked),
                    (V_BASE + g * DP + (it * NT + tid) % DP) % PW]

    @T.macro
    def scores(hv, s_f, qa, kbf, sacc, warp):
        # S = Q K^T for the warp's 16 rows (KB / 16 accumulators), to shared memory
        for j in T.unroll(KB // F):
            T.tvm_fill_fragment(sacc.data, F, F, F, j, T.float32(0))
        for c in range(DP // F):
            T.tvm_load_matrix_sync(qa.data, F, F, F, 0, hv.access_ptr(
                "r", offset=OQ + warp * F * LDH + c * F, extent=(F - 1) * LDH + F), LDH,
                "row_major")
            for j in T.unroll(KB // F):
                T.tvm_load_matrix_sync(kbf.data, F, F, F, 0, hv.access_ptr(
                    "r", offset=OK + j * F * LDH + c * F, extent=(F - 1) * LDH + F), LDH,
                    "col_major")
                T.tvm_mma_sync(sacc.data, j, qa.data, 0, kbf.data, 0, sacc.data, j)
        for j in T.unroll(KB // F):
            T.tvm_store_matrix_sync(sacc.data, F, F, F, j, s_f.access_ptr(
                "w", offset=warp * F * LDS + j * F, extent=(F - 1) * LDS + F), LDS,
                "row_major")

    @T.macro
    def values(hv, p_h, o_f, pa, vbf, oacc, acc_o, warp, row_group, lane_col):
        # O += P V, OW columns at a time: the warp's rows through the scratch o_f
        for oc in T.unroll(DP // OW):
            for f in T.unroll(OW // F):
                T.tvm_fill_fragment(oacc.data, F, F, F, 0, T.float32(0))
                for kk in T.unroll(KB // F):
                    T.tvm_load_matrix_sync(pa.data, F, F, F, 0, p_h.access_ptr(
                        "r", offset=warp * F * LDP + kk * F, extent=(F - 1) * LDP + F), LDP,
                        "row_major")
                    T.tvm_load_matrix_sync(vbf.data, F, F, F, 0, hv.access_ptr(
                        "r", offset=OV + kk * F * LDH + oc * OW + f * F,
                        extent=(F - 1) * LDH + F), LDH, "row_major")
                    T.tvm_mma_sync(oacc.data, 0, pa.data, 0, vbf.data, 0, oacc.data, 0)
                T.tvm_store_matrix_sync(oacc.data, F, F, F, 0, o_f.access_ptr(
                    "w", offset=warp * F * LDO + f * F, extent=(F - 1) * LDO + F), LDO,
                    "row_major")
            T.tvm_storage_sync("shared")
            for i in T.unroll(RT):
                for j in T.unroll(OW // CT):
                    acc_o[i, oc * (OW // CT) + j] = acc_o[i, oc * (OW // CT) + j] + o_f[
                        row_group * RT + i, lane_col + CT * j]
            T.tvm_storage_sync("shared")

    return load_keys_values, scores, values


def key_block_macro(k, rules, row):
    """key_block for layout k, the workload's ScoreRules and the RowMacros: K and V into
    shared memory, S on tensor cores, the float32 template's mask, softmax and rescale on
    it (rows.py), P V on tensor cores."""
    load_keys_values, scores, values = product_macros(k, rules)
    SC, c_log2e = k.SC, k.c_log2e

    @T.macro
    def key_block(masked, qkv, lens, hv, s_f, p_h, o_f, max_s, sum_s, qa, kbf, pa, vbf, sacc,
                  oacc, acc_s, acc_o, st, red, b, h, g, q0, k0, tid, warp, row_group,
                  lane_col):
        load_keys_values(masked, qkv, hv, b, g, k0, tid)
        T.tvm_storage_sync("shared")
        scores(hv, s_f, qa, kbf, sacc, warp)
        T.tvm_storage_sync("shared")
        # from here as the float32 template, on the scores in log2 units in registers
        for i in T.unroll(RT):
            for j in T.unroll(SC):
                acc_s[i, j] = s_f[row_group * RT + i, lane_col + CT * j] * c_log2e
        row.mask_and_max(masked, acc_s, red, max_s, lens, b, h, q0, k0, row_group, lane_col)
        T.tvm_storage_sync("shared")
        row.exponentiate(masked, acc_s, st, red, max_s, sum_s, p_h, row_group, lane_col)
        T.tvm_storage_sync("shared")
        row.rescale(st, red, sum_s, acc_o, row_group)
        values(hv, p_h, o_f, pa, vbf, oacc, acc_o, warp, row_group, lane_col)

    return key_block


def body_macro(k, rules, row):
    """The kernel's body(qkv, kv, blocks, lens, out): one block per (batch row, head, query
    tile), the Q tile loaded once, then the key blocks the block table keeps."""
    key_block = key_block_macro(k, rules, row)
    tb, th = rules.tb, rules.th
    B, H, NQT, NKB, NT, MQ, KB, LDH, LDS, LDP, LDO = (k.B, k.H, k.NQT, k.NKB, k.NT, k.MQ, k.KB,
                                                      k.LDH, k.LDS, k.LDP, k.LDO)
    SC, OC, GROUP, Q_LOADS, DP, OQ, Q_BASE, PW, S = (k.SC, k.OC, k.GROUP, k.Q_LOADS, k.DP,
                                                     k.OQ, k.Q_BASE, k.PW, k.S)

    @T.macro
    def body(qkv, kv, blocks, lens, out):   # kv: qkv itself (no cross-attention on CUDA)
        bx = T.launch_thread("blockIdx.x", B * H * NQT)
        tid = T.launch_thread("threadIdx.x", NT)
        hv = T.decl_buffer(((MQ + 2 * KB) * LDH,), "float16", scope="shared.dyn")
        s_f = T.decl_buffer((MQ, LDS), "float32", scope="shared")
        p_h = T.decl_buffer((MQ, LDP), "float16", scope="shared")
        o_f = T.decl_buffer((MQ, LDO), "float32", scope="shared")
        max_s = T.decl_buffer((MQ, CT + 1), "float32", scope="shared")
        sum_s = T.decl_buffer((MQ, CT + 1), "float32", scope="shared")
        qa = T.decl_buffer((F, F), "float16", scope="wmma.matrix_a")
        pa = T.decl_buffer((F, F), "float16", scope="wmma.matrix_a")
        kbf = T.decl_buffer((F, F), "float16", scope="wmma.matrix_b")
        vbf = T.decl_buffer((F, F), "float16", scope="wmma.matrix_b")
        sacc = T.decl_buffer((F, KB), "float32", scope="wmma.accumulator")
        oacc = T.decl_buffer((F, F), "float32", scope="wmma.accumulator")
        acc_s = T.decl_buffer((RT, SC), "float32", scope="local")
        acc_o = T.decl_buffer((RT, OC), "float32", scope="local")
        st = T.decl_buffer((4, RT), "float32", scope="local")
        red = T.decl_buffer((1,), "float32", scope="local")
        b, h, qt, g, q0, row_group, lane_col = T.meta_var(
            coordinates(bx, tid, H, NQT, GROUP, MQ))
        warp = T.meta_var(tid // 32)
        for it in range(Q_LOADS):
            if it * NT + tid < MQ * DP:
                hv[OQ + (it * NT + tid) // DP * LDH + (it * NT + tid) % DP] = qkv[
                    (Q_BASE + h * DP + (it * NT + tid) % DP) // PW,
                    b * S + T.min(q0 + (it * NT + tid) // DP, S - 1),
                    (Q_BASE + h * DP + (it * NT + tid) % DP) % PW]
        row.start(st, acc_o)
        T.tvm_storage_sync("shared")
        for kb in range(NKB):
            state = T.meta_var(rules.block_state(blocks[tb(b), th(h), qt, kb], lens, b,
                                                 kb * KB, KB))
            if state == FULL:
                key_block(False, qkv, lens, hv, s_f, p_h, o_f, max_s, sum_s, qa, kbf, pa, vbf,
                          sacc, oacc, acc_s, acc_o, st, red, b, h, g, q0, kb * KB, tid, warp,
                          row_group, lane_col)
            elif state == PARTIAL:
                key_block(True, qkv, lens, hv, s_f, p_h, o_f, max_s, sum_s, qa, kbf, pa, vbf,
                          sacc, oacc, acc_s, acc_o, st, red, b, h, g, q0, kb * KB, tid, warp,
                          row_group, lane_col)
        row.write_out(out, st, red, acc_o, b, h, q0, row_group, lane_col)

    return body
