"""RoPE in place on the fused path's qkv temporary (CUDA): see schedules/cpu/rotary.py.

One thread block per row (token) of batch * seq; each thread owns whole pairs
(x[i], x[i + rotary_dim/2]) of one Q or K head, so the in-place update needs no barrier;
neighbouring threads read neighbouring columns of a panel (coalesced).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from mhagen.program import round_up
from mhagen.schedules.cpu.rotary import rotary_layout


@dataclass(frozen=True)
class CudaRotaryConfig:
    threads: int
    """threads per block (a multiple of the 32-thread warp); each rotates pairs in turn."""


class CudaRotaryRule:
    name = "rotary"

    def applies(self, stage, target):
        return stage.pattern == "rotary_template"

    def default_config(self, workload, target):
        _, slots, _, _, half = rotary_layout(workload)
        return CudaRotaryConfig(threads=min(256, round_up(slots * half, 32)))

    def build(self, w, cfg, target):
        return build_rotary(w, cfg)


def build_rotary(w, cfg):
    B, S = w.batch, w.seq
    BASE, SLOTS, DP, RD, HALF = rotary_layout(w)
    PW = w.panel
    NP, M = w.qkv_width // PW, w.rows
    NT = cfg.threads
    PAIRS = SLOTS * HALF
    LOOPS = -(-PAIRS // NT)
    TEMP = w.temp_dtype   # qkv's dtype (a half layer's: fp16/bf16)

    @T.prim_func
    def rotary(qkv: T.Buffer((NP, M, PW), TEMP),
               rope: T.Buffer((2, S, HALF), "float32")):
        T.func_attr({"global_symbol": "rotary", "tirx.noalias": True})
        row = T.launch_thread("blockIdx.x", B * S)
        tid = T.launch_thread("threadIdx.x", NT)
        pair = T.decl_buffer((2,), "float32", scope="local")
        for it in range(LOOPS):
            if it * NT + tid < PAIRS:
                # pair p: head slot p // HALF, column i = p % HALF and its partner i + HALF
                pair[0] = T.Cast("float32", qkv[
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF) // PW, row,
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF) % PW])
                pair[1] = T.Cast("float32", qkv[
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF + HALF) // PW,
                    row,
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF + HALF) % PW])
                qkv[(BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF) // PW, row,
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF) % PW] = (
                    T.Cast(TEMP, pair[0] * rope[0, row % S, (it * NT + tid) % HALF]
                           - pair[1] * rope[1, row % S, (it * NT + tid) % HALF]))
                qkv[(BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF + HALF) // PW,
                    row,
                    (BASE + (it * NT + tid) // HALF * DP + (it * NT + tid) % HALF + HALF) % PW] = (
                    T.Cast(TEMP, pair[1] * rope[0, row % S, (it * NT + tid) % HALF]
                           + pair[0] * rope[1, row % S, (it * NT + tid) % HALF]))

    return rotary
