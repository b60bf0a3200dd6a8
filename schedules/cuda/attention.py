"""Fused attention template for CUDA GPUs (fp32, flash-style online softmax).

One thread block per (batch, head, query tile of q_tile rows); threads = q_tile / 4 x 8: a
thread owns 4 query rows and every 8th key (scores) or head column (output) of them. The
block stages its Q tile in shared memory, scaled by scale * log2(e). Then, for each key block
of kv_block keys that the block table does not skip:
    K (transposed) and V tiles -> shared memory, read where the QKV GEMM wrote them;
    S = Q K^T, 4 x kv_block/8 scores per thread in registers; partial blocks apply the mask
      (-inf) as they store S to shared memory;
    online softmax: the 8 threads of a row exchange their partial max through shared memory,
      each computes m' = max(m, S), alpha = 2^(m - m') (0 while the row saw no key),
      P = 2^(S - m') (to shared memory), then the partial sums: l = l alpha + sum P; the
      running m and l stay in registers (no thread-divergent branch: TVM's sync planner
      refuses barriers under conditions);
    O = O alpha + P V, 4 x head_dim/8 accumulators per thread in registers.
Finally out = O / l (a row that saw no key gives 0). Shared memory: Q, K^T, V, P tiles and
the partial max and sum (rows padded by one float against bank conflicts); the config keeps
it within the target's max_shared_memory_per_block. Same kernel signature and block table
(0 skip / 1 partial / 2 full) as the CPU template, so the program is target-neutral.

By stage: cuda_layout (CudaLayout, the typed record); key_block_macro (K^T and V into shared
memory, S, the mask, softmax and rescale of rows.py, P V); body_macro (blocks, the Q tile,
the key blocks the table keeps, the write-out); build_attention (the entry). float16 layers
run attention_tc.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL
from mhagen.lower.te import LOG2E
from mhagen.program import round_up
from mhagen.schedules.attention_common import ScoreRules, attention_entry
from mhagen.schedules.cuda import attention_tc
from mhagen.schedules.cuda.rows import CT, RT, RowMacros, coordinates

ROWS_PER_THREAD, COL_THREADS = RT, CT   # query rows a thread owns; threads across a row
FLOAT = 4


@dataclass(frozen=True)
class CudaAttentionConfig:
    q_tile: int
    """query rows per thread block (a multiple of 4; threads = q_tile / 4 x 8)."""
    kv_block: int
    """keys per shared-memory K/V tile (a multiple of 8)."""


def threads(cfg) -> int:
    return cfg.q_tile // ROWS_PER_THREAD * COL_THREADS


def shared_bytes(cfg, head_dim_padded) -> int:
    """Shared memory of one thread block: Q [q, dp+1], K^T [dp, kv+1], V [kv, dp],
    P [q, kv+1], and each thread's partial row max and sum [q, 8+1]."""
    mq, kb, dp = cfg.q_tile, cfg.kv_block, head_dim_padded
    return FLOAT * (mq * (dp + 1) + dp * (kb + 1) + kb * dp + mq * (kb + 1)
                    + 2 * mq * (COL_THREADS + 1))


def padded_head_dim(head_dim) -> int:
    """Columns per head in qkv: whole 16-column tensor-core fragments (the padding is zeros;
    a multiple of COL_THREADS too)."""
    return round_up(head_dim, 16)


# (q_tile, kv_block), most work per block first
TILES = ((64, 32), (64, 16), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8))


class CudaAttentionRule:
    name = "attention"

    def applies(self, stage, target):
        return stage.pattern == "attention_template"

    @staticmethod
    def tensor_cores(workload) -> bool:
        """float16 layers run schedules/cuda/attention_tc.py (WMMA)."""
        return workload.temp_dtype == "float16"

    def _fits(self, cfg, workload, target) -> bool:
        if self.tensor_cores(workload):
            return attention_tc.fits(cfg, workload, target)
        t = target.tvm_target_dict()
        return (shared_bytes(cfg, workload.head_dim_padded)
                <= t["max_shared_memory_per_block"]
                and threads(cfg) <= t["max_threads_per_block"])

    def candidates(self, workload, target) -> list:
        """Configs that fit the target's shared memory and threads, largest tiles first;
        tiles much longer than the sequence are left out (unless nothing else fits)."""
        tiles = attention_tc.TILES if self.tensor_cores(workload) else TILES
        fit = [CudaAttentionConfig(q, k) for q, k in tiles
               if self._fits(CudaAttentionConfig(q, k), workload, target)]
        short = [c for c in fit if c.q_tile <= round_up(workload.seq, 16)]
        return short or fit

    def default_config(self, workload, target):
        found = self.candidates(workload, target)
        if not found:
            raise ValueError(f"head_dim {workload.head_dim}: no attention tile fits "
                             f"{target.name}'s shared memory")
        return found[0]

    def make_config(self, values: dict, target, workload) -> CudaAttentionConfig:
        cfg = CudaAttentionConfig(int(values["q_tile"]), int(values["kv_block"]))
        if (cfg.q_tile < ROWS_PER_THREAD or cfg.q_tile % ROWS_PER_THREAD
                or cfg.kv_block < COL_THREADS or cfg.kv_block % COL_THREADS
                or not self._fits(cfg, workload, target)):   # threads, shared memory
            raise ValueError(f"{cfg} breaks the CUDA template's tiling constraints")
        return cfg

    def build(self, w, cfg, target):
        if self.tensor_cores(w):
            if not attention_tc.fits(cfg, w, target):
                raise ValueError(f"{cfg} does not tile the tensor-core template (multiples of "
                                 "16) or does not fit the shared memory")
            return attention_tc.build_attention_tc(w, cfg)
        return build_attention(w, cfg)


