"""AVX-512 BF16 dot products for the GEMMs of bfloat16 layers (`vdpbf16ps`).

`vdpbf16ps acc, a, b` adds a[2i] * b[2i] + a[2i + 1] * b[2i + 1] to the float32 lane acc[i]:
one instruction does the work of two float32 FMAs. A GEMM uses it on pairs of its depth
(k = 2 * k2 + p): the weights are packed as wp[n // nr, k2, n % nr, p] (a column's two
rows of one pair side by side) and A's rows as a_p[m // t, k2, m % t, p] (the pack stage).
One tensor intrinsic covers 16 output columns of one row over one pair:
    C[i] += A[p] * B[i, p]          i < 16, p < 2
Its code: B's 32 values (16 columns x 2) narrowed into one register of bfloat16
(`vcvtne2ps2bf16`), A's pair broadcast to every lane and narrowed the same way. The
weights hold bfloat16 values (a bfloat16 layer's weights are rounded when bound), so their
narrowing is exact, and so is x's; the output projection's input, the attention's float32
output, is rounded to bfloat16 here, as a bfloat16 layer's reference rounds every value.

Why float32 in memory and a conversion per load: TVM 0.27 has no LLVM `bfloat` type (its
bfloat16 is legalised to uint16, and a bfloat16 value reaching the LLVM code generator
crashes it) while the LLVM intrinsic takes `<32 x bfloat>`: `vcvtne2ps2bf16` is the one
intrinsic that hands such a vector to TVM's code. So the paired weights are kept in float32
(the memory of a float32 layer): from bfloat16 memory every B vector cost two widening
loads and two shifts more, and the GEMMs ran only 1.04-1.11x faster than float32; from
float32 memory 1.34-1.36x (Zen 5, 1x2048x1024x16, 1 thread). On Zen 5 vdpbf16ps has twice
the FMA's throughput but a longer latency (a register-only loop: 2.26x the float32 FLOP/s
with 20 accumulators); the 10 conversions per 16 dot products share its pipes, which is
where the rest of the 2x goes.
"""
from tvm.script import tirx as T
from tvm.s_tir import TensorIntrin

from mhagen.schedules.tvmscript import cheap_stack

INTRIN = "mhagen_x86_bf16_dot_16x2"
LANES = 16


with cheap_stack():   # parsed at import: 2.9 s with TVM's own stack lookups
    @T.prim_func(s_tir=True)
    def _desc(A: T.Buffer((2,), "float32", offset_factor=1),
              B: T.Buffer((16, 2), "float32", offset_factor=1),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            for i, p in T.grid(16, 2):
                with T.sblock("update"):
                    vi, vp = T.axis.remap("SR", [i, p])
                    C[vi] = C[vi] + A[vp] * B[vi, vp]


    @T.prim_func(s_tir=True)
    def _impl(A: T.Buffer((2,), "float32", offset_factor=1),
              B: T.Buffer((16, 2), "float32", offset_factor=1),
              C: T.Buffer((16,), "float32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            # A's pair in every 64-bit lane (vbroadcastsd)
            a = T.reinterpret("float32x16",
                              T.broadcast(T.reinterpret("float64", A.vload([0], "float32x2")), 8))
            lo = B.vload([0, 0], "float32x16")   # columns 0-7
            hi = B.vload([8, 0], "float32x16")   # columns 8-15
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
