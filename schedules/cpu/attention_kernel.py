"""The CPU attention template's main loop: the kernel around the stages (scores, mask,
softmax, values), one parallel task per (batch row, head, query tile), or for a packed call
of several sequences (mhagen/packed.py; ScoreRules.varlen) per (head, row of its tile
table: a query tile of one sequence, whose keys are that sequence's).

kernel_macros    the kernel's TVMScript macros for a kernel layout:
  key_block        one key block of the online softmax: S^T tiles (attention_scores.py), the
                   softmax (attention_softmax.py), V zipped on pairs and P V
                   (attention_values.py)
  transpose_values AMX: V^T of every (batch row, K/V head, 32 keys), once a call
  copy_queries     the task's Q^T (scaled, or unscaled pairs), through LN x LN transposes
  finish           out = O / l (0 for a row that saw no key); AMX: O^T back into rows
  run_task         one task: Q^T, the key blocks the block table keeps (FULL ones unmasked;
                   a PARTIAL one masked, cut where it runs past the last key), finish
  body             the kernel: V^T, then the tasks (a packed call's: their sequence's rows
                   and lengths bound from the tile table, its key loop ending at its last key)
"""
from __future__ import annotations

from tvm.script import tirx as T

from mhagen.blockmask import FULL, PARTIAL
from mhagen.schedules.attention_common import PackedSequence
from mhagen.schedules.x86 import amx, denormals
from mhagen.schedules.cpu.attention_scores import score_macros
from mhagen.schedules.cpu.attention_softmax import softmax_macros
from mhagen.schedules.cpu.attention_values import value_macros
from mhagen.schedules.x86.transpose import TRANSPOSE_16_I32, TRANSPOSE_32_I16

# register tiles: a stack array LLVM keeps in registers, not a TVM workspace allocation
ON_STACK = {"disable_lower_builtin": True}


def key_block_macro(k, rules):
    """key_block for layout k (KernelLayout) and the workload's ScoreRules."""
    s_tiles, online_softmax = score_macros(k, rules), softmax_macros(k)
    zip_values, add_values = value_macros(k, rules)
    KB, MR, MQ, PAIRS, AMX = k.KB, k.MR, k.MQ, k.PAIRS, k.AMX
    keys = rules.keys

    @T.macro
    def key_block(masked, cut, kv, vv, lens, q_t, s_buf, o_buf, m_buf, l_buf, m_new, alpha,
                  acc, acc_o, vec, b, h, g, q0, k0, kv32, q_t32, p32, v32, k_pad, vt):
        # kv: K's buffer, vv: V's (the same qkv or kv here; the attention core's are two).
        # masked: scores go through the mask (PARTIAL blocks). cut: the block runs past the
        # last key (masked too): its S^T tiles stop at the tile holding the last key (only
        # that tile clamps its key rows) and P V stops at the last key, so no loop pays for
        # the padding and the others keep the unclamped, affine key rows of full blocks.
        n_keys = T.min(KB, keys(b) - k0) if cut else KB         # keys that exist
        n_full = n_keys // MR if cut else KB // MR                # S^T tiles of such keys
        n_rows = (n_keys + MR - 1) // MR * MR if cut else KB     # s_buf rows written
        for i in T.vectorized(MQ):
            m_new[i] = m_buf[i]
        for jo in range(n_full):
            s_tiles(masked, False, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0, jo, kv32,
                    q_t32, k_pad)
        if cut:
            if n_keys % MR > 0:
                s_tiles(True, True, kv, lens, q_t, s_buf, m_new, acc, b, h, g, q0, k0,
                        n_full, kv32, q_t32, k_pad)
        n_pairs = (n_keys + 1) // 2
        # pairs of keys P V multiplies: the keys that exist, or on AMX tiles the block's
        # whole 32s (their depth; P is 0 past the last key)
        n_zipped = n_rows // 2 if AMX else n_pairs
        online_softmax(n_rows, n_zipped, s_buf, m_buf, l_buf, m_new, alpha, vec, p32)
        if PAIRS:
            zip_values(cut, n_zipped, kv32, v32, b, g, k0)
        add_values(n_keys, n_pairs, n_rows, vv, s_buf, o_buf, alpha, acc_o, b, g, k0, p32, v32,
                   vt)

    return key_block


def edge_macros(k, rules):
    """(transpose_values, copy_queries, finish) for layout k and the workload's ScoreRules."""
    return (transpose_values_macro(k, rules), copy_queries_macro(k, rules),
            finish_macro(k, rules))


