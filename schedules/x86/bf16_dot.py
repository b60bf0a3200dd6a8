"""AVX-512 BF16 dot products for the GEMMs of bfloat16 layers (`vdpbf16ps`).

`vdpbf16ps acc, a, b` adds a[2i] * b[2i] + a[2i + 1] * b[2i + 1] to the float32 lane acc[i]:
one instruction does the work of two float32 FMAs. A GEMM uses it on pairs of its depth
(k = 2 * k2 + p): the weights are packed as wp[n // nr, k2, n % nr, p] (a column's two
rows of one pair side by side) and A's rows as a_p[m // t, k2, m % t, p] (the pack stage),
both in bfloat16 memory. One tensor intrinsic covers 16 output columns of one row over one
pair:
    C[i] += A[p] * B[i, p]          i < 16, p < 2
Its code is one instruction: `vdpbf16ps c, b, [a]{1to16}` (B's 16 pairs, 64 bytes, as one
register; A's pair broadcast from memory by the instruction itself). The attention's float32
output is rounded to bfloat16 by the output projection's pack stage, as a bfloat16 layer's
reference rounds every value.

How TVM reaches the instruction: TVM 0.27 has no LLVM `bfloat` type (its bfloat16 is
legalised to uint16; a bfloat16 vector reaching the LLVM code generator crashes it) while
the intrinsic takes `<32 x bfloat>`. So the intrinsic's body is a small LLVM IR function
(DOT_LLVM: load, bitcast to bfloat, call the intrinsic) that the kernel imports with TVM's
`pragma_import_llvm` (TVM marks imported functions always-inline) and calls as an extern
with the two operands' addresses. The earlier way, float32 operands narrowed in registers
by `vcvtne2ps2bf16` (the one intrinsic that hands TVM a bfloat vector), spent a conversion
per B vector and per A broadcast: 1.36x float32 on Zen 5, 1.05x on Zen 4.
"""
from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from mhagen.schedules.tvmscript import cheap_stack

INTRIN = "mhagen_x86_bf16_dot_16x2"
LANES = 16
DOT = "mhagen_bf16_dot_16x2"
IMPORT = "pragma_import_llvm"   # a loop annotation: TVM links this LLVM IR into the kernel

DOT_LLVM = f"""
define <16 x float> @{DOT}(<16 x float> %c, ptr %a0, i64 %ai, ptr %b0, i64 %bi) {{
  %a = getelementptr i16, ptr %a0, i64 %ai
  %b = getelementptr i16, ptr %b0, i64 %bi
  %a1 = load i32, ptr %a, align 4, !tbaa !0
  %a16 = insertelement <16 x i32> poison, i32 %a1, i64 0
  %ab = shufflevector <16 x i32> %a16, <16 x i32> poison, <16 x i32> zeroinitializer
  %bv = load <16 x i32>, ptr %b, align 4, !tbaa !0
  %x = bitcast <16 x i32> %ab to <32 x bfloat>
  %y = bitcast <16 x i32> %bv to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %c, <32 x bfloat> %y,
                                                            <32 x bfloat> %x)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>,
                                                        <32 x bfloat>)
!0 = !{{!1, !1, i64 0}}
!1 = !{{!"mhagen bf16 operands", !2, i64 0}}
!2 = !{{!"tvm-tbaa"}}
"""


with cheap_stack():   # parsed at import: 2.9 s with TVM's own stack lookups
    @T.prim_func(s_tir=True)
    def _desc(A: T.Buffer((2,), "bfloat16", offset_factor=1),
              B: T.Buffer((16, 2), "bfloat16", offset_factor=1),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            for i, p in T.grid(16, 2):
                with T.sblock("update"):
                    vi, vp = T.axis.remap("SR", [i, p])
                    C[vi] = C[vi] + T.Cast("float32", A[vp]) * T.Cast("float32", B[vi, vp])


    @T.prim_func(s_tir=True)
    def _impl(A: T.Buffer((2,), "bfloat16", offset_factor=1),
              B: T.Buffer((16, 2), "bfloat16", offset_factor=1),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            C[T.ramp(T.int32(0), 1, 16)] = T.call_pure_extern(
                "float32x16", DOT, C.vload([0], "float32x16"),
                A.data, T.Cast("int64", A.elem_offset), B.data, T.Cast("int64", B.elem_offset))


TensorIntrin.register(INTRIN, _desc, _impl, override=True)


def bf16_pairs(target, dtype: str, depth: int) -> bool:
    """A GEMM of this depth in a layer of this storage dtype runs on vdpbf16ps pairs: a
    bfloat16 layer, 512-bit vectors, AVX-512 BF16 in the target's features, an even depth."""
    return (dtype == "bfloat16" and target.lanes == LANES and depth % 2 == 0
            and "avx512bf16" in (target.features or ()))
