"""The decoding layer and modules tests/test_decode_varlen.py and tests/test_paged.py share,
each built once per test process (builds are most of those files' time)."""
import functools

import numpy as np

import mhagen

MAX_LEN = 48     # 3 blocks of 16
# head_dim 24: whole vectors and a tail; GQA (2 query heads a K/V head); rotary, ALiBi and a
# window read each row's own positions
LAYER = mhagen.mha(64, 4, head_dim=24, kv_heads=2, causal=True, rotary=True,
                   score_mod=mhagen.alibi(4), mask=mhagen.sliding_window(20), kv_cache=MAX_LEN)
W = LAYER.init_weights(0)


@functools.lru_cache(maxsize=None)
def packed_module():
    """Any number of new tokens, a contiguous KVCache of 4 rows: up to 4 x 3 tokens a call
    (6 query rows a K/V head at most: the template's lanes along head_dim)."""
    return mhagen.build(LAYER, "x86", batch=4, seq_len=None, max_seq_len=3, weights=W,
                        tuning=None)


@functools.lru_cache(maxsize=None)
def paged_module():
    """Any number of new tokens, a paged cache of blocks of 16: up to 4 sequences and 32
    tokens a call (16 query rows a K/V head: rows in the vector lanes)."""
    return mhagen.build(LAYER, "x86", batch=4, seq_len=None, max_seq_len=8, weights=W,
                        tuning=None, kv_block_size=16)


@functools.lru_cache(maxsize=None)
def paged_step_module():
    """One new token for each of 2 sequences of a paged cache (fixed shape)."""
    return mhagen.build(LAYER, "x86", batch=2, seq_len=1, weights=W, tuning=None,
                        kv_block_size=16)


def reference_cache(cache):
    """A float64 copy of a KVCache (the reference's)."""
    return mhagen.KVCache.from_arrays(cache.k.astype(np.float64), cache.v.astype(np.float64),
                                      cache.lens)


# -- the C API of these modules: one call read from files, through a small C driver ----------
DRIVER = r"""
/* Test driver for mha_run_cached_varlen (contiguous caches) and mha_run_paged (paged
   artifacts, MHA_KV_BLOCK_SIZE > 0): reads one call from PREFIX.* (x, cu, lens, k, v,
   tables; meta: "rows total num_blocks"; a missing cu: NULL), runs it, prints
   "STATUS_NAME|message" and writes PREFIX.y (on success), PREFIX.k.out, .v.out, .lens.out.
   MODE "other" calls the entry point of the other cache form instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static const char *prefix;

static void *load(const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s.%s", prefix, name);
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *p = aligned_alloc(64, ((size_t)n + 127) / 64 * 64);
  if (fread(p, 1, (size_t)n, f) != (size_t)n) exit(3);
  fclose(f);
  return p;
}

static size_t size_of(const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s.%s", prefix, name);
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fclose(f);
  return (size_t)n;
}

static void save(const char *name, const void *p, size_t bytes) {
  char path[4096];
  snprintf(path, sizeof path, "%s.%s", prefix, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(p, 1, bytes, f) != bytes) exit(4);
  fclose(f);
}

int main(int argc, char **argv) {
  if (argc != 4) return 2;
  prefix = argv[3];
  mha_handle *h = mha_create(argv[2]);
  if (!h) {
    printf("%s|%s\n", mha_status_name(mha_last_error_code()), mha_last_error());
    return 0;
  }
  int rows = 0, total = 0, num_blocks = 0;
  char path[4096];
  snprintf(path, sizeof path, "%s.meta", prefix);
  FILE *m = fopen(path, "r");
  if (!m || fscanf(m, "%d %d %d", &rows, &total, &num_blocks) != 3) return 3;
  fclose(m);
  const mha_value *x = load("x");
  const int32_t *cu = load("cu");
  int32_t *lens = load("lens");
  mha_cache_value *k = load("k"), *v = load("v");
  const int32_t *tables = load("tables");
  mha_value *y = aligned_alloc(64, ((size_t)total * MHA_OUT_D_MODEL * sizeof(mha_value) + 127)
                                       / 64 * 64);
  int paged = MHA_KV_BLOCK_SIZE > 0;
  if (!strcmp(argv[1], "other")) paged = !paged;
  int rc = paged ? mha_run_paged(h, x, rows, total, cu, k, v, num_blocks, tables, lens, y)
                 : mha_run_cached_varlen(h, x, total, cu, k, v, lens, y);
  printf("%s|%s\n", mha_status_name(rc), mha_last_error());
  if (rc == MHA_OK) save("y", y, (size_t)total * MHA_OUT_D_MODEL * sizeof(mha_value));
  save("k.out", k, size_of("k"));
  save("v.out", v, size_of("v"));
  save("lens.out", lens, size_of("lens"));
  mha_destroy(h);
  return 0;
}
"""


def c_driver(module, directory):
    """(artifact directory, driver executable) of `module` saved under `directory`, or a
    skip where no C compiler is installed."""
    import shutil
    from conftest import build_c_app, unavailable
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        unavailable("the C API tests need gcc")
    artifact = module.save(directory / "artifact")
    (directory / "driver.c").write_text(DRIVER)
    return artifact, build_c_app(cc, artifact, directory / "driver", directory / "driver.c")


def run_c_call(artifact, exe, prefix, arrays, meta, mode="run"):
    """Write arrays (name -> numpy array) and meta (rows, total, num_blocks) to prefix.*,
    run the driver; returns (status, message, {name: the bytes written back})."""
    import subprocess
    for name, a in arrays.items():
        np.ascontiguousarray(a).tofile(f"{prefix}.{name}")
    with open(f"{prefix}.meta", "w") as f:
        f.write(" ".join(map(str, meta)))
    r = subprocess.run([str(exe), mode, str(artifact), str(prefix)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    status, message = r.stdout.strip().split("|", 1)
    out = {}
    for name in ("y", "k.out", "v.out", "lens.out"):
        try:
            with open(f"{prefix}.{name}", "rb") as f:
                out[name] = f.read()
        except FileNotFoundError:
            pass
    return status, message, out
