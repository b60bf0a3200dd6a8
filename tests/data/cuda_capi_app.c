/* cuda_capi_app.c -- a C program using a CUDA artifact's C API the way an application does;
 * tests/test_cuda_capi.py runs it against tests/data/fake_cuda_driver.c (no GPU here).
 * Usage: cuda_capi_app ARTIFACT_DIR; prints one line per call: what, status, message. */
#include <stdio.h>
#include <stdlib.h>

#include "mha.h"

static void report(const char *what, int rc) {
  printf("%s %s %s\n", what, mha_status_name(rc), mha_last_error());
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  mha_handle *h = mha_create(argv[1]);
  report("create", h ? MHA_OK : mha_last_error_code());
  if (h == NULL) return 0;
  mha_value *x = calloc(MHA_INPUT_SIZE, sizeof *x), *y = calloc(MHA_OUTPUT_SIZE, sizeof *y);
  report("run", mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y));
  report("run_wrong_shape", mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN + 1, y));
  report("run_device", mha_run_device(h, x, y, (void *)0x5eed));
  for (int k = 0; k < mha_num_kernels(); ++k) printf("kernel %d %s\n", k, mha_kernel_name(k));
  report("run_kernel_device", mha_run_kernel_device(h, 1, x, y, NULL));
  report("run_kernel_out_of_range", mha_run_kernel_device(h, mha_num_kernels(), x, y, NULL));
  report("run_device_null", mha_run_device(h, NULL, y, NULL));
  mha_destroy(h);
  free(x);
  free(y);
  return 0;
}