@dataclass(frozen=True)
class CudaLayout:
    """The float32 template's sizes in its TIR's short names."""
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
    NQT: int
    NKB: int
    PW: int              # qkv is [NP, M, PW] (columns / PW); att [MA, HD]
    NP: int
    M: int
    MA: int
    Q_BASE: int          # in columns
    K_BASE: int
    V_BASE: int
    TB: int
    TH: int
    Q_LOADS: int         # loads a thread of the Q tile, of a K or V tile
    KV_LOADS: int
    c_log2e: object
    zero: object
    TEMP: str            # qkv's and out's dtype (a half layer's: fp16/bf16)


def cuda_layout(w, cfg) -> CudaLayout:
    """The layout of workload w (typed) under cfg."""
    B, S, H, G, d = w.batch, w.seq, w.heads, w.kv_heads, w.head_dim
    DP = w.head_dim_padded
    MQ, KB = cfg.q_tile, cfg.kv_block
    NT = threads(cfg)
    assert MQ % RT == 0 and KB % CT == 0 and DP % CT == 0, (MQ, KB, DP)
    return CudaLayout(
        B=B, S=S, H=H, GROUP=H // G, DP=DP, HD=H * d, MQ=MQ, KB=KB, NT=NT, SC=KB // CT,
        OC=DP // CT, NQT=-(-S // MQ), NKB=-(-S // KB), PW=w.panel, NP=w.qkv_width // w.panel,
        M=w.rows, MA=w.att_rows, Q_BASE=w.q_base, K_BASE=w.k_base, V_BASE=w.v_base,
        TB=w.table_batch, TH=w.table_heads, Q_LOADS=-(-MQ * DP // NT),
        KV_LOADS=-(-KB * DP // NT), c_log2e=T.float32(w.scale * LOG2E), zero=T.float32(0.0),
        TEMP=w.temp_dtype)


def build_attention(w, cfg):
    """The attention PrimFunc for workload w (see mhagen/workloads.py for its fields)."""
    k = cuda_layout(w, cfg)
    rules = ScoreRules(w)
    row = RowMacros(w, rules, k.SC, k.OC)
    return attention_entry(body_macro(k, rules, row), rules, (k.NP, k.M, k.PW),
                           (k.TB, k.TH, k.NQT, k.NKB), k.B, (k.MA, k.HD), dtype=k.TEMP)


def key_block_macro(k, rules, row):
    """key_block for layout k (CudaLayout), the workload's ScoreRules and the RowMacros: K^T
    and V into shared memory, S = Q K^T in registers, the mask, softmax and rescale
    (rows.py), O += P V."""
    key_row = rules.key_row
    KV_LOADS, NT, KB, DP, SC, OC = k.KV_LOADS, k.NT, k.KB, k.DP, k.SC, k.OC
    K_BASE, V_BASE, PW, zero = k.K_BASE, k.V_BASE, k.PW, k.zero

    @T.macro
    def key_block(masked, qkv, lens, q_s, k_s, v_s, p_s, max_s, sum_s, acc_s, acc_o, st, red,
                  b, h, g, q0, k0, tid, row_group, lane_col):
        for it in range(KV_LOADS):
            if it * NT + tid < KB * DP:
                k_s[(it * NT + tid) % DP, (it * NT + tid) // DP] = T.Cast("float32", qkv[
                    (K_BASE + g * DP + (it * NT + tid) % DP) // PW,
                    key_row(b, k0 + (it * NT + tid) // DP, masked),
                    (K_BASE + g * DP + (it * NT + tid) % DP) % PW])
                v_s[(it * NT + tid) // DP, (it * NT + tid) % DP] = T.Cast("float32", qkv[
                    (V_BASE + g * DP + (it * NT + tid) % DP) // PW,
                    key_row(b, k0 + (it * NT + tid) // DP, masked),
                    (V_BASE + g * DP + (it * NT + tid) % DP) % PW])
        T.tvm_storage_sync("shared")
        # S = Q K^T in log2 units (a partial block masks it); each thread's max per row
        for i in T.unroll(RT):
            for j in T.unroll(SC):
                acc_s[i, j] = zero
        for c in range(DP):
            for i in T.unroll(RT):
                for j in T.unroll(SC):
                    acc_s[i, j] = acc_s[i, j] + q_s[row_group * RT + i, c] * k_s[c, lane_col + CT * j]
        row.mask_and_max(masked, acc_s, red, max_s, lens, b, h, q0, k0, row_group, lane_col)
        T.tvm_storage_sync("shared")
        row.exponentiate(masked, acc_s, st, red, max_s, sum_s, p_s, row_group, lane_col)
        T.tvm_storage_sync("shared")
        row.rescale(st, red, sum_s, acc_o, row_group)    # then O += P V
        for k in range(KB):
            for i in T.unroll(RT):
                for j in T.unroll(OC):
                    acc_o[i, j] = acc_o[i, j] + p_s[row_group * RT + i, k] * v_s[k, lane_col + CT * j]
        # the next key block overwrites K, V, P and the row partials
        T.tvm_storage_sync("shared")

    return key_block


def body_macro(k, rules, row):
    """The kernel's body(qkv, kv, blocks, lens, out): one block per (batch row, head, query
    tile), the Q tile loaded once (scaled to log2 units), then the key blocks the block
    table keeps."""
    key_block = key_block_macro(k, rules, row)
    tb, th = rules.tb, rules.th
    B, H, NQT, NKB, NT, MQ, KB, SC, OC, GROUP = (k.B, k.H, k.NQT, k.NKB, k.NT, k.MQ, k.KB, k.SC,
                                                 k.OC, k.GROUP)
    Q_LOADS, DP, Q_BASE, PW, S, c_log2e = k.Q_LOADS, k.DP, k.Q_BASE, k.PW, k.S, k.c_log2e

    @T.macro
    def body(qkv, kv, blocks, lens, out):   # kv: qkv itself (no cross-attention on CUDA)
        bx = T.launch_thread("blockIdx.x", B * H * NQT)
        tid = T.launch_thread("threadIdx.x", NT)
        q_s = T.decl_buffer((MQ, DP + 1), "float32", scope="shared")
        k_s = T.decl_buffer((DP, KB + 1), "float32", scope="shared")
        v_s = T.decl_buffer((KB, DP), "float32", scope="shared")
        p_s = T.decl_buffer((MQ, KB + 1), "float32", scope="shared")
        max_s = T.decl_buffer((MQ, CT + 1), "float32", scope="shared")
        sum_s = T.decl_buffer((MQ, CT + 1), "float32", scope="shared")
        acc_s = T.decl_buffer((RT, SC), "float32", scope="local")
        acc_o = T.decl_buffer((RT, OC), "float32", scope="local")
        st = T.decl_buffer((4, RT), "float32", scope="local")
        red = T.decl_buffer((1,), "float32", scope="local")
        b, h, qt, g, q0, row_group, lane_col = T.meta_var(
            coordinates(bx, tid, H, NQT, GROUP, MQ))
        for it in range(Q_LOADS):
            if it * NT + tid < MQ * DP:
                q_s[(it * NT + tid) // DP, (it * NT + tid) % DP] = T.Cast("float32", qkv[
                    (Q_BASE + h * DP + (it * NT + tid) % DP) // PW,
                    b * S + T.min(q0 + (it * NT + tid) // DP, S - 1),
                    (Q_BASE + h * DP + (it * NT + tid) % DP) % PW]) * c_log2e
        row.start(st, acc_o)
        T.tvm_storage_sync("shared")
        for kb in range(NKB):
            state = T.meta_var(rules.block_state(blocks[tb(b), th(h), qt, kb], lens, b,
                                                 kb * KB, KB))
            if state == FULL:
                key_block(False, qkv, lens, q_s, k_s, v_s, p_s, max_s, sum_s, acc_s, acc_o, st,
                          red, b, h, g, q0, kb * KB, tid, row_group, lane_col)
            elif state == PARTIAL:
                key_block(True, qkv, lens, q_s, k_s, v_s, p_s, max_s, sum_s, acc_s, acc_o, st,
                          red, b, h, g, q0, kb * KB, tid, row_group, lane_col)
        row.write_out(out, st, red, acc_o, b, h, q0, row_group, lane_col)

    return body
