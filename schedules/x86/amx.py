"""AMX tiles for bfloat16 layers (Intel Sapphire Rapids and later: AMX-BF16): the GEMMs
and the attention's S^T = K Q^T and P V.

An AMX tile register holds 16 rows of 64 bytes; `tdpbf16ps c, a, b` adds to the 16 x 16
float32 tile c the product of a (16 rows x 32 bfloat16 of the depth) and b (16 pairs of the
depth x 16 columns, each column's pair side by side): 16,384 multiply-adds an instruction.
Every product here is a register tile of 32 x 32 float32: 4 C tiles, 2 of A, 2 of B, the 8
tile registers; per 32 of the depth, 4 tile loads and 4 tdpbf16ps. Small LLVM IR kernels
(HELPERS, linked into the kernels as bf16_dot's helpers are) run the whole depth in one
call, C in the tile registers until it is stored.
  GEMM (KERNEL)  C[i, j] += A[kt, i, k2, p] * B[32 kt + 2 k2 + p ...]: the weights keep the
                 pair GEMMs' panels (bf16_dot.py: wp[n // 32, k / 2, n % 32, p]; a B tile
                 is 16 of its pair rows, 128 bytes apart); A is packed as a_t[m // 32,
                 k // 32, m % 32, k % 32] (one A tile: 16 rows of 64 bytes, contiguous). C is
                 stored to the GEMM's "local" tile that the write-back (bias, rounding) reads.
  S^T (SCORES)   32 keys x 32 queries: K straight from a bfloat16 qkv (a panel's 32 columns
                 are one step), Q^T as the pair path's int32 pairs of head columns; stored
                 to the attention's score buffer, whose write-back masks it and takes the
                 running max (and scales it where a score modifier needs log2 units).
  P V (PV)       computed as O^T = V^T P^T, 32 head columns x 32 queries, accumulated into
                 the task's O^T: P^T's bfloat16 pairs of keys are B tiles just as the
                 softmax packs them (the pair path's PACK; P V as P times V would need P's
                 rows of keys, 16 x 16 transposes of every block of every task), V^T's rows
                 of 32 keys are A tiles, transposed once a call (TRANSPOSE_32_I16, the
                 attention kernel's first loop), not zipped into pairs once a query tile
                 (what each cost: benchmarks/PERFORMANCE.md, Schedule decisions).
Tile configuration (ldtilecfg) is per thread: each parallel task loads it at its start and
releases the tiles at its end (with_task_config for the GEMMs, CONFIG / RELEASE in the
attention's task), as oneDNN does per primitive run; loaded per tile it cost too much (see
benchmarks/PERFORMANCE.md, Schedule decisions). Linux hands AMX's 8 KiB of tile state to a
process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile
instruction is SIGILL): mhagen asks before it runs such code (mhagen.host.cannot_run_reason;
the C API's mha_create likewise).

Deep GEMMs run in blocks of the depth (gemm_depth_block). How fast the kernels run:
benchmarks/PERFORMANCE.md, Schedule decisions.
"""
import functools

from tvm import tirx
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from mhagen.schedules.tvmscript import cheap_stack, wrap_loop_bodies
from mhagen.schedules.x86.transpose import TRANSPOSE_16_I32, TRANSPOSE_32_I16, transpose

ROWS = COLS = 32     # a register tile of C: 2 x 2 AMX tiles of 16 x 16 float32
DEPTH = 32           # the depth one tdpbf16ps covers (16 pairs)
FEATURES = ("amx-tile", "amx-bf16")
TASK = "mhagen_amx_task"        # a loop annotation: its body is one task of AMX work
KERNEL = "mhagen_amx_tile_32x32"
KERNEL_ACC = "mhagen_amx_tile_32x32_acc"   # KERNEL adding to C (C's tiles loaded first)
CONFIG = "mhagen_amx_config"
RELEASE = "mhagen_amx_release"
# (S^T 32 keys x 32 queries float32, s_stride bytes a row) = K (32 rows, bfloat16, kstride
# bytes apart, kpanel bytes from one 32 of the depth to the next) x Q^T (int32 pairs of the
# depth, qstride bytes a row), over `steps` 32s of the depth: the attention's scores
SCORES = "mhagen_amx_scores_32x32"
# O^T (32 head columns x 32 queries float32, ostride bytes a row) += V^T (bfloat16 rows of
# 32 keys, 64 bytes apart, vstep bytes from one 32 keys to the next) x P^T (int32 pairs of
# keys, pstride bytes a row), `steps` 32s of keys
PV = "mhagen_amx_pv_32x32"

