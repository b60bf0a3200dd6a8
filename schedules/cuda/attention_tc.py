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
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL
from mhagen.lower.te import LOG2E
from mhagen.schedules.attention_common import ScoreRules, attention_entry
from mhagen.schedules.cuda.rows import CT, RT, RowMacros, coordinates
from mhagen.schedules.cuda.nvcc import shared_limit
from mhagen.workloads import AttentionWorkload, as_workload

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
    workload = as_workload(AttentionWorkload, workload)
    dp = workload.head_dim_padded
    ow = output_chunk(cfg, dp) if dp % F == 0 else 0
    return (cfg.q_tile % F == 0 and cfg.kv_block % F == 0 and ow > 0
            and dynamic_bytes(cfg, dp) + static_bytes(cfg, ow) <= shared_limit(target))


def build_attention_tc(w, cfg):
    """The float16 attention PrimFunc for workload w on tensor cores."""
    w = as_workload(AttentionWorkload, w)
    B, S, H, G, d = w.batch, w.seq, w.heads, w.kv_heads, w.head_dim
    DP = w.head_dim_padded
    MQ, KB = cfg.q_tile, cfg.kv_block
    NT = threads(cfg)
    SC, OC = KB // CT, DP // CT
    OW = output_chunk(cfg, DP)
    assert MQ % F == 0 and KB % F == 0 and DP % F == 0 and OW, (MQ, KB, DP)
    NQT, NKB = -(-S // MQ), -(-S // KB)
    GROUP = H // G
    PW, HD = w.panel, H * d
    NP = w.qkv_width // PW
    Q_BASE, K_BASE, V_BASE = w.q_base, w.k_base, w.v_base
    TB, TH = w.table_batch, w.table_heads
    M = w.rows
    MA = w.att_rows
    Q_LOADS, KV_LOADS = -(-MQ * DP // NT), -(-KB * DP // NT)
    LDH, LDS, LDP, LDO = DP + HALF_PAD, KB + FLOAT_PAD, KB + HALF_PAD, OW + FLOAT_PAD
    OQ, OK, OV = 0, MQ * LDH, (MQ + KB) * LDH      # in the dynamic float16 buffer
    c_log2e = T.float32(w.scale * LOG2E)
    TEMP = w.temp_dtype
    assert TEMP == "float16", TEMP

    rules = ScoreRules(w)
    key_row, tb, th = rules.key_row, rules.tb, rules.th
    row = RowMacros(w, rules, SC, OC)

    @T.macro
    def key_block(masked, qkv, lens, hv, s_f, p_h, o_f, max_s, sum_s, qa, kbf, pa, vbf, sacc,
                  oacc, acc_s, acc_o, st, red, b, h, g, q0, k0, tid, warp, row_group,
                  lane_col):
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
        T.tvm_storage_sync("shared")
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

    return attention_entry(body, rules, (NP, M, PW), (TB, TH, NQT, NKB), B, (MA, HD),
                           dtype=TEMP)
