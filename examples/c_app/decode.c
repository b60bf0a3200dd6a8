/* decode.c -- token-by-token generation through the C API of a decoding artifact.
 *
 * The artifact: a layer with a K/V cache (mhagen.mha(..., kv_cache=N)) built with batch 1 and
 * either seq_len=None, max_seq_len=P (any number of new tokens per call, up to P) or
 * seq_len 1, saved with Module.save. This program owns the cache (two 64-byte aligned arrays
 * and a length). It runs the first PROMPT tokens of x in one mha_run_cached call (a prefill;
 * a seq_len-1 artifact takes them one at a time), then the rest one token per call (decode
 * steps); each call appends its tokens' K/V to the cache and attends over everything cached.
 *
 * Usage: decode ARTIFACT_DIR X_FILE TOKENS Y_FILE [PROMPT]   (PROMPT default 1)
 *   X_FILE: TOKENS x MHA_D_MODEL float32 (row-major); Y_FILE: written, TOKENS x MHA_OUT_D_MODEL
 * Build: cc -std=c11 decode.c -I DIR -L DIR -lmha -Wl,-rpath,DIR -o decode
 */
#include <stdio.h>
#include <stdlib.h>

#include "mha.h"

#if MHA_KV_CACHE == 0 || MHA_BATCH != 1 || (MHA_SEQ_LEN != 1 && !MHA_SYMBOLIC_SEQ_LEN)
#error "decode.c needs the mha.h of a decoding artifact built with batch 1 and seq_len None or 1"
#endif
#if MHA_FLOAT16 || MHA_BFLOAT16
/* x and y are float32 here; the cache may be any mha_cache_value */
#error "decode.c reads and writes float32 x and y: build the layer with dtype float32"
#endif

static mha_cache_value *aligned_cache(size_t n) {   /* MHA_CACHE_DTYPE values */
  size_t bytes = (n * sizeof(mha_cache_value) + 63) / 64 * 64;   /* a multiple of 64 */
  return (mha_cache_value *)aligned_alloc(64, bytes);
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: %s ARTIFACT_DIR X_FILE TOKENS Y_FILE [PROMPT]\n", argv[0]);
    return 2;
  }
  const int tokens = atoi(argv[3]);
  const int prompt = argc == 6 ? atoi(argv[5]) : 1;
  if (tokens < 1 || tokens > MHA_KV_CACHE) {
    fprintf(stderr, "TOKENS must be in 1..%d (the cache size)\n", MHA_KV_CACHE);
    return 2;
  }
  if (prompt < 1 || prompt > tokens) {
    fprintf(stderr, "PROMPT must be in 1..TOKENS\n");
    return 2;
  }
  /* tokens per call: the prompt at once when the artifact takes any number (up to
   * MHA_SEQ_LEN), else one by one */
  const int chunk = prompt <= MHA_SEQ_LEN ? prompt : 1;
  float *x = malloc((size_t)tokens * MHA_D_MODEL * sizeof(float));
  float *y = malloc((size_t)tokens * MHA_OUT_D_MODEL * sizeof(float));
  mha_cache_value *k_cache = aligned_cache(MHA_CACHE_SIZE);
  mha_cache_value *v_cache = aligned_cache(MHA_CACHE_SIZE);
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
  int calls = 0;
  for (int t = 0; t < tokens; ++calls) {
    const int n = t == 0 ? chunk : 1;
    int rc = mha_run_cached(h, x + (size_t)t * MHA_D_MODEL, 1, n, k_cache, v_cache, &cache_len,
                            y + (size_t)t * MHA_OUT_D_MODEL);
    if (rc != MHA_OK) {
      fprintf(stderr, "token %d: %s (%s)\n", t, mha_last_error(), mha_status_name(rc));
      return 1;
    }
    t += n;
  }
  printf("decoded %d tokens in %d calls (the first took %d); the cache holds %d of %d\n",
         tokens, calls, chunk, cache_len, MHA_KV_CACHE);
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
