/* fake_cuda_driver.c -- a stand-in for libcuda.so.1 on machines without a GPU, for testing a
 * CUDA artifact's C API (libmha.so) up to the GPU: it loads, finds its functions, allocates,
 * copies and launches, and every call that matters is written to $FAKE_CUDA_LOG. Device
 * memory is host memory; a "launch" runs nothing. The fatbin is checked as the driver would:
 * its magic, and each function looked up must be named in it.
 *
 * Environment: FAKE_CUDA_LOG (the log file), FAKE_CUDA_DEVICES (GPUs, default 1),
 * FAKE_CUDA_CC (compute capability as major*10+minor, default 90), FAKE_CUDA_FAIL_INIT (1:
 * cuInit fails as without a GPU).
 * Build: cc -shared -fPIC fake_cuda_driver.c -o libfakecuda.so */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum { kMaxAllocs = 256, kMaxFunctions = 64 };
static struct { CUdeviceptr p; size_t n; } allocs[kMaxAllocs];
static struct { char name[128]; } functions[kMaxFunctions];
static int num_functions;
static char *image;
static size_t image_size;
static int context_token;

static int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...) {
  const char *path = getenv("FAKE_CUDA_LOG");
  if (!path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fclose(f);
}

/* The size of the allocation holding p, or -1. */
static long long alloc_size(CUdeviceptr p) {
  for (int i = 0; i < kMaxAllocs; ++i)
    if (allocs[i].p && p >= allocs[i].p && p < allocs[i].p + allocs[i].n)
      return (long long)allocs[i].n;
  return -1;
}

CUresult cuInit(unsigned flags) {
  (void)flags;
  log_line("init");
  return env_int("FAKE_CUDA_FAIL_INIT", 0) ? 100 /* CUDA_ERROR_NO_DEVICE */ : 0;
}
CUresult cuDeviceGetCount(int *n) { *n = env_int("FAKE_CUDA_DEVICES", 1); return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
  if (ordinal < 0 || ordinal >= env_int("FAKE_CUDA_DEVICES", 1)) return 101;
  *d = ordinal;
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  (void)dev;
  const int cc = env_int("FAKE_CUDA_CC", 90);
  if (attr == 75) *v = cc / 10;
  else if (attr == 76) *v = cc % 10;
  else if (attr == 97) *v = 232448;   /* H100/H200: 227 KiB */
  else return 1;
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
  log_line("context retain %d", dev);
  *ctx = &context_token;
  return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { log_line("context release %d", dev); return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &context_token ? 0 : 201; }
CUresult cuCtxSynchronize(void) { return 0; }

CUresult cuModuleLoadData(void **module, const void *data) {
  const uint32_t magic = 0xBA55ED50u;   /* fatbin */
  if (memcmp(data, &magic, 4) != 0) return 200;   /* CUDA_ERROR_INVALID_IMAGE */
  /* the fatbin header: magic, version (2 bytes), header size (2), fat size (8) */
  uint16_t header;
  uint64_t fat;
  memcpy(&header, (const char *)data + 6, 2);
  memcpy(&fat, (const char *)data + 8, 8);
  image_size = header + fat;
  image = malloc(image_size);
  memcpy(image, data, image_size);
  log_line("module load %zu bytes", image_size);
  *module = image;
  return 0;
}
CUresult cuModuleUnload(void *module) {
  log_line("module unload");
  if (module == image) { free(image); image = NULL; }
  return 0;
}
CUresult cuModuleGetFunction(void **f, void *module, const char *name) {
  if (module != image || !memmem(image, image_size, name, strlen(name))) {
    log_line("function %s not found", name);
    return 500;   /* CUDA_ERROR_NOT_FOUND */
  }
  if (num_functions == kMaxFunctions) return 2;
  snprintf(functions[num_functions].name, sizeof functions[0].name, "%s", name);
  *f = &functions[num_functions++];
  return 0;
}
CUresult cuFuncSetAttribute(void *f, int attr, int value) {
  log_line("attribute %s %d %d", ((char *)f), attr, value);
  return 0;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  for (int i = 0; i < kMaxAllocs; ++i)
    if (!allocs[i].p) {
      void *m = malloc(n);
      if (!m) return 2;
      allocs[i].p = (CUdeviceptr)(uintptr_t)m;
      allocs[i].n = n;
      *p = allocs[i].p;
      log_line("alloc %zu", n);
      return 0;
    }
  return 2;   /* CUDA_ERROR_OUT_OF_MEMORY */
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  for (int i = 0; i < kMaxAllocs; ++i)
    if (allocs[i].p == p) {
      free((void *)(uintptr_t)p);
      allocs[i].p = 0;
      log_line("free %zu", allocs[i].n);
      return 0;
    }
  return 1;
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
  memset((void *)(uintptr_t)p, v, n);
  return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  log_line("htod %zu into %lld", n, alloc_size(dst));
  memcpy((void *)(uintptr_t)dst, src, n);
  return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  log_line("dtoh %zu from %lld", n, alloc_size(src));
  memcpy(dst, (const void *)(uintptr_t)src, n);
  return 0;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *stream, void **params,
                        void **extra) {
  (void)extra;
  char args[1024] = "";
  size_t at = 0;
  /* each argument is a device pointer; libmha.so ends the list with NULL */
  for (int i = 0; params && i < 16 && params[i]; ++i) {
    const CUdeviceptr p = *(const CUdeviceptr *)params[i];
    at += (size_t)snprintf(args + at, sizeof args - at, " %lld", alloc_size(p));
  }
  log_line("launch %s grid %u %u %u block %u %u %u shared %u stream %p args%s", (char *)f, gx,
           gy, gz, bx, by, bz, shared, stream, args);
  return 0;
}

CUresult cuGetErrorString(CUresult rc, const char **s) {
  *s = rc == 0 ? "no error" : "fake CUDA driver error";
  return 0;
}