def transpose_values_macro(k, rules):
    """transpose_values: AMX's V^T, once a call."""
    key_row = rules.key_row
    B, G, KV_LEN, NKT, DP, PW, V_BASE = k.B, k.G, k.KV_LEN, k.NKT, k.DP, k.PW, k.V_BASE

    @T.macro
    def transpose_values(kv, vt):
        for t in T.parallel(B * G * NKT):
            v_pad = T.decl_buffer((32, 32), "bfloat16")
            vb = t // (G * NKT)
            vg = t // NKT % G
            kt = t % NKT
            for cp in range(DP // 32):
                if kt * 32 + 32 <= KV_LEN:
                    T.evaluate(T.call_extern(
                        "int32", TRANSPOSE_32_I16, vt.data,
                        T.Cast("int64", t) * (DP * 32) + cp * 32 * 32, T.int64(64), kv.data,
                        T.Cast("int64", (V_BASE + vg * DP) // PW + cp)
                        * T.Cast("int64", kv.shape[1]) * PW
                        + T.Cast("int64", key_row(vb, kt * 32, False)) * PW, T.int64(PW * 2)))
                else:   # the last keys' rows clamped (P is 0 there)
                    for r in range(32):
                        for c in T.vectorized(32):
                            v_pad[r, c] = kv[(V_BASE + vg * DP) // PW + cp,
                                             key_row(vb, kt * 32 + r, True), c]
                    T.evaluate(T.call_extern(
                        "int32", TRANSPOSE_32_I16, vt.data,
                        T.Cast("int64", t) * (DP * 32) + cp * 32 * 32, T.int64(64),
                        v_pad.data, T.int64(0), T.int64(64)))

    return transpose_values


def copy_queries_macro(k, rules):
    """copy_queries: the task's Q^T (b: its batch row, or packed sequence)."""
    q_word = k.q_word
    queries, query_base = rules.queries, rules.query_base
    DP, PW, MQ, LN, NP, M, Q_BASE = k.DP, k.PW, k.MQ, k.LN, k.NP, k.M, k.Q_BASE
    QT_PAIRS, QT_SHUFFLE, QT_TRANSPOSE, QW, NW, NB = (k.QT_PAIRS, k.QT_SHUFFLE, k.QT_TRANSPOSE,
                                                      k.QW, k.NW, k.NB)
    c_log2e = k.c_log2e

    @T.macro
    def copy_queries(qkv, q_t, q_t32, b, h, q0):
        qkv32 = T.decl_buffer((NP, M, PW // 2), "int32", data=qkv.data)
        q_dst = T.meta_var(q_t32 if QT_PAIRS else q_t)   # words: pairs of bfloat16, or
        q_src = T.meta_var(qkv32 if QT_PAIRS else qkv)   # floats
        if QT_SHUFFLE:   # blocks of LN x LN words transposed in registers, scaled after
            for c16 in range(NB // LN):
                for i16 in range(MQ // LN):
                    if q0 + i16 * LN + LN <= queries(b):
                        T.evaluate(T.call_extern(
                            "int32", QT_TRANSPOSE, q_dst.data,
                            T.int64(c16 * LN * MQ + i16 * LN), T.int64(MQ * 4), q_src.data,
                            (T.Cast("int64", (Q_BASE + h * DP + c16 * LN * QW) // PW)
                             * T.Cast("int64", M)
                             + T.Cast("int64", query_base(b) + q0 + i16 * LN))
                            * (PW // QW) + (Q_BASE + h * DP + c16 * LN * QW) % PW // QW,
                            T.int64(PW // QW * 4)))
                    else:   # the last queries' rows clamped
                        for c in range(LN):
                            for i in T.vectorized(LN):
                                q_dst[c16 * LN + c, i16 * LN + i] = q_word(
                                    q_src, h, c16 * LN + c,
                                    query_base(b) + T.min(q0 + i16 * LN + i,
                                                          queries(b) - 1), False)
            if not QT_PAIRS:
                for c in range(NB):
                    for i in T.vectorized(MQ):
                        q_t[c, i] = q_t[c, i] * c_log2e
        if NW > NB:   # the words past the blocks (all of them without QT_SHUFFLE)
            for ct in range(NW - NB):
                for i in T.vectorized(MQ):
                    q_dst[NB + ct, i] = q_word(q_src, h, NB + ct,
                                               query_base(b)
                                               + T.min(q0 + i, queries(b) - 1), True)

    return copy_queries


def finish_macro(k, rules):
    """finish: out = O / l."""
    queries, query_base = rules.queries, rules.query_base
    d, DP, MQ, AMX, zero, out_value = k.d, k.DP, k.MQ, k.AMX, k.zero, k.out_value

    @T.macro
    def finish(o_buf, o_rows, l_buf, vec, out, b, h, q0):
        if AMX:   # O^T's rows of queries into rows of head columns
            for c16 in range(DP // 16):
                for q16 in range(MQ // 16):
                    T.evaluate(T.call_extern("int32", TRANSPOSE_16_I32, o_rows.data,
                                             q16 * 16 * DP + c16 * 16, T.int64(DP * 4),
                                             o_buf.data, c16 * 16 * MQ + q16 * 16,
                                             T.int64(MQ * 4)))
        o_final = T.meta_var(o_rows if AMX else o_buf)
        for i in range(MQ):
            if q0 + i < queries(b):
                vec[0, 0] = T.Select(l_buf[i] > zero, T.float32(1) / l_buf[i], zero)
                for j in range(d):
                    out[query_base(b) + q0 + i, h * d + j] = out_value(o_final[i, j]
                                                                       * vec[0, 0])

    return finish


def body_macro(k, rules):
    """The kernel's body(qkv, kv, blocks, lens, out) for layout k and the workload's
    ScoreRules (attention_common.attention_entry wraps it): one task per (batch row, head,
    query tile), or for packed sequences (rules.varlen) per (head, row of the tile table)."""
    run_task = task_macro(k, rules)
    transpose_values = transpose_values_macro(k, rules)
    B, H, NQ, PW, AMX, DP, NKT, G = k.B, k.H, k.NQ, k.PW, k.AMX, k.DP, k.NKT, k.G
    KB, VARLEN = k.KB, rules.varlen

    @T.macro
    def body(qkv, kv, blocks, lens, out):
        # int32 views of the bfloat16 pairs (used when PAIRS)
        kv32 = T.decl_buffer((kv.shape[0], kv.shape[1], PW // 2), "int32", data=kv.data)
        # AMX: V^T of every (batch row, K/V head, 32 keys), [B, G, NKT, DP, 32] (rows of 32
        # keys: A tiles of P V), transposed once a call here, not once a query tile
        vt = T.decl_buffer((B * G * NKT * DP * 32 if AMX else 1,), "bfloat16")
        if AMX:
            transpose_values(kv, vt)
        if VARLEN:
            # lens: the tile table (mhagen/packed.py). Head-major: a thread's run of tasks
            # is whole heads, or a head's tiles in the table's order (each sequence's in
            # query_tile_order)
            for task in T.parallel(H * lens.shape[0]):
                tile = task % lens.shape[0]
                q_start = T.Bind(lens[tile, 0])
                q_len = T.Bind(lens[tile, 1])
                k_start = T.Bind(lens[tile, 2])
                k_len = T.Bind(lens[tile, 3])
                seq = T.meta_var(PackedSequence(q_start, q_len, k_start, k_len))
                run_task(qkv, kv, blocks, None, out, kv32, vt, seq, task // lens.shape[0],
                         lens[tile, 4], (k_len + KB - 1) // KB)
        else:
            for task in T.parallel(B * H * NQ):
                b, h, qt = T.meta_var(task_tile(task, B, H, NQ, rules.lengths))
                run_task(qkv, kv, blocks, lens, out, kv32, vt, b, h, qt, k.NK)

    return body


def task_macro(k, rules):
    """run_task: one task of the kernel, query tile qt of batch row b (or a packed
    sequence) and head h, over its first n_blocks key blocks: Q^T, the key blocks the block
    table keeps (FULL ones unmasked; a PARTIAL one masked, cut where it runs past the last
    key), finish."""
    key_block = key_block_macro(k, rules)
    _, copy_queries, finish = edge_macros(k, rules)
    tb, th, keys = rules.tb, rules.th, rules.keys
    GROUP, d, DP, MQ, KB, MR, NR, OR, NV, LN = (k.GROUP, k.d, k.DP, k.MQ, k.KB, k.MR, k.NR,
                                                k.OR, k.NV, k.LN)
    O_SHAPE, CW, AMX, PAIRS, QT_PAIRS = k.O_SHAPE, k.CW, k.AMX, k.PAIRS, k.QT_PAIRS
    flush, neg_inf, zero = k.flush, k.neg_inf, k.zero

    @T.macro
    def run_task(qkv, kv, blocks, lens, out, kv32, vt, b, h, qt, n_blocks):
        csr = T.decl_buffer((1,), "int32")
        if flush:
            csr[0] = T.call_extern("int32", denormals.ENTER)
        if AMX:   # this thread's tile configuration, for this task (amx.py)
            T.evaluate(T.call_extern("int32", amx.CONFIG))
        q_t = T.decl_buffer((1 if QT_PAIRS else d, MQ), "float32")
        q_t32 = T.decl_buffer((d // 2 if QT_PAIRS else 1, MQ), "int32")
        k_pad = T.decl_buffer((d // CW if AMX else 1, MR if AMX else 1, CW if AMX else 1),
                              "bfloat16")
        p32 = T.decl_buffer((KB // 2 if QT_PAIRS else 1, MQ), "int32")
        v32 = T.decl_buffer((KB // 2 if PAIRS else 1, DP if PAIRS else 1), "int32")
        s_buf = T.decl_buffer((KB, MQ), "float32")
        o_buf = T.decl_buffer(O_SHAPE, "float32")     # O, or O^T on AMX tiles
        o_rows = T.decl_buffer((MQ if AMX else 1, DP if AMX else 1), "float32")
        m_buf = T.decl_buffer((MQ,), "float32")
        l_buf = T.decl_buffer((MQ,), "float32")
        m_new = T.decl_buffer((MQ,), "float32")
        alpha = T.decl_buffer((MQ,), "float32")
        acc = T.alloc_buffer((1 if AMX else MR, NR), "float32", scope="local",
                             annotations=ON_STACK)
        acc_o = T.alloc_buffer((OR, NV), "float32", scope="local", annotations=ON_STACK)
        vec = T.alloc_buffer((4, LN), "float32", scope="local", annotations=ON_STACK)
        g = h // GROUP
        q0 = qt * MQ
        copy_queries(qkv, q_t, q_t32, b, h, q0)
        for i in T.vectorized(MQ):
            m_buf[i] = neg_inf
            l_buf[i] = zero
        for i in range(O_SHAPE[0]):
            for j in T.vectorized(O_SHAPE[1]):
                o_buf[i, j] = zero
        for kb in range(n_blocks):
            state = rules.block_state(blocks[tb(b), th(h), qt, kb], lens, b, kb * KB, KB)
            if state == FULL:
                key_block(False, False, kv, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf, m_new,
                          alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32, q_t32,
                          p32, v32, k_pad, vt)
            elif state == PARTIAL:
                if kb * KB + KB <= keys(b):
                    key_block(True, False, kv, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf,
                              m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32,
                              q_t32, p32, v32, k_pad, vt)
                else:
                    key_block(True, True, kv, kv, lens, q_t, s_buf, o_buf, m_buf, l_buf,
                              m_new, alpha, acc, acc_o, vec, b, h, g, q0, kb * KB, kv32,
                              q_t32, p32, v32, k_pad, vt)
        finish(o_buf, o_rows, l_buf, vec, out, b, h, q0)
        if AMX:
            T.evaluate(T.call_extern("int32", amx.RELEASE))
        if flush:
            T.evaluate(T.call_extern("int32", denormals.EXIT, csr[0]))

    return run_task


def query_tile_order(i, n):
    """The query tile of a head's i-th task (of n): 0, n-1, 1, n-2, ... TVM hands each thread
    a run of consecutive tasks, and under a causal mask a later tile has more key blocks:
    paired light with heavy, runs of even length hold the same work (see
    benchmarks/PERFORMANCE.md, Schedule decisions). ints or TIR expressions."""
    odd = i % 2
    return odd * (n - 1) + (1 - 2 * odd) * (i // 2)


def task_tile(task, batch, heads, n_q, batch_inner):
    """(batch row, head, query tile) of parallel task `task`: tasks run by batch row, head,
    then query tile (in query_tile_order); with key lengths per call (batch_inner) by head,
    query tile, then batch row, so a thread's run of tasks holds every row's alike,
    whatever each row's length (see benchmarks/PERFORMANCE.md, Schedule decisions). ints or
    TIR expressions."""
    if batch_inner:
        b, rest = task % batch, task // batch
    else:
        b, rest = task // (heads * n_q), task % (heads * n_q)
    return b, rest // n_q, query_tile_order(rest % n_q, n_q)
