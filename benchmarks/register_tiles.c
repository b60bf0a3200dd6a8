/* The GEMM register tiles alone, in L1: how fast this core runs each x86 class's inner loop
 * when memory is out of the way (the ceiling for mhagen's GEMM and attention FMA loops).
 *   6 x 16 AVX2     (mhagen's x86-avx2 tile: 12 ymm accumulators, 6 broadcasts + 2 loads)
 *   4 x 24 AVX2     (the BLIS/MLAS-like alternative: 4 broadcasts + 3 loads for 12 FMAs)
 *   8 x 32 AVX-512  (the attention's S^T and P V tiles on AVX-512 hosts: 16 zmm accumulators)
 *   12 x 32 AVX-512 (mhagen's GEMM tile on AVX-512 hosts: 24 zmm accumulators, 12 broadcasts
 *                    + 2 loads for 24 FMAs)
 *   8 x 32 BF16     (the bfloat16 pair GEMMs' tile: 16 accumulators, vdpbf16ps on pairs of
 *                    the depth, 2 multiply-adds a lane; where it beats the 8 x 32 FMA tile,
 *                    pairs pay: schedules/x86/bf16_dot.py's PAIRS_PAY)
 * Build and run (the AVX-512 tiles only run where the CPU has AVX-512F, the BF16 one AVX-512 BF16):
 *   gcc -O3 -mavx2 -mfma -o /tmp/register_tiles benchmarks/register_tiles.c && /tmp/register_tiles
 * An argument sets the rounds (at most 400).
 * Prints GFLOP/s (one thread) over 400 interleaved rounds of ~3 ms: the best, the median, the
 * speed 9 rounds in 10 reach and the worst. No memory is touched beyond L1, so a spread between the
 * best and the median is the host's doing (another tenant on the core's other hardware
 * thread, the hypervisor); where the AVX2 tiles spread more than the AVX-512 one, the host
 * costs code of twice the instructions per flop more. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define K 256
static float A[12 * K] __attribute__((aligned(64)));
static float B[32 * K] __attribute__((aligned(64)));
static float C[256] __attribute__((aligned(64)));
static int AP[8 * K / 2] __attribute__((aligned(64)));    /* bfloat16 pairs, as 32-bit words */
static int BP[32 * K / 2] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) static void tile_6x16(long reps) {
    for (long r = 0; r < reps; r++) {
        __m256 c[12];
        for (int i = 0; i < 12; i++) c[i] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m256 b0 = _mm256_load_ps(B + 16 * k), b1 = _mm256_load_ps(B + 16 * k + 8);
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                __m256 a = _mm256_broadcast_ss(A + 6 * k + i);
                c[2 * i] = _mm256_fmadd_ps(a, b0, c[2 * i]);
                c[2 * i + 1] = _mm256_fmadd_ps(a, b1, c[2 * i + 1]);
            }
        }
        for (int i = 0; i < 12; i++) _mm256_store_ps(C + 8 * i, _mm256_add_ps(_mm256_load_ps(C + 8 * i), c[i]));
    }
}

__attribute__((noinline)) static void tile_4x24(long reps) {
    for (long r = 0; r < reps; r++) {
        __m256 c[12];
        for (int i = 0; i < 12; i++) c[i] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m256 b0 = _mm256_load_ps(B + 24 * k), b1 = _mm256_load_ps(B + 24 * k + 8),
                   b2 = _mm256_load_ps(B + 24 * k + 16);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                __m256 a = _mm256_broadcast_ss(A + 4 * k + i);
                c[3 * i] = _mm256_fmadd_ps(a, b0, c[3 * i]);
                c[3 * i + 1] = _mm256_fmadd_ps(a, b1, c[3 * i + 1]);
                c[3 * i + 2] = _mm256_fmadd_ps(a, b2, c[3 * i + 2]);
            }
        }
        for (int i = 0; i < 12; i++) _mm256_store_ps(C + 8 * i, _mm256_add_ps(_mm256_load_ps(C + 8 * i), c[i]));
    }
}

/* rows x 32 AVX-512 (2 * rows zmm accumulators), inlined into each tile below with rows a
 * constant, so the row loop unrolls fully */
__attribute__((target("avx512f"), always_inline)) static inline void tile_x32(long reps, int rows) {
    for (long r = 0; r < reps; r++) {
        __m512 c[24];
        for (int i = 0; i < 2 * rows; i++) c[i] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m512 b0 = _mm512_load_ps(B + 32 * k), b1 = _mm512_load_ps(B + 32 * k + 16);
#pragma GCC unroll 12
            for (int i = 0; i < rows; i++) {
                __m512 a = _mm512_set1_ps(A[rows * k + i]);
                c[2 * i] = _mm512_fmadd_ps(a, b0, c[2 * i]);
                c[2 * i + 1] = _mm512_fmadd_ps(a, b1, c[2 * i + 1]);
            }
        }
        for (int i = 0; i < 2 * rows; i++) _mm512_store_ps(C + 16 * (i % 16), _mm512_add_ps(_mm512_load_ps(C + 16 * (i % 16)), c[i]));
    }
}