# ldtilecfg's 64 bytes: palette 1, then colsb (u16) of tiles 0-15 at byte 16, rows (u8) at
# byte 48: tiles 0-7 are 16 rows of 64 bytes
_CFG = (bytes([1]) + bytes(15) + b"".join((64).to_bytes(2, "little") for _ in range(8))
        + bytes(16) + bytes([16] * 8) + bytes(8))


def _tile_kernel(name, params, pointers, c_stride, a_step, a_stride, b_step, b_stride,
                 from_c=False):
    """LLVM IR of one 32 x 32 float32 tile product over %steps 32s of the depth: C's four
    16 x 16 tiles at %c (c_stride bytes a row) start at zero, or from C (from_c); a step
    loads A's two tiles at %a + s a_step (a_stride bytes a row, the second 16 rows down)
    and B's two at %b + s b_step (b_stride bytes a row, the second 64 bytes right), then
    runs the four tdpbf16ps; C's tiles are stored back at the end. pointers: the IR that
    defines %c, %a and %b (and any value the steps name) from the params."""
    c_at = ["%c", "%c1", "%c2", "%c3"]
    start = ([f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr {c_at[t]}, i64 {c_stride})"
              for t in range(4)] if from_c else
             [f"  call void @llvm.x86.tilezero(i8 {t})" for t in range(4)])
    return "\n".join(
        [f"define i32 @{name}({params}) {{", "entry:", pointers,
         f"  %cdown = mul i64 {c_stride}, 16", f"  %adown = mul i64 {a_stride}, 16",
         "  %c1 = getelementptr i8, ptr %c, i64 64",
         "  %c2 = getelementptr i8, ptr %c, i64 %cdown",
         "  %c3 = getelementptr i8, ptr %c2, i64 64", *start,
         "  br label %step", "step:",
         "  %s = phi i64 [0, %entry], [%next, %step]",
         f"  %ao = mul i64 %s, {a_step}", "  %a0 = getelementptr i8, ptr %a, i64 %ao",
         "  %a1 = getelementptr i8, ptr %a0, i64 %adown",
         f"  %bo = mul i64 %s, {b_step}", "  %b0 = getelementptr i8, ptr %b, i64 %bo",
         "  %b1 = getelementptr i8, ptr %b0, i64 64"]
        + [f"  call void @llvm.x86.tileloadd64(i8 {t}, ptr %{p}, i64 {stride})"
           for t, p, stride in ((4, "a0", a_stride), (5, "a1", a_stride),
                                (6, "b0", b_stride), (7, "b1", b_stride))]
        + [f"  call void @llvm.x86.tdpbf16ps(i8 {c}, i8 {a}, i8 {b})"
           for c, a, b in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7))]
        + ["  %next = add i64 %s, 1", "  %n = zext i32 %steps to i64",
           "  %done = icmp eq i64 %next, %n", "  br i1 %done, label %store, label %step",
           "store:"]
        + [f"  call void @llvm.x86.tilestored64(i8 {t}, ptr {c_at[t]}, i64 {c_stride})"
           for t in range(4)]
        + ["  ret i32 0", "}", ""])


