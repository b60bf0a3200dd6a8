"""Shared by the x86 class tests (test_target_resolution, test_gemm_tiles,
test_attention_tiles, test_x86_codegen, test_half): the two x86 presets, inputs, and
checks of the generated assembly (multiply-add loops, spills, accumulators in memory)."""
import dataclasses
import re

import numpy as np

import mhagen
from mhagen.target import resolve


PRESETS = ("x86-avx2", "x86-avx512")


def _input(b, s, d, seed=0):
    return np.random.default_rng(seed).standard_normal((b, s, d)).astype(np.float32)


RUNNABLE = [p for p in PRESETS if resolve(p).runs_here()]


def l2_of_1mib(preset):
    """The preset's target with a 1 MiB L2, whatever this host's: for tests whose shapes
    pick row blocks (half the L2) of a given size."""
    return dataclasses.replace(resolve(preset), l2_kib=1024)


def _attention_config(module):
    return next(k.config for k in module.program.kernels if k.name == "attention")


def multiply_add_loops(asm: str, op: str = "vfmadd") -> list:
    """The innermost multiply-add loops of an assembly listing: a label's instructions up to
    the jump back to it, with 4 or more `op` instructions."""
    blocks, name = {}, None
    for line in asm.splitlines():
        label = re.match(r"^(\.?[\w$.]+):", line)
        if label:
            name = label.group(1)
            blocks[name] = []
        elif name and line.startswith("\t") and not line.strip().startswith("."):
            blocks[name].append(line.strip())
    loops = []
    for name, ins in blocks.items():
        back = [k for k, i in enumerate(ins) if i.startswith("j") and i.split()[-1] == name]
        if back and sum(op in i for i in ins[:back[-1] + 1]) >= 4:
            loops.append(ins[:back[-1] + 1])
    return loops


def _multiplies_broadcast_data(body) -> bool:
    """A register tile's loop: it broadcasts data (a vbroadcast or an embedded {1toN} from
    anywhere but a constant pool). A softmax loop's multiply-adds (the exp polynomial) only
    broadcast constants; LLVM may unroll one over a short key block's rows and spill there,
    which the register tiles' sizes have nothing to do with."""
    return any(("broadcast" in i or "{1to" in i) and "(%rip)" not in i for i in body)


def spills_in_fma_loops(asm: str, op: str = "vfmadd") -> list:
    """Stack slots that an innermost register-tile loop (multiply-adds of broadcast data)
    both stores a vector register to and reads back: register spills (TVM prints assembly
    without LLVM's "Spill" comments). The task buffers that live on the stack (scores, Q^T)
    are only read in those loops, never stored and reloaded."""
    store = re.compile(r"vmov\w+\s+%[xyz]mm\d+, (-?\w*\(%rsp\))")
    found = []
    for body in filter(_multiplies_broadcast_data, multiply_add_loops(asm, op)):
        stored = {m.group(1) for m in map(store.match, body) if m}
        loaded = {slot for i in body if not store.match(i)
                  for slot in re.findall(r"(-?\w*\(%rsp\))", i)}
        found += sorted(stored & loaded)
    return found


def function_asm(asm: str, name: str) -> str:
    """A function's assembly with the parallel lambdas LLVM places after it (up to the next
    global label)."""
    lines = asm.splitlines()
    start = lines.index(name + ":")
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"^[A-Za-z_][\w$]*:", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def whole_tile_loops(m, kernel) -> list:
    """The loops of a GEMM kernel that run a whole register tile's multiply-adds in one
    basic block (tile_rows x tile_cols / lanes of them): a guard on the tile's rows would
    split them into a block per row."""
    from mhagen.schedules.cpu.matmul import packed_tile
    rows, cols = packed_tile(m.target)
    fmas = rows * cols // m.target.lanes
    body = function_asm(m.inspect("source"), kernel + "_compute_")
    return [b for b in filter(_multiplies_broadcast_data, multiply_add_loops(body))
            if sum("vfmadd" in i for i in b) == fmas]


def _asm_of(layer, preset, seq, tuning=None):
    return mhagen.build(layer, preset, batch=1, seq_len=seq, tuning=tuning).inspect("source")


def accumulates_in_memory(asm: str) -> list:
    """Rows of vectors summed in memory: vector multiply-adds `vfmadd*ps OFF(BASE), a, b`
    followed, before b is written again, by `vmov* b, OFF(BASE)`, at 3 or more offsets of
    one BASE (a row of O, 3+ vectors for head_dim >= 48: each multiply-add waits on the
    last one's store). A single vector so updated (the softmax's running sum, once a key
    block) is not such a row."""
    lines = [line.strip() for line in asm.splitlines()]
    rows = {}
    for k, ins in enumerate(lines):
        fma = re.match(r"vfmadd\w+ps\s+(-?\w*)(\(%[\w,%]+\)), %[xyz]mm\d+, (%[xyz]mm\d+)$",
                       ins)
        if not fma:
            continue
        offset, base, reg = fma.groups()
        for nxt in lines[k + 1:k + 4]:
            if re.match(rf"vmov\w+\s+{re.escape(reg)}, {re.escape(offset + base)}$", nxt):
                rows.setdefault(base, set()).add(offset)
            if nxt.endswith(", " + reg):
                break
    return [f"{base} at {sorted(offsets)}" for base, offsets in rows.items()
            if len(offsets) >= 3]
