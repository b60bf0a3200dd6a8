"""AVX-512 BF16 dot products for bfloat16 layers (`vdpbf16ps`): the GEMMs and the attention.

`vdpbf16ps acc, a, b` adds a[2i] * b[2i] + a[2i + 1] * b[2i + 1] to the float32 lane acc[i]:
one instruction does the work of two float32 FMAs. A GEMM uses it on pairs of its depth
(k = 2 * k2 + p): the weights are packed as wp[n // nr, k2, n % nr, p] (a column's two
rows of one pair side by side) and A's rows as a_p[m // t, k2, m % t, p] (the pack stage),
both in bfloat16 memory. One tensor intrinsic covers 16 output columns of one row over one
pair:
    C[i] += A[p] * B[i, p]          i < 16, p < 2
Its code is one instruction: `vdpbf16ps c, b, [a]{1to16}` (B's 16 pairs, 64 bytes, as one
register; A's pair broadcast from memory by the instruction itself). The attention template
(x86/attention.py) calls the same dot product on pairs of head columns (S = Q K^T) and of
keys (P V), with ZIP (two rows of V interleaved into pairs) and PACK (two rows of P rounded
to bfloat16 and interleaved).

How TVM reaches the instruction: TVM 0.27 has no LLVM `bfloat` type (its bfloat16 is
legalised to uint16; a bfloat16 vector reaching the LLVM code generator crashes it) while
the intrinsic takes `<32 x bfloat>`. So the kernels load bfloat16 pairs as 32-bit integers,
through int32 views of the same memory (same data pointer: TVM's aliasing information still
holds), and call small LLVM IR functions (HELPERS: bitcast to bfloat, call the intrinsic)
that TVM links into the kernel (`pragma_import_llvm`; TVM marks imported functions
always-inline, so each call is one instruction). The earlier way, float32 operands narrowed
in registers by `vcvtne2ps2bf16` (the one intrinsic that hands TVM a bfloat vector), spent a
conversion per B vector and per A broadcast (benchmarks/PERFORMANCE.md, Schedule decisions).
"""
import tvm
from tvm import tirx
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from mhagen.schedules.tvmscript import cheap_stack

INTRIN = "mhagen_x86_bf16_dot_16x2"
LANES = 16
DOT = "mhagen_bf16_dot_16x2"
IMPORT = "pragma_import_llvm"   # an attribute: TVM links HELPERS' LLVM IR into the kernel

ZIP = "mhagen_bf16_zip_16"     # (row a, row b), 16 bfloat16 each -> 16 (a[i], b[i]) pairs
PACK = "mhagen_bf16_pack_16"   # (float32 a, b) x 16 -> 16 (bf16(a[i]), bf16(b[i])) pairs
HELPERS = f"""
define <16 x float> @{DOT}(<16 x float> %c, <16 x i32> %a, <16 x i32> %b) {{
  %x = bitcast <16 x i32> %a to <32 x bfloat>
  %y = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %c, <32 x bfloat> %y,
                                                            <32 x bfloat> %x)
  ret <16 x float> %r
}}
define <16 x i32> @{ZIP}(<8 x i32> %a, <8 x i32> %b) {{
  %x = bitcast <8 x i32> %a to <16 x i16>
  %y = bitcast <8 x i32> %b to <16 x i16>
  %z = shufflevector <16 x i16> %x, <16 x i16> %y, <32 x i32> <INTERLEAVE>
  %r = bitcast <32 x i16> %z to <16 x i32>
  ret <16 x i32> %r
}}
define <16 x i32> @{PACK}(<16 x float> %a, <16 x float> %b) {{
  %h = call <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float> %b,
                                                                 <16 x float> %a)
  %z = shufflevector <32 x bfloat> %h, <32 x bfloat> poison, <32 x i32> <INTERLEAVE>
  %r = bitcast <32 x bfloat> %z to <16 x i32>
  ret <16 x i32> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>,
                                                        <32 x bfloat>)
declare <32 x bfloat> @llvm.x86.avx512bf16.cvtne2ps2bf16.512(<16 x float>, <16 x float>)
""".replace("<INTERLEAVE>", "<" + ", ".join(f"i32 {i // 2 + 16 * (i % 2)}"
                                            for i in range(32)) + ">")


with cheap_stack():   # parsed at import: slow with TVM's own stack lookups (tvmscript.py)
    @T.prim_func(s_tir=True)
    def _desc(A: T.Buffer((2,), "bfloat16", offset_factor=2),
              B: T.Buffer((16, 2), "bfloat16", offset_factor=2),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            for i, p in T.grid(16, 2):
                with T.sblock("update"):
                    vi, vp = T.axis.remap("SR", [i, p])
                    C[vi] = C[vi] + T.Cast("float32", A[vp]) * T.Cast("float32", B[vi, vp])


    @T.prim_func(s_tir=True)
    def _impl(A: T.Buffer((2,), "bfloat16", offset_factor=2),
              B: T.Buffer((16, 2), "bfloat16", offset_factor=2),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            # the pairs as 32-bit words: views of the same memory (TVM's aliasing info holds)
            a = T.decl_buffer((1,), "int32", data=A.data, elem_offset=A.elem_offset // 2)
            b = T.decl_buffer((16,), "int32", data=B.data, elem_offset=B.elem_offset // 2)
            C[T.ramp(T.int32(0), 1, 16)] = T.call_pure_extern(
                "float32x16", DOT, C.vload([0], "float32x16"), T.broadcast(a[0], 16),
                b.vload([0], "int32x16"))


TensorIntrin.register(INTRIN, _desc, _impl, override=True)


def with_llvm_ir(func, ir: str):
    """A template's PrimFunc with LLVM IR functions (HELPERS here, denormals.HELPERS) linked
    into its kernel (IMPORT; TVM makes them always-inline); `ir` empty: func as it is."""
    if not ir:
        return func
    return func.with_body(tirx.AttrStmt(tirx.const(0, "int32"), IMPORT, tvm.ir.StringImm(ir),
                                        func.body))


# CPUs (LLVM's names) whose vdpbf16ps does more multiply-adds a cycle than the float32 FMA,
# so pairs pay (benchmarks/register_tiles.c times the 8 x 32 tiles of both; the measurements:
# benchmarks/PERFORMANCE.md, Schedule decisions). Zen 4 runs a 512-bit FMA as two 256-bit
# halves. Not the Intel Xeon with AMX that LLVM calls `rocketlake` (Sapphire Rapids class:
# vdpbf16ps issues every other cycle, the FMA twice a cycle), nor unmeasured ones (Cooper
# Lake, Granite Rapids).
PAIRS_PAY = ("znver4", "znver5")


def bf16_pairs(target, dtype: str, depth: int) -> bool:
    """A GEMM of this depth in a layer of this storage dtype runs on vdpbf16ps pairs: a
    bfloat16 layer, 512-bit vectors, AVX-512 BF16 in the target's features, a CPU whose
    vdpbf16ps beats its FMA (PAIRS_PAY), an even depth."""
    return (dtype == "bfloat16" and target.lanes == LANES and depth % 2 == 0
            and "avx512bf16" in (target.features or ()) and target.cpu in PAIRS_PAY)