_PALETTE = "".join(f"\\{b:02X}" for b in _CFG)   # LLVM's c"..." escapes
HELPERS = f"""
@mhagen_amx_palette = private unnamed_addr constant [64 x i8] c"{_PALETTE}", align 64
define i32 @{CONFIG}() {{
  call void @llvm.x86.ldtilecfg(ptr @mhagen_amx_palette)
  ret i32 0
}}
define i32 @{RELEASE}() {{
  call void @llvm.x86.tilerelease()
  ret i32 0
}}
""" + "".join(_tile_kernel(   # the GEMM's: A packed in tiles, B the weights' pair panel
    name, "ptr %cbase, i32 %coff, ptr %abase, i32 %aoff, ptr %bbase, i32 %boff, i32 %steps",
    "  %c = getelementptr float, ptr %cbase, i32 %coff\n"
    "  %a = getelementptr i16, ptr %abase, i32 %aoff\n"
    "  %b = getelementptr i16, ptr %bbase, i32 %boff", 128, 2048, 64, 2048, 128,
    from_c=name == KERNEL_ACC) for name in (KERNEL, KERNEL_ACC)) + _tile_kernel(
    SCORES, "ptr %sbase, i32 %soff, i64 %sstride, ptr %kbase, i64 %koff, i64 %kstride, "
    "i64 %kpanel, ptr %qbase, i32 %qoff, i64 %qstride, i32 %steps",
    "  %c = getelementptr float, ptr %sbase, i32 %soff\n"
    "  %a = getelementptr i16, ptr %kbase, i64 %koff\n"
    "  %b = getelementptr i32, ptr %qbase, i32 %qoff\n"
    "  %qstep = mul i64 %qstride, 16", "%sstride", "%kpanel", "%kstride", "%qstep",
    "%qstride") + _tile_kernel(
    PV, "ptr %obase, i32 %ooff, i64 %ostride, ptr %vbase, i64 %voff, i64 %vstep, "
    "ptr %pbase, i32 %poff, i64 %pstride, i32 %steps",
    "  %c = getelementptr float, ptr %obase, i32 %ooff\n"
    "  %a = getelementptr i16, ptr %vbase, i64 %voff\n"
    "  %b = getelementptr i32, ptr %pbase, i32 %poff\n"
    "  %pstep = mul i64 %pstride, 16", "%ostride", "%vstep", 64, "%pstep", "%pstride",
    from_c=True) + f"""
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8)
declare void @llvm.x86.tileloadd64(i8, ptr, i64)
declare void @llvm.x86.tdpbf16ps(i8, i8, i8)
declare void @llvm.x86.tilestored64(i8, ptr, i64)
""" + (transpose(TRANSPOSE_16_I32, 16, "i32", "i32")
       + transpose(TRANSPOSE_32_I16, 32, "i16", "i64"))


def amx_tiles(target, dtype: str, depth: int, attention: bool = False) -> bool:
    """A GEMM of this depth (attention: an attention of this head_dim) in a layer of this
    storage dtype runs on AMX tiles: a bfloat16 layer, AMX-TILE and AMX-BF16 in the
    target's features, a depth of whole 32s (one tdpbf16ps step; others convert on load,
    or take vdpbf16ps pairs where those pay), for a GEMM at least 64: TVM's tensorize does
    not match the intrinsic over one step (the random AMX layers found d_model 32), and a
    GEMM of depth 32 is little work."""
    feats = set(target.features or ())
    return (dtype == "bfloat16" and depth % DEPTH == 0 and (attention or depth > DEPTH)
            and all(f in feats for f in FEATURES))


