"""Square transposes of 16- and 32-bit words as LLVM IR helpers (bf16_dot.with_llvm_ir links
them into a kernel): log2 n rounds of a perfect shuffle of n rows in registers, where a
strided TIR copy becomes one scalar insert per element."""

# dst = src^T, 16 x 16 32-bit words (offsets i32): AMX's O^T into rows
TRANSPOSE_16_I32 = "mhagen_transpose_16x16_i32"
# dst = src^T, 32 x 32 16-bit words (offsets i64): V's rows of keys into V^T's rows of 32 keys
TRANSPOSE_32_I16 = "mhagen_transpose_32x32_i16"


def transpose_words(lanes: int) -> str:
    """The helper transposing lanes x lanes 32-bit words (offsets i64): the float32
    attention's Q^T copy, one vector of queries a head column."""
    return f"mhagen_transpose_{lanes}x{lanes}_w32"


def transpose(name, n, word, offset):
    """LLVM IR of `i32 name(ptr dbase, offset doff, i64 dstride, ptr sbase, offset soff,
    i64 sstride)`: dst = src^T for n x n words (n a power of 2; rows `stride` bytes apart,
    offsets in words): log2 n rounds of a perfect shuffle of the rows (row 2i + h of a
    round interleaves half h of rows i and i + n / 2)."""
    rounds, v = n.bit_length() - 1, f"<{n} x {word}>"
    return "\n".join(
        [f"define i32 @{name}(ptr %dbase, {offset} %doff, i64 %dstride, ptr %sbase, "
         f"{offset} %soff, i64 %sstride) {{",
         f"  %d = getelementptr {word}, ptr %dbase, {offset} %doff",
         f"  %s = getelementptr {word}, ptr %sbase, {offset} %soff"]
        + [f"  %so{i} = mul i64 %sstride, {i}\n  %sp{i} = getelementptr i8, ptr %s, i64 %so{i}\n"
           f"  %r0_{i} = load {v}, ptr %sp{i}, align 4" for i in range(n)]
        + [f"  %r{k + 1}_{2 * i + h} = shufflevector {v} %r{k}_{i}, {v} %r{k}_{i + n // 2}, "
           f"<{n} x i32> <" + ", ".join(f"i32 {m}" for c in range(n // 2 * h, n // 2 * (h + 1))
                                        for m in (c, n + c)) + ">"
           for k in range(rounds) for i in range(n // 2) for h in (0, 1)]
        + [f"  %do{i} = mul i64 %dstride, {i}\n  %dp{i} = getelementptr i8, ptr %d, i64 %do{i}\n"
           f"  store {v} %r{rounds}_{i}, ptr %dp{i}, align 4" for i in range(n)]
        + ["  ret i32 0", "}", ""])
