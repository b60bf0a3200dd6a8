"""AVX-512 BF16 dot products for the GEMMs of bfloat16 layers (`vdpbf16ps`).

`vdpbf16ps acc, a, b` adds a[2i] * b[2i] + a[2i + 1] * b[2i + 1] to the float32 lane acc[i]:
one instruction does the work of two float32 FMAs. A GEMM uses it on pairs of its depth
(k = 2 * k2 + p): the weights are packed as wp[n // nr, k2, n % nr, p] (a column's two
rows of one pair side by side) and A's rows as a_p[m // t, k2, m % t, p] (the pack stage).
One tensor intrinsic covers 16 output columns of one row over one pair:
    C[i] += A[p] * float32(B[i, p])          i < 16, p < 2
Its code: B's 32 bfloat16 (16 columns x 2) widened to float32 and narrowed back into one
register (`vcvtne2ps2bf16`, exact), A's pair broadcast to every lane and rounded to
bfloat16 the same way (exact for x, which is bfloat16 already; the output projection's
input, the attention's float32 output, is rounded to bfloat16 here, as a bfloat16 layer's
reference rounds every value).

Why the round trip through float32: TVM 0.27 has no LLVM `bfloat` type (its bfloat16 is
legalised to uint16, and a bfloat16 value reaching the LLVM code generator crashes it), and
the LLVM intrinsic takes `<32 x bfloat>`; `vcvtne2ps2bf16` is the one intrinsic that hands
such a vector to TVM's code. The conversions run beside the dot products: in a C
micro-benchmark on Zen 5 the 8 x 32 tile with them ran at 0.92x the speed of the same tile
fed by plain loads, 1.8x the float32 FMA tile.
"""
from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

INTRIN = "mhagen_x86_bf16_dot_16x2"
LANES = 16


@T.prim_func(s_tir=True)
def _desc(A: T.Buffer((2,), "float32", offset_factor=1),
          B: T.Buffer((16, 2), "bfloat16", offset_factor=1),
          C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:2], B[0:16, 0:2])
        T.writes(C[0:16])
        for i, p in T.grid(16, 2):
            with T.sblock("update"):
                vi, vp = T.axis.remap("SR", [i, p])
                C[vi] = C[vi] + A[vp] * T.cast(B[vi, vp], "float32")


@T.prim_func(s_tir=True)
def _impl(A: T.Buffer((2,), "float32", offset_factor=1),
          B: T.Buffer((16, 2), "bfloat16", offset_factor=1),
          C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:2], B[0:16, 0:2])
        T.writes(C[0:16])
        # A's pair in every 64-bit lane (vbroadcastsd)
        a = T.reinterpret("float32x16",
                          T.broadcast(T.reinterpret("float64", A.vload([0], "float32x2")), 8))
        lo = T.cast(B.vload([0, 0], "bfloat16x16"), "float32x16")   # columns 0-7
        hi = T.cast(B.vload([8, 0], "bfloat16x16"), "float32x16")   # columns 8-15
        C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
            "float32x16", "llvm.x86.avx512bf16.dpbf16ps.512", C.vload([0], "float32x16"),
            T.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512", a, a),
            T.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512",
                                    hi, lo))


TensorIntrin.register(INTRIN, _desc, _impl, override=True)


def bf16_pairs(target, dtype: str, depth: int) -> bool:
    """A GEMM of this depth in a layer of this storage dtype runs on vdpbf16ps pairs: a
    bfloat16 layer, 512-bit vectors, AVX-512 BF16 in the target's features, an even depth."""
    return (dtype == "bfloat16" and target.lanes == LANES and depth % 2 == 0
            and "avx512bf16" in (target.features or ()))