@functools.lru_cache(maxsize=None)
def intrinsic(steps: int, accumulate: bool = False) -> str:
    """The tensor intrinsic of one 32 x 32 register tile over `steps` x 32 of the depth
    (registered once per depth): one call of KERNEL, or of KERNEL_ACC (accumulate). KERNEL
    starts its C tiles at zero (tilezero), not from C: where the GEMM rule tensorizes the
    whole depth right after the reduction's init, C holds zeros there (the init's 4 KiB
    store per tile stays: a small share of a tile's time); over blocks of the depth
    (gemm_depth_block) C holds the blocks before: KERNEL_ACC loads it."""
    name = f"mhagen_x86_amx_32x32x{steps * DEPTH}" + ("_acc" if accumulate else "")
    pairs = steps * DEPTH // 2   # B: the weight panel's pair rows (wp[n // 32, k2, n % 32, p])
    shapes = dict(a=(steps, ROWS, DEPTH // 2, 2), b=(pairs, COLS, 2))
    with cheap_stack():
        @T.prim_func(s_tir=True)
        def desc(A: T.Buffer(shapes["a"], "bfloat16", offset_factor=1),
                 B: T.Buffer(shapes["b"], "bfloat16", offset_factor=1),
                 C: T.Buffer((ROWS, COLS), "float32", offset_factor=1, scope="local")) -> None:
            with T.sblock("root"):
                T.reads(C[0:ROWS, 0:COLS], A[0:steps, 0:ROWS, 0:DEPTH // 2, 0:2],
                        B[0:pairs, 0:COLS, 0:2])
                T.writes(C[0:ROWS, 0:COLS])
                for i, j, kt, k2, p in T.grid(ROWS, COLS, steps, DEPTH // 2, 2):
                    with T.sblock("update"):
                        vi, vj, vkt, vk2, vp = T.axis.remap("SSRRR", [i, j, kt, k2, p])
                        C[vi, vj] = C[vi, vj] + (T.Cast("float32", A[vkt, vi, vk2, vp])
                                                 * T.Cast("float32", B[vkt * 16 + vk2, vj, vp]))

        @T.prim_func(s_tir=True)
        def impl(A: T.Buffer(shapes["a"], "bfloat16", offset_factor=1),
                 B: T.Buffer(shapes["b"], "bfloat16", offset_factor=1),
                 C: T.Buffer((ROWS, COLS), "float32", offset_factor=1, scope="local")) -> None:
            with T.sblock("root"):
                T.reads(C[0:ROWS, 0:COLS], A[0:steps, 0:ROWS, 0:DEPTH // 2, 0:2],
                        B[0:pairs, 0:COLS, 0:2])
                T.writes(C[0:ROWS, 0:COLS])
                # the buffers' data and element offsets: TVM's access_ptr of a bfloat16
                # buffer fails its dtype check after bfloat16 is legalised to uint16
                T.evaluate(T.call_extern("int32", KERNEL_ACC if accumulate else KERNEL, C.data,
                                         C.elem_offset, A.data, A.elem_offset, B.data,
                                         B.elem_offset, steps))
    TensorIntrin.register(name, desc, impl, override=True)
    return name


def gemm_depth_block(target, depth: int, symbolic: bool) -> int:
    """Steps of 32 a GEMM tile runs before the task's next row tile takes the same block of
    the weight panel (0: the whole depth at once). A tile reads its A rows from L2 and the
    panel (depth x 64 bytes) from L1 while the panel fits beside them (up to 2/3 of L1d);
    past that from L2 too, 4 KiB a step of 64 cycles of tdpbf16ps. Blocks of 256 of the
    depth keep a panel's block in L1 for the task's row tiles, which then accumulate in
    memory (C tiles loaded and stored once a block); 256 beat 128, and a panel within 2/3 of
    L1d is not blocked (benchmarks/PERFORMANCE.md, Schedule decisions). Symbolic builds
    keep the whole depth (their single row block would accumulate the call's every row)."""
    steps, block = depth // DEPTH, 8
    if symbolic or depth * 64 <= target.l1d_kib * 1024 * 2 // 3 or steps % block:
        return 0
    return block


def with_task_config(func):
    """func with every loop annotated TASK running ldtilecfg first and tilerelease last in
    each of its iterations (a parallel task), and HELPERS linked in; func unchanged when it
    has no such loop."""
    from mhagen.schedules.x86.bf16_dot import with_llvm_ir

    def call(name):
        return tirx.Evaluate(tirx.call_extern("int32", name))
    body = wrap_loop_bodies(func.body, TASK, lambda b: tirx.SeqStmt([call(CONFIG), b,
                                                                      call(RELEASE)]))
    return func if body is None else with_llvm_ir(func.with_body(body), HELPERS)