__attribute__((target("avx512f"), noinline)) static void tile_8x32(long reps) { tile_x32(reps, 8); }

__attribute__((target("avx512f"), noinline)) static void tile_12x32(long reps) { tile_x32(reps, 12); }

/* 8 x 32 on bfloat16 pairs: K / 2 pairs of the depth, the same multiply-adds as 8 x 32 */
__attribute__((target("avx512f,avx512bf16"), noinline)) static void tile_8x32_bf16(long reps) {
    for (long r = 0; r < reps; r++) {
        __m512 c[16];
        for (int i = 0; i < 16; i++) c[i] = _mm512_setzero_ps();
        for (int k = 0; k < K / 2; k++) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(BP + 32 * k),
                     b1 = (__m512bh)_mm512_load_si512(BP + 32 * k + 16);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32(AP[8 * k + i]);
                c[2 * i] = _mm512_dpbf16_ps(c[2 * i], a, b0);
                c[2 * i + 1] = _mm512_dpbf16_ps(c[2 * i + 1], a, b1);
            }
        }
        for (int i = 0; i < 16; i++) _mm512_store_ps(C + 16 * i, _mm512_add_ps(_mm512_load_ps(C + 16 * i), c[i]));
    }
}

static int descending(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

int main(int argc, char **argv) {
    for (int i = 0; i < 12 * K; i++) A[i] = 1e-3f * (i % 7);
    for (int i = 0; i < 32 * K; i++) B[i] = 1e-3f * (i % 5);
    for (int i = 0; i < 8 * K / 2; i++) AP[i] = 0x3c003c00 + (i % 7);   /* ~2^-7 each */
    for (int i = 0; i < 32 * K / 2; i++) BP[i] = 0x3c003c00 + (i % 5);
    int avx512 = __builtin_cpu_supports("avx512f");
    int bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    const long reps = 7000;
    enum { TILES = 5 };
    const char *names[TILES] = {"6 x 16 AVX2", "4 x 24 AVX2", "8 x 32 AVX-512", "12 x 32 AVX-512",
                                "8 x 32 BF16"};
    const char *lacks[TILES] = {"", "", "AVX-512F", "AVX-512F", "AVX-512 BF16"};
    double flops[TILES] = {2.0 * 6 * 16 * K * reps, 2.0 * 4 * 24 * K * reps,
                           2.0 * 8 * 32 * K * reps, 2.0 * 12 * 32 * K * reps,
                           2.0 * 8 * 32 * K * reps};
    enum { MOST = 400 };
    int ROUNDS = argc > 1 ? atoi(argv[1]) : MOST;   /* rounds: 1 .. 400 (default 400) */
    if (ROUNDS < 1 || ROUNDS > MOST) {
        fprintf(stderr, "usage: %s [rounds, 1..%d]\n", argv[0], MOST);
        return 2;
    }
    static double rate[TILES][MOST];
    for (int round = 0; round < ROUNDS; round++) {
        for (int t = 0; t < TILES; t++) {
            if ((t >= 2 && !avx512) || (t == 4 && !bf16)) continue;
            double t0 = now();
            if (t == 0) tile_6x16(reps);
            else if (t == 1) tile_4x24(reps);
            else if (t == 2) tile_8x32(reps);
            else if (t == 3) tile_12x32(reps);
            else tile_8x32_bf16(reps);
            rate[t][round] = flops[t] / (now() - t0) / 1e9;
        }
    }
    int ninth = ROUNDS * 9 / 10 > 0 ? ROUNDS * 9 / 10 - 1 : 0;   /* 9 rounds in 10 as fast */
    for (int t = 0; t < TILES; t++) {
        if ((t >= 2 && !avx512) || (t == 4 && !bf16))
            printf("%-15s (no %s on this CPU)\n", names[t], lacks[t]);
        else {
            qsort(rate[t], ROUNDS, sizeof(double), descending);
            printf("%-15s best %6.1f  median %6.1f  9 in 10 >= %6.1f  worst %6.1f GFLOP/s\n", names[t],
                   rate[t][0], rate[t][ROUNDS / 2], rate[t][ninth], rate[t][ROUNDS - 1]);
        }
    }
    return C[3] == 12345.0f;   /* keeps the results live */
}
