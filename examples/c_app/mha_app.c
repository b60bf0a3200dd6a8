/* Run a compiled mhagen layer from C: read x (raw values of the artifact's dtype, MHA_DTYPE)
 * from a file, y = layer(x), print a summary of y and write it (raw, same dtype) to a file.
 *
 *   usage: mha_app ARTIFACT_DIR INPUT.bin [OUTPUT.bin]
 *
 * INPUT.bin holds MHA_BATCH * MHA_SEQ_LEN * MHA_D_MODEL little-endian values of MHA_DTYPE
 * (float32, float16 or bfloat16): x in [batch, seq_len, d_model] row-major order (numpy:
 * x.astype(np.float32).tofile(path); float16: np.float16; bfloat16: ml_dtypes.bfloat16).
 * Exit status: 0 on success, 1 on any error (the message goes to stderr).
 *
 * Build against one artifact DIR (mha.h and libmha.so are generated into it):
 *   DIR=$PWD/build/m
 *   cc -O2 -std=c11 examples/c_app/mha_app.c -I"$DIR" -L"$DIR" -lmha -Wl,-rpath,"$DIR" -o mha_app
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static int fail(const char *what, const char *detail) {
  fprintf(stderr, "mha_app: error: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  return 1;
}

/* One value of y as a double (half-precision artifacts hold bit patterns). */
static double value(mha_value v) {
#if MHA_BFLOAT16
  uint32_t bits = (uint32_t)v << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#elif MHA_FLOAT16
  uint32_t sign = (uint32_t)(v >> 15) << 31, e = (v >> 10) & 0x1f, m = v & 0x3ff, bits;
  float f;
  if (e == 0) return (sign ? -1.0 : 1.0) * (double)m / 16777216.0; /* zero, subnormal: m 2^-24 */
  bits = sign | (e == 31 ? 0xffu << 23 : (e + 112) << 23) | (m << 13);  /* inf/nan, normal */
  memcpy(&f, &bits, sizeof f);
  return f;
#else
  return v;
#endif
}

/* Reads exactly n values from path into x; returns 0 or prints why not and returns 1. */
static int read_values(const char *path, mha_value *x, size_t n) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return fail("cannot open input file", path);
  size_t got = fread(x, sizeof(mha_value), n, f);
  int extra = fgetc(f) != EOF;
  fclose(f);
  if (got != n || extra) {
    fprintf(stderr,
            "mha_app: error: %s must hold exactly %zu %s values ([%d, %d, %d]), it holds "
            "%s%zu\n",
            path, n, MHA_DTYPE, MHA_BATCH, MHA_SEQ_LEN, MHA_D_MODEL, extra ? "more than " : "", got);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3 || argc > 4) {
    fprintf(stderr, "usage: %s ARTIFACT_DIR INPUT.bin [OUTPUT.bin]\n", argv[0]);
    return 1;
  }
  mha_value *x = malloc(sizeof(mha_value) * MHA_INPUT_SIZE);
  mha_value *y = malloc(sizeof(mha_value) * MHA_OUTPUT_SIZE);
  if (x == NULL || y == NULL) return fail("out of memory", NULL);
  if (read_values(argv[2], x, MHA_INPUT_SIZE)) return 1;

  mha_handle *h = mha_create(argv[1]);
  if (h == NULL) {
    fprintf(stderr, "mha_app: error: %s: %s\n", mha_status_name(mha_last_error_code()),
            mha_last_error());
    return 1;
  }
  int rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y);
  if (rc != MHA_OK) {
    fprintf(stderr, "mha_app: error: %s: %s\n", mha_status_name(rc), mha_last_error());
    mha_destroy(h);
    return 1;
  }
  mha_destroy(h);

  double sum = 0.0;
  for (int i = 0; i < MHA_OUTPUT_SIZE; ++i) sum += value(y[i]);
  printf("y: [%d, %d, %d] %s, mean %.6g\n", MHA_BATCH, MHA_SEQ_LEN, MHA_OUT_D_MODEL, MHA_DTYPE,
         sum / MHA_OUTPUT_SIZE);
  for (int b = 0; b < MHA_BATCH; ++b) {
    const mha_value *row = y + (size_t)b * MHA_SEQ_LEN * MHA_OUT_D_MODEL;
    printf("y[%d, 0, :4] =", b);
    for (int j = 0; j < 4 && j < MHA_OUT_D_MODEL; ++j) printf(" %.6f", value(row[j]));
    printf("\n");
  }
  if (argc == 4) {
    FILE *f = fopen(argv[3], "wb");
    if (f == NULL) return fail("cannot create output file", argv[3]);
    size_t put = fwrite(y, sizeof(mha_value), MHA_OUTPUT_SIZE, f);
    if (fclose(f) != 0 || put != MHA_OUTPUT_SIZE) return fail("cannot write", argv[3]);
    printf("wrote %s\n", argv[3]);
  }
  free(x);
  free(y);
  return 0;
}
