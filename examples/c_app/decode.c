/* decode.c -- token-by-token generation through the C API of a decoding artifact.
 *
 * The artifact: a layer with a K/V cache (mhagen.mha(..., kv_cache=N)) built with batch 1 and
 * seq_len 1, saved with Module.save. This program owns the cache (two 64-byte aligned arrays
 * and a length) and feeds x one token per mha_run_cached call: the prompt first (a prefill,
 * token by token), then the generated positions; each call appends that token's K/V to the
 * cache and attends over everything cached so far.
 *
 * Usage: decode ARTIFACT_DIR X_FILE TOKENS Y_FILE
 *   X_FILE: TOKENS x MHA_D_MODEL float32 (row-major); Y_FILE: written, TOKENS x MHA_OUT_D_MODEL
 * Build: cc -std=c11 decode.c -I DIR -L DIR -lmha -Wl,-rpath,DIR -o decode
 */
#include <stdio.h>
#include <stdlib.h>

#include "mha.h"

#if MHA_KV_CACHE == 0 || MHA_BATCH != 1 || MHA_SEQ_LEN != 1
#error "decode.c needs the mha.h of a decoding artifact built with batch 1 and seq_len 1"
#endif

static float *aligned_floats(size_t n) {
  size_t bytes = (n * sizeof(float) + 63) / 64 * 64;   /* aligned_alloc: a multiple of 64 */
  return (float *)aligned_alloc(64, bytes);
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s ARTIFACT_DIR X_FILE TOKENS Y_FILE\n", argv[0]);
    return 2;
  }
  const int tokens = atoi(argv[3]);
  if (tokens < 1 || tokens > MHA_KV_CACHE) {
    fprintf(stderr, "TOKENS must be in 1..%d (the cache size)\n", MHA_KV_CACHE);
    return 2;
  }
  float *x = malloc((size_t)tokens * MHA_D_MODEL * sizeof(float));
  float *y = malloc((size_t)tokens * MHA_OUT_D_MODEL * sizeof(float));
  float *k_cache = aligned_floats(MHA_CACHE_SIZE);
  float *v_cache = aligned_floats(MHA_CACHE_SIZE);
  int32_t cache_len = 0;   /* tokens in the cache: no clearing needed, rows past it are unread */
  if (!x || !y || !k_cache || !v_cache) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  FILE *f = fopen(argv[2], "rb");
  if (!f || fread(x, sizeof(float), (size_t)tokens * MHA_D_MODEL, f) !=
                (size_t)tokens * MHA_D_MODEL) {
    fprintf(stderr, "cannot read %d x %d floats from %s\n", tokens, MHA_D_MODEL, argv[2]);
    return 1;
  }
  fclose(f);

  mha_handle *h = mha_create(argv[1]);
  if (!h) {
    fprintf(stderr, "mha_create: %s (%s)\n", mha_last_error(),
            mha_status_name(mha_last_error_code()));
    return 1;
  }
  for (int t = 0; t < tokens; ++t) {
    int rc = mha_run_cached(h, x + (size_t)t * MHA_D_MODEL, 1, 1, k_cache, v_cache, &cache_len,
                            y + (size_t)t * MHA_OUT_D_MODEL);
    if (rc != MHA_OK) {
      fprintf(stderr, "token %d: %s (%s)\n", t, mha_last_error(), mha_status_name(rc));
      return 1;
    }
  }
  printf("decoded %d tokens one at a time; the cache holds %d of %d\n", tokens, cache_len,
         MHA_KV_CACHE);
  f = fopen(argv[4], "wb");
  if (!f || fwrite(y, sizeof(float), (size_t)tokens * MHA_OUT_D_MODEL, f) !=
                (size_t)tokens * MHA_OUT_D_MODEL) {
    fprintf(stderr, "cannot write %s\n", argv[4]);
    return 1;
  }
  fclose(f);
  mha_destroy(h);
  free(x);
  free(y);
  free(k_cache);
  free(v_cache);
  return 0;
}
