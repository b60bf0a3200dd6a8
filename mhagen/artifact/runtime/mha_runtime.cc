// mha_runtime.cc -- the C API (mha.h) of a compiled mhagen artifact: mha_create checks and
// loads the artifact directory, mha_run calls its kernels.
//
// mhagen ships this file unchanged; it reads the artifact only through the tables of the
// generated mha_config.h (see mha_runtime.h) and the status codes of the generated mha.h, both
// written from manifest.json and mhagen.artifact.capi.STATUS. Nothing here depends on the
// target architecture: a cross compiler builds it unchanged. Build (in the artifact directory;
// manifest.json c_api.build_command has the exact lines). A CPU artifact builds it twice:
//   lib/libmha_impl.so (MHA_IMPL): the runtime proper, linked with TVM's runtime in lib/;
//     its entry points are named mha_impl_create, mha_impl_run, ...
//       c++ -std=c++17 -O2 -fPIC -shared -fvisibility=hidden -DMHA_IMPL=1 -I. -I<tvm-ffi
//       include> mha_runtime.cc -o lib/libmha_impl.so -Llib -ltvm_ffi -ltvm_runtime
//       -Wl,-rpath,'$ORIGIN'
//   libmha.so (MHA_LOADER): what your program links. It links no TVM: mha_create checks
//     lib/ (sizes and sha256 from mha_libraries.h), then opens lib/libmha_impl.so and
//     forwards every call to it. (Linked directly, a truncated libtvm_runtime.so killed the
//     program with SIGBUS in the dynamic loader, before any check could run.)
//       c++ -std=c++17 -O2 -fPIC -shared -fvisibility=hidden -DMHA_LOADER=1 -I. -I<tvm-ffi
//       include> mha_runtime.cc -o libmha.so -ldl
// CUDA artifacts (MHA_DEVICE_CUDA) use no TVM at all: kernels.fatbin is launched through the
// CUDA driver (mha_cuda_driver.h, loaded at run time); they link -ldl only.
#if MHA_IMPL   // the entry points under names of their own (the loader's are the mha_* ones)
#define mha_create mha_impl_create
#define mha_run mha_impl_run
#define mha_run_padded mha_impl_run_padded
#define mha_run_cached mha_impl_run_cached
#define mha_run_cross mha_impl_run_cross
#define mha_run_cached_varlen mha_impl_run_cached_varlen
#define mha_run_paged mha_impl_run_paged
#define mha_run_varlen mha_impl_run_varlen
#define mha_destroy mha_impl_destroy
#define mha_last_error mha_impl_last_error
#define mha_last_error_code mha_impl_last_error_code
#define mha_status_name mha_impl_status_name
#define mha_num_kernels mha_impl_num_kernels
#define mha_kernel_name mha_impl_kernel_name
#endif
#include "mha.h"
#include "mha_config.h"
#include "mha_runtime.h"
#include "mha_cpu.h"
#if MHA_LOADER
#include "mha_libraries.h"
#endif

#include <dlpack/dlpack.h>
#if MHA_DEVICE_CUDA
#include "mha_cuda_driver.h"
#elif MHA_LOADER
#include <dlfcn.h>
#else
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#endif

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace mha {
namespace {

using namespace config;

// ---- errors: one status and message per thread ---------------------------------------------
thread_local int g_code = MHA_OK;
thread_local std::string g_message;

int fail(int code, const std::string &message) {
  g_code = code;
  g_message = message;
  return code;
}

void clear_error() {
  g_code = MHA_OK;
  g_message.clear();
}

#if !MHA_LOADER
// ---- the device the kernels' buffers live on ------------------------------------------------
// The one place that knows where buffers live. mha_config.h's kDeviceType comes from the
// manifest's target device: the CPU (buffers from posix_memalign, copies with memcpy, the
// caller's arrays used in place when aligned) or CUDA (cuMemAlloc, synchronous copies on
// the legacy default stream; host arrays always go through the device buffers).
#if MHA_DEVICE_CUDA
static_assert(kDeviceType == kDLCUDA, "a CUDA artifact's buffers live on the GPU");

const cu::Driver *g_driver = nullptr;   // set by open_device before any allocation

DLDevice device() { return DLDevice{kDeviceType, 0}; }

cu::DevicePtr dptr(const void *p) { return cu::DevicePtr(reinterpret_cast<uintptr_t>(p)); }

// `bytes` of zeroed device memory in the current context; nullptr when out of memory.
void *device_alloc(size_t bytes) {
  cu::DevicePtr p = 0;
  if (g_driver->MemAlloc(&p, bytes ? bytes : 1) != cu::kSuccess) return nullptr;
  if (g_driver->MemsetD8(p, 0, bytes) != cu::kSuccess) {
    g_driver->MemFree(p);
    return nullptr;
  }
  return reinterpret_cast<void *>(uintptr_t(p));
}

void device_free(void *p) {
  if (p != nullptr && g_driver != nullptr) g_driver->MemFree(dptr(p));
}

bool copy_to_device(void *dst, const void *src, size_t n) {
  return g_driver->MemcpyHtoD(dptr(dst), src, n) == cu::kSuccess;
}

bool copy_to_host(void *dst, const void *src, size_t n) {
  return g_driver->MemcpyDtoH(dst, dptr(src), n) == cu::kSuccess;
}

bool usable_in_place(const void *) { return false; }   // host pointers: never

// Waits for the GPU; " (CUDA error ...)" when a kernel failed, else "".
std::string device_error() {
  const cu::Result rc = g_driver->CtxSynchronize();
  return rc == cu::kSuccess ? std::string() : " (" + cu::error_text(*g_driver, rc) + ")";
}
#else
static_assert(kDeviceType == kDLCPU, "a CPU artifact's buffers live in host memory");

constexpr size_t kAlign = 64;       // the kernels use aligned vector loads

DLDevice device() { return DLDevice{kDeviceType, 0}; }

// `bytes` of zeroed device memory, kAlign-aligned; nullptr when out of memory.
void *device_alloc(size_t bytes) {
  const size_t padded = bytes ? (bytes + kAlign - 1) / kAlign * kAlign : kAlign;
  void *p = nullptr;
  if (posix_memalign(&p, kAlign, padded) != 0) return nullptr;
  std::memset(p, 0, padded);
  return p;
}

void device_free(void *p) { std::free(p); }

bool copy_to_device(void *dst, const void *src, size_t n) {
  std::memcpy(dst, src, n);
  return true;
}

bool copy_to_host(void *dst, const void *src, size_t n) {
  std::memcpy(dst, src, n);
  return true;
}

// Whether the kernels may use a caller's array in place instead of a staging copy.
bool usable_in_place(const void *p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

std::string device_error() { return std::string(); }
#endif
#endif  // !MHA_LOADER

// ---- SHA-256 (FIPS 180-4) -------------------------------------------------------------------
class Sha256 {
 public:
  Sha256() {
    static const uint32_t init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(h_, init, sizeof h_);
  }
  void update(const uint8_t *data, size_t n) {
    length_ += n;
    if (fill_) {
      size_t take = n < 64 - fill_ ? n : 64 - fill_;
      std::memcpy(block_ + fill_, data, take);
      fill_ += take, data += take, n -= take;
      if (fill_ == 64) compress(block_), fill_ = 0;
    }
    for (; n >= 64; data += 64, n -= 64) compress(data);
    if (n) std::memcpy(block_, data, n);
    fill_ += n;
  }
  std::string hex() {
    uint64_t bits = length_ * 8;
    uint8_t pad[72] = {0x80};
    size_t padlen = (fill_ < 56 ? 56 : 120) - fill_;
    for (size_t i = 0; i < 8; ++i) pad[padlen + i] = uint8_t(bits >> (56 - 8 * i));
    update(pad, padlen + 8);
    static const char digits[] = "0123456789abcdef";
    std::string out(64, '0');
    for (size_t i = 0; i < 32; ++i) {
      uint8_t b = uint8_t(h_[i / 4] >> (24 - 8 * (i % 4)));
      out[2 * i] = digits[b >> 4];
      out[2 * i + 1] = digits[b & 15];
    }
    return out;
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void compress(const uint8_t *p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 |
             uint32_t(p[4 * i + 2]) << 8 | uint32_t(p[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
             h = h_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] +
                    w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g,
        h_[7] += h;
  }
  uint32_t h_[8];
  uint8_t block_[64];
  size_t fill_ = 0;
  uint64_t length_ = 0;
};

// ---- files ----------------------------------------------------------------------------------
// Checks that `path` is a regular file of `expected` bytes (any size if expected < 0; then
// returns it in *size).
int check_size(const std::string &path, int64_t expected, int64_t *size = nullptr) {
  struct stat st;
  char target[4096];
  if (stat(path.c_str(), &st) != 0 && lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    // lib/ links to TVM's runtime in mhagen's cache unless the artifact is self-contained
    const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
    target[n > 0 ? n : 0] = '\0';
    return fail(MHA_ERR_NOT_FOUND, "mha_create: " + path + " links to " + target +
                                       ", which is missing (mhagen's cache was cleared?); "
                                       "save the module again, or with self_contained=True "
                                       "to ship it");
  }
  if (stat(path.c_str(), &st) != 0)
    return fail(MHA_ERR_NOT_FOUND, "mha_create: " + path + " is missing (" +
                                       std::strerror(errno) +
                                       "); copy the whole artifact directory");
  if (!S_ISREG(st.st_mode))
    return fail(MHA_ERR_NOT_FOUND, "mha_create: " + path + " is not a regular file");
  const int64_t got = int64_t(st.st_size);
  if (expected >= 0 && got != expected)
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " has " + std::to_string(got) +
                                     " bytes, expected " + std::to_string(expected) + " (" +
                                     (got < expected ? "truncated" : "replaced or corrupted") +
                                     "); rebuild the artifact or copy it again");
  if (size) *size = got;
  return MHA_OK;
}

// Reads the file of `spec` in 1 MiB chunks, hashing them and handing each to
// sink(offset, bytes, n); fails unless it has spec.size bytes and spec.sha256.
template <class Sink>
int verify_file(const std::string &path, const FileSpec &spec, Sink &&sink) {
  if (check_size(path, spec.size) != MHA_OK) return g_code;
  std::FILE *f = std::fopen(path.c_str(), "rb");
  if (!f)
    return fail(MHA_ERR_NOT_FOUND,
                "mha_create: cannot open " + path + " (" + std::strerror(errno) + ")");
  std::vector<uint8_t> chunk(size_t(1) << 20);
  Sha256 sha;
  int64_t offset = 0;
  for (size_t n; (n = std::fread(chunk.data(), 1, chunk.size(), f)) > 0; offset += int64_t(n)) {
    sha.update(chunk.data(), n);
    sink(offset, chunk.data(), n);
  }
  const bool read_error = std::ferror(f) != 0;
  std::fclose(f);
  if (read_error || offset != spec.size)
    return fail(MHA_ERR_CORRUPT, "mha_create: could not read all of " + path);
  if (sha.hex() != spec.sha256)
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " is corrupted (sha256 mismatch); "
                                 "rebuild the artifact or copy it again");
  return MHA_OK;
}

// The whole of a small file (manifest.json, at most 64 MiB).
int read_small_file(const std::string &path, std::string *out) {
  int64_t size = 0;
  if (check_size(path, -1, &size) != MHA_OK) return g_code;
  if (size > (int64_t(64) << 20))
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " is implausibly large");
  std::FILE *f = std::fopen(path.c_str(), "rb");
  if (!f)
    return fail(MHA_ERR_NOT_FOUND,
                "mha_create: cannot open " + path + " (" + std::strerror(errno) + ")");
  out->resize(size_t(size));
  const size_t got = size ? std::fread(&(*out)[0], 1, size_t(size), f) : 0;
  std::fclose(f);
  if (got != size_t(size))
    return fail(MHA_ERR_CORRUPT, "mha_create: could not read all of " + path);
  return MHA_OK;
}

// ---- manifest.json: find a top-level key's value without a JSON parser ----------------------
bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

size_t top_level_value(const std::string &s, const char *key) {
  const size_t n = s.size(), keylen = std::strlen(key);
  int depth = 0;
  for (size_t i = 0; i < n;) {
    char c = s[i];
    if (c == '"') {
      size_t start = ++i;
      while (i < n && s[i] != '"') i += (s[i] == '\\') ? 2u : 1u;
      if (i >= n) return std::string::npos;
      size_t end = i++;
      if (depth == 1) {
        size_t j = i;
        while (j < n && is_space(s[j])) ++j;
        if (j < n && s[j] == ':' && end - start == keylen &&
            s.compare(start, keylen, key) == 0) {
          for (++j; j < n && is_space(s[j]);) ++j;
          return j;
        }
      }
      continue;
    }
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') --depth;
    ++i;
  }
  return std::string::npos;
}

bool top_level_string(const std::string &s, const char *key, std::string *out) {
  size_t p = top_level_value(s, key);
  if (p == std::string::npos || s[p] != '"') return false;
  size_t q = s.find('"', p + 1);
  if (q == std::string::npos) return false;
  *out = s.substr(p + 1, q - p - 1);
  return true;
}

bool top_level_int(const std::string &s, const char *key, long *out) {
  size_t p = top_level_value(s, key);
  if (p == std::string::npos) return false;
  const char *begin = s.c_str() + p;
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(begin, &end, 10);
  if (end == begin || errno) return false;
  *out = v;
  return true;
}

#if !MHA_LOADER
#if !MHA_DEVICE_CUDA
// ---- threads: one per usable physical core unless TVM_NUM_THREADS is set --------------------
// As mhagen.host.host_cores: the usable CPUs, SMT siblings (sysfs thread_siblings_list)
// counted once; every usable CPU where sysfs does not say.
#ifdef __linux__
int usable_cores(const cpu_set_t &set) {
  std::vector<std::string> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    const std::string path = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) +
                             "/topology/thread_siblings_list";
    FILE *f = std::fopen(path.c_str(), "r");
    if (f == nullptr) return CPU_COUNT(&set);
    char line[256] = {0};
    const bool ok = std::fgets(line, sizeof line, f) != nullptr;
    std::fclose(f);
    if (!ok) return CPU_COUNT(&set);
    const std::string siblings(line);
    bool seen = false;
    for (const std::string &c : cores) seen = seen || c == siblings;
    if (!seen) cores.push_back(siblings);
  }
  return cores.empty() ? CPU_COUNT(&set) : int(cores.size());
}
#endif

void prepare_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
#ifdef __linux__
    if (std::getenv("TVM_NUM_THREADS") == nullptr) {
      cpu_set_t set;
      if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        setenv("TVM_NUM_THREADS", std::to_string(usable_cores(set)).c_str(), 0);
    }
#endif
  });
}
#endif
#endif  // !MHA_LOADER

}  // namespace
}  // namespace mha

#if !MHA_LOADER
// ---- the handle ------------------------------------------------------------------------------
struct mha_handle {
  std::mutex mutex;                 // one run at a time: temps and staging buffers are shared
#if MHA_DEVICE_CUDA
  mha::cu::Device gpu = 0;
  mha::cu::Context context = nullptr;   // the GPU's primary context (shared with the CUDA
                                        // runtime, so cudaMalloc'ed pointers work here)
  mha::cu::ModuleHandle module = nullptr;
  std::vector<mha::cu::Function> functions;   // one per kLaunches entry
#else
  tvm::ffi::Optional<tvm::ffi::Module> module;
  std::vector<tvm::ffi::Function> kernels;
  std::vector<std::vector<tvm::ffi::AnyView>> args;   // views of `tensors`
  std::vector<tvm::ffi::Function> packed_kernels;     // a packed call's (kPackedKernels)
  std::vector<std::vector<tvm::ffi::AnyView>> packed_args;
#endif
  std::vector<DLTensor> tensors;    // one per buffer; never resized after mha_create
  std::vector<int64_t> shapes;      // their shapes, kMaxDims per buffer (symbolic axes: the
                                    // current call's)
  std::vector<void *> data;         // device memory; input/output: staging copies
  ~mha_handle() {
#if MHA_DEVICE_CUDA
    if (context == nullptr) return;   // nothing was allocated
    mha::g_driver->CtxSetCurrent(context);
    for (void *p : data) mha::device_free(p);
    if (module != nullptr) mha::g_driver->ModuleUnload(module);
    mha::g_driver->PrimaryCtxRelease(gpu);
#else
    args.clear();
    kernels.clear();
    packed_args.clear();
    packed_kernels.clear();
    module = tvm::ffi::Optional<tvm::ffi::Module>();
    for (void *p : data) mha::device_free(p);
#endif
  }
};
#endif  // !MHA_LOADER

namespace mha {
namespace {

// Checks the manifest of `dir` against the tables baked in here.
int check_manifest(const std::string &dir) {
  std::string manifest, format, hash;
  const std::string mpath = dir + "/manifest.json";
  if (read_small_file(mpath, &manifest) != MHA_OK) return g_code;
  long version = 0;
  if (!top_level_string(manifest, "format", &format) || format != kFormat)
    return fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " is not an mhagen module manifest "
                                 "(corrupted?); rebuild the artifact");
  if (!top_level_int(manifest, "version", &version))
    return fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " has no format version (corrupted?)");
  if (version != kFormatVersion)
    return fail(MHA_ERR_VERSION,
                "mha_create: " + dir + " has artifact format version " + std::to_string(version) +
                    (version > kFormatVersion ? ", newer than" : ", older than") + " version " +
                    std::to_string(kFormatVersion) + " that this libmha.so reads: " +
                    (version > kFormatVersion
                         ? "link your program against the mha.h and libmha.so in that directory"
                         : "rebuild the artifact with the current mhagen"));
  if (!top_level_string(manifest, "content_hash", &hash))
    return fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " has no content_hash (corrupted?)");
  if (hash != kContentHash)
    return fail(MHA_ERR_MISMATCH, "mha_create: " + dir + " holds artifact " + hash.substr(0, 16) +
                                      ", but this libmha.so was generated for artifact " +
                                      std::string(kContentHash).substr(0, 16) +
                                      ": use the mha.h and libmha.so of that directory");
  return MHA_OK;
}

// Checks mha_create's argument: a directory holding this artifact's manifest.
int check_directory(const char *dir_c) {
  if (dir_c == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, "mha_create: artifact_dir is NULL");
  const std::string dir(dir_c);
  struct stat st;
  if (dir.empty() || stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return fail(MHA_ERR_NOT_FOUND, "mha_create: no artifact directory at '" + dir +
                                       "' (write one with `mhagen build ... --out DIR`)");
  return check_manifest(dir);
}

#if MHA_LOADER
// ---- the loader: libmha.so of a CPU artifact (see the top of this file) ---------------------
// The runtime's entry points, bound once per process (never unloaded: TVM's runtime stays).
struct Runtime {
  decltype(&mha_create) create;
  decltype(&mha_run) run;
  decltype(&mha_run_padded) run_padded;
  decltype(&mha_run_cached) run_cached;
  decltype(&mha_run_cross) run_cross;
  decltype(&mha_run_cached_varlen) run_cached_varlen;
  decltype(&mha_run_paged) run_paged;
  decltype(&mha_run_varlen) run_varlen;
  decltype(&mha_destroy) destroy;
  decltype(&mha_last_error) last_error;
  decltype(&mha_last_error_code) last_error_code;
};
Runtime g_runtime;
std::mutex g_runtime_mutex;
bool g_runtime_loaded = false;   // under g_runtime_mutex; a handle exists only after it is set
thread_local bool g_forwarded = false;   // this thread's last error is the runtime's

template <class F>
bool bind(void *library, const char *name, F *slot) {
  *slot = reinterpret_cast<F>(dlsym(library, name));
  return *slot != nullptr;
}

// Checks lib/ (kLibraries: size, then sha256) and opens lib/libmha_impl.so.
int load_runtime(const std::string &dir) {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  if (g_runtime_loaded) return MHA_OK;
  for (int i = 0; i < kNumLibraries; ++i)   // sizes first: a truncated copy fails before reads
    if (check_size(dir + "/" + kLibraries[i].name, kLibraries[i].size) != MHA_OK) return g_code;
  auto ignore = [](int64_t, const uint8_t *, size_t) {};
  for (int i = 0; i < kNumLibraries; ++i)
    if (verify_file(dir + "/" + kLibraries[i].name, kLibraries[i], ignore) != MHA_OK)
      return g_code;
  const std::string path = dir + "/" + kRuntimeLibrary;
  // global: kernel.so, which TVM opens later, finds TVM's runtime symbols there
  void *library = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (library == nullptr) {
    const char *why = dlerror();
    return fail(MHA_ERR_RUNTIME, "mha_create: cannot open " + path + ": " +
                                     (why ? why : "unknown error"));
  }
  Runtime r{};
  if (!(bind(library, "mha_impl_create", &r.create) && bind(library, "mha_impl_run", &r.run) &&
        bind(library, "mha_impl_run_padded", &r.run_padded) &&
        bind(library, "mha_impl_run_cached", &r.run_cached) &&
        bind(library, "mha_impl_run_cross", &r.run_cross) &&
        bind(library, "mha_impl_run_cached_varlen", &r.run_cached_varlen) &&
        bind(library, "mha_impl_run_paged", &r.run_paged) &&
        bind(library, "mha_impl_run_varlen", &r.run_varlen) &&
        bind(library, "mha_impl_destroy", &r.destroy) &&
        bind(library, "mha_impl_last_error", &r.last_error) &&
        bind(library, "mha_impl_last_error_code", &r.last_error_code)))
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " lacks the mha_impl_* entry points; "
                                 "rebuild the artifact");
  g_runtime = r;
  g_runtime_loaded = true;
  return MHA_OK;
}

// The runtime, once a handle exists (nullptr before any mha_create succeeded).
const Runtime *runtime() {
  std::lock_guard<std::mutex> lock(g_runtime_mutex);
  return g_runtime_loaded ? &g_runtime : nullptr;
}

int no_handle(const char *fn) {
  g_forwarded = false;
  return fail(MHA_ERR_NULL_ARGUMENT,
              std::string(fn) + ": handle is NULL (did mha_create fail? see mha_last_error())");
}

}  // namespace
}  // namespace mha

extern "C" {

MHA_API mha_handle *mha_create(const char *dir_c) {
  using namespace mha;
  clear_error();
  g_forwarded = false;
  try {
    if (check_directory(dir_c) != MHA_OK || load_runtime(dir_c) != MHA_OK) return nullptr;
  } catch (const std::bad_alloc &) {
    fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory");
    return nullptr;
  }
  g_forwarded = true;
  return g_runtime.create(dir_c);
}

MHA_API int mha_run(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                    mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run");
  mha::g_forwarded = true;
  return r->run(handle, x, batch, seq_len, y);
}

MHA_API int mha_run_padded(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           const int32_t *kv_lens, mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_padded");
  mha::g_forwarded = true;
  return r->run_padded(handle, x, batch, seq_len, kv_lens, y);
}

MHA_API int mha_run_cached(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           mha_cache_value *k_cache, mha_cache_value *v_cache,
                           int32_t *cache_lens, mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_cached");
  mha::g_forwarded = true;
  return r->run_cached(handle, x, batch, seq_len, k_cache, v_cache, cache_lens, y);
}

MHA_API int mha_run_cross(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                          const mha_value *context, int kv_seq_len, const int32_t *kv_lens,
                          mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_cross");
  mha::g_forwarded = true;
  return r->run_cross(handle, x, batch, seq_len, context, kv_seq_len, kv_lens, y);
}

MHA_API int mha_run_cached_varlen(mha_handle *handle, const mha_value *x, int total,
                                  const int32_t *cu_seqlens, mha_cache_value *k_cache,
                                  mha_cache_value *v_cache, int32_t *cache_lens, mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_cached_varlen");
  mha::g_forwarded = true;
  return r->run_cached_varlen(handle, x, total, cu_seqlens, k_cache, v_cache, cache_lens, y);
}

MHA_API int mha_run_paged(mha_handle *handle, const mha_value *x, int num_seqs, int total,
                          const int32_t *cu_seqlens, mha_cache_value *k_pool,
                          mha_cache_value *v_pool, int num_blocks,
                          const int32_t *block_tables, int32_t *cache_lens, mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_paged");
  mha::g_forwarded = true;
  return r->run_paged(handle, x, num_seqs, total, cu_seqlens, k_pool, v_pool, num_blocks,
                      block_tables, cache_lens, y);
}

MHA_API int mha_run_varlen(mha_handle *handle, const mha_value *x, const int32_t *cu_seqlens,
                           int n_seqs, const mha_value *context, const int32_t *cu_seqlens_k,
                           mha_value *y) {
  const mha::Runtime *r = mha::runtime();
  if (r == nullptr || handle == nullptr) return mha::no_handle("mha_run_varlen");
  mha::g_forwarded = true;
  return r->run_varlen(handle, x, cu_seqlens, n_seqs, context, cu_seqlens_k, y);
}

MHA_API void mha_destroy(mha_handle *handle) {
  const mha::Runtime *r = mha::runtime();
  if (r != nullptr && handle != nullptr) r->destroy(handle);
}

MHA_API const char *mha_last_error(void) {
  const mha::Runtime *r = mha::g_forwarded ? mha::runtime() : nullptr;
  return r ? r->last_error() : mha::g_message.c_str();
}

MHA_API int mha_last_error_code(void) {
  const mha::Runtime *r = mha::g_forwarded ? mha::runtime() : nullptr;
  return r ? r->last_error_code() : mha::g_code;
}
#else   // the runtime proper (MHA_IMPL), or a CUDA artifact's libmha.so

// Allocates the buffers and describes them as DLTensors.
int allocate(mha_handle *h) {
  h->tensors.resize(size_t(kNumBuffers));
  h->data.assign(size_t(kNumBuffers), nullptr);
  h->shapes.assign(size_t(kNumBuffers) * kMaxDims, 0);
  for (int i = 0; i < kNumBuffers; ++i) {
    const BufferSpec &b = kBuffers[i];
    if (b.role != kState) h->data[size_t(i)] = device_alloc(size_t(b.nbytes));
    if (b.role != kState && h->data[size_t(i)] == nullptr)
      return fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory (" + std::to_string(b.nbytes) +
                                         " bytes for buffer " + b.name + ")");
    DLTensor &t = h->tensors[size_t(i)];
    t.data = h->data[size_t(i)];
    t.device = device();
    t.ndim = b.ndim;
    t.dtype = DLDataType{b.code, b.bits, 1};
    t.shape = &h->shapes[size_t(i) * kMaxDims];
    for (int d = 0; d < b.ndim; ++d) t.shape[d] = b.shape[d];
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  return MHA_OK;
}

// Checks kernel.so and weights.safetensors (size and sha256) and copies the parameters into
// their buffers while hashing weights.safetensors (at the byte offsets baked into kBuffers).
int verify_files(const std::string &dir, mha_handle *h) {
  for (int i = 0; i < kNumFiles; ++i)   // sizes first: a truncated copy fails before any read
    if (check_size(dir + "/" + kFiles[i].name, kFiles[i].size) != MHA_OK) return g_code;
  auto ignore = [](int64_t, const uint8_t *, size_t) {};
  bool copied = true;
  auto load_params = [h, &copied](int64_t at, const uint8_t *bytes, size_t n) {
    const int64_t end = at + int64_t(n);
    for (int i = 0; i < kNumBuffers; ++i) {
      const BufferSpec &b = kBuffers[i];
      const int64_t lo = b.offset > at ? b.offset : at;
      const int64_t hi = b.offset + b.nbytes < end ? b.offset + b.nbytes : end;
      if (b.role == kParam && lo < hi)
        copied &= copy_to_device(static_cast<uint8_t *>(h->data[size_t(i)]) + (lo - b.offset),
                                 bytes + (lo - at), size_t(hi - lo));
    }
  };
  for (int i = 0; i < kNumFiles; ++i) {
    if (kFiles[i].sha256 == nullptr) continue;
    const std::string path = dir + "/" + kFiles[i].name;
    const int rc = i == kParamsFile ? verify_file(path, kFiles[i], load_params)
                                    : verify_file(path, kFiles[i], ignore);
    if (rc != MHA_OK) return rc;
  }
  if (!copied) return fail(MHA_ERR_RUNTIME, "mha_create: copying the parameters to the device "
                                            "failed");
  return MHA_OK;
}

#if MHA_DEVICE_CUDA
// Opens the GPU (MHA_CUDA_DEVICE, default 0): the driver, its compute capability against the
// kernels' architecture, the primary context made current.
int open_device(mha_handle *h) {
  std::string why;
  const cu::Driver &d = cu::driver(&why);
  if (!why.empty()) return fail(MHA_ERR_DEVICE, "mha_create: " + why);
  g_driver = &d;
  int count = 0;
  const char *env = std::getenv("MHA_CUDA_DEVICE");
  const int ordinal = env && *env ? std::atoi(env) : 0;
  if (d.DeviceGetCount(&count) != cu::kSuccess || count < 1)
    return fail(MHA_ERR_DEVICE, "mha_create: the CUDA driver sees no GPU");
  if (ordinal < 0 || ordinal >= count)
    return fail(MHA_ERR_DEVICE, "mha_create: MHA_CUDA_DEVICE=" + std::string(env) +
                                    " but this machine has GPUs 0.." + std::to_string(count - 1));
  int major = 0, minor = 0, optin = 0;
  if (d.DeviceGet(&h->gpu, ordinal) != cu::kSuccess ||
      d.DeviceGetAttribute(&major, cu::kAttrComputeCapabilityMajor, h->gpu) != cu::kSuccess ||
      d.DeviceGetAttribute(&minor, cu::kAttrComputeCapabilityMinor, h->gpu) != cu::kSuccess ||
      d.DeviceGetAttribute(&optin, cu::kAttrMaxSharedPerBlockOptin, h->gpu) != cu::kSuccess)
    return fail(MHA_ERR_DEVICE, "mha_create: cannot query GPU " + std::to_string(ordinal));
  if (major * 10 + minor < kComputeCapability)
    return fail(MHA_ERR_DEVICE,
                "mha_create: GPU " + std::to_string(ordinal) + " has compute capability " +
                    std::to_string(major) + "." + std::to_string(minor) +
                    ", older than the kernels' sm_" + std::to_string(kComputeCapability) +
                    ": rebuild the artifact for it (mhagen build --target cuda-sm80 ...)");
  for (int k = 0; k < kNumLaunches; ++k)
    if (kLaunches[k].static_shared + kLaunches[k].dynamic_shared > unsigned(optin))
      return fail(MHA_ERR_DEVICE,
                  "mha_create: kernel " + std::string(kLaunches[k].entry) + " needs " +
                      std::to_string(kLaunches[k].static_shared + kLaunches[k].dynamic_shared) +
                      " bytes of shared memory; this GPU allows " + std::to_string(optin));
  cu::Context context = nullptr;
  if (d.PrimaryCtxRetain(&context, h->gpu) != cu::kSuccess)
    return fail(MHA_ERR_DEVICE, "mha_create: cannot open a context on GPU " +
                                    std::to_string(ordinal));
  h->context = context;
  if (d.CtxSetCurrent(context) != cu::kSuccess)
    return fail(MHA_ERR_DEVICE, "mha_create: cannot make GPU " + std::to_string(ordinal) +
                                    "'s context current");
  return MHA_OK;
}

// Loads kernels.fatbin (checked by verify_files) and finds each launch's function.
int load_kernels(const std::string &dir, mha_handle *h) {
  const std::string fpath = dir + "/" + kFiles[kDeviceFileIndex].name;
  std::string image;
  if (read_small_file(fpath, &image) != MHA_OK) return g_code;
  const cu::Result rc = g_driver->ModuleLoadData(&h->module, image.data());
  if (rc != cu::kSuccess)
    return fail(MHA_ERR_RUNTIME, "mha_create: the CUDA driver cannot load " + fpath + " (" +
                                     cu::error_text(*g_driver, rc) + "); a driver older than " +
                                     "the CUDA toolkit that built it?");
  for (int k = 0; k < kNumLaunches; ++k) {
    cu::Function f = nullptr;
    if (g_driver->ModuleGetFunction(&f, h->module, kLaunches[k].entry) != cu::kSuccess)
      return fail(MHA_ERR_CORRUPT, "mha_create: " + fpath + " has no kernel '" +
                                       kLaunches[k].entry + "'; rebuild the artifact");
    if (kLaunches[k].static_shared + kLaunches[k].dynamic_shared > cu::kStaticSharedLimit &&
        g_driver->FuncSetAttribute(f, cu::kFuncAttrMaxDynamicShared,
                                   int(kLaunches[k].dynamic_shared)) != cu::kSuccess)
      return fail(MHA_ERR_DEVICE, "mha_create: kernel " + std::string(kLaunches[k].entry) +
                                      " cannot have its shared memory on this GPU");
    h->functions.push_back(f);
  }
  return MHA_OK;
}

// Launches kLaunches[first, last) on `stream` (asynchronous).
int launch(mha_handle *h, int first, int last, cu::Stream stream, const std::string &fn) {
  for (int k = first; k < last; ++k) {
    const LaunchSpec &l = kLaunches[k];
    cu::DevicePtr pointers[kMaxLaunchArgs];
    void *params[kMaxLaunchArgs + 1];   // NULL after the last (the driver reads l.nargs)
    for (int a = 0; a < l.nargs; ++a) {
      pointers[a] = dptr(h->tensors[size_t(l.args[a])].data);
      params[a] = &pointers[a];
    }
    params[l.nargs] = nullptr;
    const cu::Result rc = g_driver->LaunchKernel(
        h->functions[size_t(k)], l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1],
        l.block[2], l.dynamic_shared, stream, params, nullptr);
    if (rc != cu::kSuccess)
      return fail(MHA_ERR_RUNTIME, fn + ": launching " + l.entry + " failed (" +
                                       cu::error_text(*g_driver, rc) + ")");
  }
  return MHA_OK;
}
#else
// Finds kernels[0, n) in kernel.so and binds each one's arguments.
int bind_kernels(const std::string &kpath, mha_handle *h, const KernelSpec *kernels, int n,
                 std::vector<tvm::ffi::Function> *functions,
                 std::vector<std::vector<tvm::ffi::AnyView>> *bound) {
  for (int k = 0; k < n; ++k) {
    auto f = h->module.value()->GetFunction(kernels[k].name);
    if (!f.has_value())
      return fail(MHA_ERR_CORRUPT, "mha_create: " + kpath + " has no kernel '" +
                                       kernels[k].name + "'; rebuild the artifact");
    functions->push_back(*f);
    std::vector<tvm::ffi::AnyView> args;
    for (int a = 0; a < kernels[k].nargs; ++a) {
      const int i = kernels[k].args[a];   // a buffer, or a scalar set per call
      args.push_back(i >= 0 ? tvm::ffi::AnyView(&h->tensors[size_t(i)])
                            : tvm::ffi::AnyView(int64_t(0)));
    }
    bound->push_back(std::move(args));
  }
  return MHA_OK;
}

// Loads kernel.so and binds each kernel's arguments (a packed call's too).
int load_kernels(const std::string &dir, mha_handle *h) {
  const std::string kpath = dir + "/kernel.so";
  try {
    h->module = tvm::ffi::Module::LoadFromFile(kpath);
    if (bind_kernels(kpath, h, kKernels, kNumKernels, &h->kernels, &h->args) != MHA_OK ||
        bind_kernels(kpath, h, kPackedKernels, kNumPackedKernels, &h->packed_kernels,
                     &h->packed_args) != MHA_OK)
      return g_code;
  } catch (const std::exception &e) {
    return fail(MHA_ERR_RUNTIME, "mha_create: TVM could not load " + kpath + ": " + e.what());
  }
  return MHA_OK;
}
#endif

mha_handle *create(const char *dir_c) {
  clear_error();
  if (check_directory(dir_c) != MHA_OK) return nullptr;
  const std::string dir(dir_c);
  const std::string missing = missing_cpu_features();
  if (!missing.empty()) {
    fail(MHA_ERR_TARGET, "mha_create: this CPU lacks" + missing + " that the kernels in " +
                             dir + " need; rebuild the artifact for this machine "
                             "(mhagen build --target x86 on x86, arm-neon on aarch64)");
    return nullptr;
  }
  std::unique_ptr<mha_handle> h(new (std::nothrow) mha_handle());
  if (!h) {
    fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory");
    return nullptr;
  }
#if MHA_DEVICE_CUDA
  if (open_device(h.get()) != MHA_OK) return nullptr;
#else
  prepare_threads();
#endif
  if (allocate(h.get()) != MHA_OK || verify_files(dir, h.get()) != MHA_OK) return nullptr;
  if (load_kernels(dir, h.get()) != MHA_OK) return nullptr;
  return h.release();
}

// The per-call extras of mha_run_padded / mha_run_cached / mha_run_cross (all null for
// mha_run).
struct Extras {
  const char *fn;
  const int32_t *lengths;      // key lengths, or the tokens already cached
  mha_cache_value *k_cache;
  mha_cache_value *v_cache;
  const mha_value *context = nullptr;   // cross-attention: keys' and values' input
  int kv_seq_len = 0;
};

// The entry point an artifact runs with: 0 mha_run, 1 mha_run_padded, 2 mha_run_cached,
// 3 mha_run_cross (whose kv_lens are required when kLengthsKind is 1, else NULL).
constexpr int kEntry = kContextIndex >= 0 ? 3 : kLengthsKind;

// Symbolic-length artifacts: the buffers' symbolic axes and the kernels' scalar arguments
// for a call of batch x seq_len (rows batch * seq_len, dense; a cross-attention's context
// batch * kv_seq_len rows; a packed call: batch 1, its tile table `tiles` rows).
void set_call_shape(mha_handle *h, int64_t batch, int64_t seq_len, int64_t kv_seq_len,
                    int64_t tiles) {
  const int64_t rows = batch * seq_len, kv_rows = batch * kv_seq_len;
  const int64_t values[] = {0, batch, rows, (rows + kRowTile - 1) / kRowTile * kRowTile,
                            kv_rows, (kv_rows + kRowTile - 1) / kRowTile * kRowTile, tiles};
  for (int i = 0; i < kNumBuffers; ++i)
    if (kBuffers[i].sym_kind != kFixed && kBuffers[i].sym_kind != kDimPoolBlocks)
      h->shapes[size_t(i) * kMaxDims + size_t(kBuffers[i].sym_axis)] =
          values[kBuffers[i].sym_kind];
#if !MHA_DEVICE_CUDA   // (CUDA artifacts have fixed shapes)
  const int64_t scalars[] = {batch, seq_len, kv_seq_len};   // -1 - ScalarArg
  for (int k = 0; k < kNumKernels; ++k)
    for (int a = 0; a < kKernels[k].nargs; ++a)
      if (kKernels[k].args[a] < 0)
        h->args[size_t(k)][size_t(a)] = tvm::ffi::AnyView(scalars[-1 - kKernels[k].args[a]]);
  for (int k = 0; k < kNumPackedKernels; ++k)
    for (int a = 0; a < kPackedKernels[k].nargs; ++a)
      if (kPackedKernels[k].args[a] < 0)
        h->packed_args[size_t(k)][size_t(a)] =
            tvm::ffi::AnyView(scalars[-1 - kPackedKernels[k].args[a]]);
#endif
}

// Checks the lengths (and caches) a call of batch x seq_len passes against what this
// artifact takes.
int check_extras(const Extras &e, int kind_given, int64_t batch, int64_t seq_len) {
  const std::string fn = e.fn;
  static const char *const kNames[] = {"mha_run", "mha_run_padded", "mha_run_cached",
                                       "mha_run_cross"};
  if (kind_given != kEntry)
    return fail(MHA_ERR_ARGUMENT, fn + ": this artifact runs with " + kNames[kEntry] +
                                      (kEntry == 3   ? " (a cross-attention layer)"
                                       : kEntry == 1 ? " (a layer with key padding)"
                                       : kEntry == 2 ? " (a decoding layer, K/V cache)"
                                                     : " (no lengths, no cache)"));
  if (kEntry == 3) {
    if (e.context == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": context is NULL");
    if (kSymbolicKvSeq ? e.kv_seq_len < 1 || e.kv_seq_len > kKvSeqLen
                       : e.kv_seq_len != kKvSeqLen)
      return fail(MHA_ERR_SHAPE, fn + ": got kv_seq_len=" + std::to_string(e.kv_seq_len) +
                                     ", but this artifact runs kv_seq_len " +
                                     (kSymbolicKvSeq ? "1.." : "") + std::to_string(kKvSeqLen) +
                                     " (MHA_KV_SEQ_LEN)");
    if (kLengthsKind == 0 && e.lengths != nullptr)
      return fail(MHA_ERR_ARGUMENT, fn + ": this layer has no key padding: pass kv_lens NULL");
  }
  if (kLengthsKind == 0) return MHA_OK;
  if (e.lengths == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": the lengths are NULL");
  const int64_t most = kLengthsKind == 2 ? kMaxLen - seq_len
                       : kEntry == 3       ? e.kv_seq_len
                                           : seq_len;
  for (int64_t b = 0; b < batch; ++b)
    if (e.lengths[b] < 0 || e.lengths[b] > most)
      return fail(MHA_ERR_ARGUMENT,
                  fn + ": length " + std::to_string(e.lengths[b]) + " of batch row " +
                      std::to_string(b) + " is outside 0.." + std::to_string(most) +
                      (kLengthsKind == 1 ? (kEntry == 3 ? " (kv_seq_len)" : " (seq_len)")
                                         : " (the cache holds " + std::to_string(kMaxLen) +
                                               " tokens; reset it or build a larger kv_cache)"));
  if (kLengthsKind == 2) {
    if (e.k_cache == nullptr || e.v_cache == nullptr)
      return fail(MHA_ERR_NULL_ARGUMENT, fn + ": k_cache or v_cache is NULL");
    if (!usable_in_place(e.k_cache) || !usable_in_place(e.v_cache))
      return fail(MHA_ERR_ARGUMENT, fn + ": k_cache and v_cache must be 64-byte aligned "
                                         "(aligned_alloc(64, MHA_CACHE_SIZE * sizeof(float)))");
  }
  return MHA_OK;
}

// Runs the kernels (packed: kPackedKernels) on x (rows rows) into y, the call's shape set:
// x, the lengths (lengths_n of them) and the context (context_rows rows) staged or used in
// place, the caches bound, y written directly where it can be.
int execute(mha_handle *h, const std::string &fn, const mha_value *x, int64_t rows,
            mha_value *y, const Extras &e, int64_t lengths_n, int64_t context_rows,
            bool packed) {
  bool copied = true;
  void *in_scratch = h->data[size_t(kInputIndex)];
  void *out_scratch = h->data[size_t(kOutputIndex)];
  DLTensor &in = h->tensors[size_t(kInputIndex)];
  DLTensor &out = h->tensors[size_t(kOutputIndex)];
  if (usable_in_place(x)) {
    in.data = const_cast<mha_value *>(x);   // the kernels only read their input
  } else {
    copied &= copy_to_device(in_scratch, x, size_t(rows * kDModel) * sizeof(mha_value));
  }
  if (kLengthsIndex >= 0 && e.lengths != nullptr)
    copied &= copy_to_device(h->data[size_t(kLengthsIndex)], e.lengths,
                             size_t(lengths_n) * sizeof(int32_t));
  DLTensor *context = kContextIndex >= 0 ? &h->tensors[size_t(kContextIndex)] : nullptr;
  if (context != nullptr) {
    if (usable_in_place(e.context))
      context->data = const_cast<mha_value *>(e.context);   // only read
    else
      copied &= copy_to_device(context->data, e.context,
                               size_t(context_rows * kKvDim) * sizeof(mha_value));
  }
  if (kKCacheIndex >= 0) {
    h->tensors[size_t(kKCacheIndex)].data = e.k_cache;
    h->tensors[size_t(kVCacheIndex)].data = e.v_cache;
  }
  const bool direct = kOutCols == kOutDModel && usable_in_place(y);
  if (direct) out.data = y;
  int rc = copied ? MHA_OK : fail(MHA_ERR_RUNTIME, fn + ": copying the input to the device "
                                                        "failed");
#if MHA_DEVICE_CUDA
  (void)packed;   // (CUDA artifacts take no packed calls)
  if (rc == MHA_OK) rc = launch(h, 0, kNumLaunches, nullptr, fn);   // the legacy stream
#else
  auto &kernels = packed ? h->packed_kernels : h->kernels;
  auto &args = packed ? h->packed_args : h->args;
  try {
    for (size_t k = 0; rc == MHA_OK && k < kernels.size(); ++k) {
      tvm::ffi::Any result;
      kernels[k].CallPacked(args[k].data(), int32_t(args[k].size()), &result);
    }
  } catch (const std::exception &ex) {
    rc = fail(MHA_ERR_RUNTIME, fn + ": a kernel failed: " + ex.what());
  }
#endif
  in.data = in_scratch;
  out.data = out_scratch;
  if (context != nullptr) context->data = h->data[size_t(kContextIndex)];
  if (kKCacheIndex >= 0) {
    h->tensors[size_t(kKCacheIndex)].data = nullptr;
    h->tensors[size_t(kVCacheIndex)].data = nullptr;
  }
  if (rc == MHA_OK && !direct) {   // (CUDA: waits for the kernels, reports their errors)
    const mha_value *src = static_cast<const mha_value *>(out_scratch);
    if (kOutCols == kOutDModel)
      copied = copy_to_host(y, src, size_t(rows * kOutDModel) * sizeof(mha_value));
    for (int64_t r = 0; kOutCols != kOutDModel && r < rows; ++r)
      copied &= copy_to_host(y + r * kOutDModel, src + r * kOutCols,
                             size_t(kOutDModel) * sizeof(mha_value));
    if (!copied)
      rc = fail(MHA_ERR_RUNTIME, fn + ": a kernel or copying the output back failed" +
                                     device_error());
  }
  return rc;
}

int run(mha_handle *h, const mha_value *x, int batch, int seq_len, mha_value *y, const Extras &e,
        int kind_given) {
  clear_error();
  const std::string fn = e.fn;
  if (h == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT,
                fn + ": handle is NULL (did mha_create fail? see mha_last_error())");
  if (x == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": x is NULL");
  if (y == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": y is NULL");
  const bool batch_ok = kSymbolicBatch ? batch >= 1 && batch <= kBatch : batch == kBatch;
  const bool seq_ok = kSymbolicSeq ? seq_len >= 1 && seq_len <= kSeqLen : seq_len == kSeqLen;
  if ((kSymbolicBatch || kSymbolicSeq) && !(batch_ok && seq_ok))
    return fail(MHA_ERR_SHAPE,
                fn + ": got batch=" + std::to_string(batch) + ", seq_len=" +
                    std::to_string(seq_len) + "; this artifact runs batch " +
                    (kSymbolicBatch ? "1.." : "") + std::to_string(kBatch) + " and seq_len " +
                    (kSymbolicSeq ? "1.." : "") + std::to_string(kSeqLen) +
                    " (build a larger one: mhagen build --max-seq-len N ...)");
  if (!(batch_ok && seq_ok))
    return fail(MHA_ERR_SHAPE,
                fn + ": got batch=" + std::to_string(batch) + ", seq_len=" +
                    std::to_string(seq_len) + ", but this artifact is compiled for batch=" +
                    std::to_string(kBatch) + ", seq_len=" + std::to_string(kSeqLen) +
                    " only (x is " MHA_DTYPE " [" + std::to_string(kBatch) + ", " +
                    std::to_string(kSeqLen) + ", " + std::to_string(kDModel) +
                    "]); build another artifact: mhagen build --batch " +
                    std::to_string(batch) + " --seq-len " + std::to_string(seq_len) + " ...");
  if (check_extras(e, kind_given, batch, seq_len) != MHA_OK) return g_code;
  std::lock_guard<std::mutex> lock(h->mutex);
#if MHA_DEVICE_CUDA
  if (g_driver->CtxSetCurrent(h->context) != cu::kSuccess)
    return fail(MHA_ERR_DEVICE, fn + ": cannot make the GPU's context current");
#endif
  if (kSymbolicBatch || kSymbolicSeq || kSymbolicKvSeq)
    set_call_shape(h, batch, seq_len, e.kv_seq_len, 1);
  const int rc = execute(h, fn, x, int64_t(batch) * seq_len, y, e, batch,
                         int64_t(batch) * e.kv_seq_len, false);
  if (rc == MHA_OK && kLengthsKind == 2) {
    int32_t *lens = const_cast<int32_t *>(e.lengths);
    for (int64_t b = 0; b < batch; ++b) lens[b] += int32_t(seq_len);
  }
  return rc;
}

// Checks a packed call's offsets (n + 1 of them, named `name`): 0 first, never decreasing,
// each sequence at most `longest` rows and all at most `most`; *total gets the last.
int check_offsets(const std::string &fn, const char *name, const int32_t *cu, int n,
                  int64_t longest, int64_t most, int64_t *total) {
  if (cu == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": " + name + " is NULL");
  if (cu[0] != 0)
    return fail(MHA_ERR_ARGUMENT, fn + ": " + name + "[0] is " + std::to_string(cu[0]) +
                                      "; the offsets start at 0");
  for (int i = 0; i < n; ++i) {
    const int64_t len = int64_t(cu[i + 1]) - cu[i];
    if (len < 0)
      return fail(MHA_ERR_ARGUMENT, fn + ": " + name + " must never decrease: entry " +
                                        std::to_string(i + 1) + " (" +
                                        std::to_string(cu[i + 1]) + ") is below entry " +
                                        std::to_string(i) + " (" + std::to_string(cu[i]) + ")");
    if (len > longest)
      return fail(MHA_ERR_SHAPE, fn + ": sequence " + std::to_string(i) + " has " +
                                     std::to_string(len) + " rows (" + name +
                                     "); this artifact runs sequences of at most " +
                                     std::to_string(longest));
  }
  *total = cu[n];
  if (*total > most)
    return fail(MHA_ERR_SHAPE, fn + ": " + name + " ends at " + std::to_string(*total) +
                                   "; this artifact packs at most " + std::to_string(most) +
                                   " rows (build a larger one: mhagen build --max-batch B ...)");
  return MHA_OK;
}

int run_varlen(mha_handle *h, const mha_value *x, const int32_t *cu, int n_seqs,
               const mha_value *context, const int32_t *cu_k, mha_value *y) {
  clear_error();
  const std::string fn = "mha_run_varlen";
  if (h == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT,
                fn + ": handle is NULL (did mha_create fail? see mha_last_error())");
  if (x == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": x is NULL");
  if (y == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": y is NULL");
  if (kNumPackedKernels == 0 || kTilesIndex < 0)
    return fail(MHA_ERR_ARGUMENT, fn + ": this artifact takes no packed calls (MHA_PACKED 0): "
                                       "build the layer for any length (mhagen build "
                                       "--max-seq-len N) to pack sequences");
  if (n_seqs < 1)
    return fail(MHA_ERR_ARGUMENT, fn + ": n_seqs is " + std::to_string(n_seqs) +
                                      "; a packed call holds at least one sequence");
  int64_t total = 0, total_kv = 0;
  if (check_offsets(fn, "cu_seqlens", cu, n_seqs, kSeqLen, kBatch * kSeqLen, &total) != MHA_OK)
    return g_code;
  if (kContextIndex >= 0) {
    if (context == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": context is NULL");
    if (check_offsets(fn, "cu_seqlens_k", cu_k, n_seqs, kKvSeqLen, kBatch * kKvSeqLen,
                      &total_kv) != MHA_OK)
      return g_code;
    for (int i = 0; i < n_seqs; ++i)
      if (cu[i + 1] > cu[i] && cu_k[i + 1] == cu_k[i])
        return fail(MHA_ERR_ARGUMENT, fn + ": sequence " + std::to_string(i) +
                                          " has queries but no context rows (cu_seqlens_k)");
  } else if (context != nullptr || cu_k != nullptr) {
    return fail(MHA_ERR_ARGUMENT, fn + ": this is not a cross-attention layer: pass context "
                                       "and cu_seqlens_k NULL");
  }
  if (total == 0) return MHA_OK;   // every sequence empty: no row to write
  std::lock_guard<std::mutex> lock(h->mutex);
  // the tile table (mhagen/packed.py tile_table): each sequence's query tiles, paired light
  // with heavy (0, n-1, 1, n-2, ...), and each token's position in its own sequence
  int32_t *tiles = static_cast<int32_t *>(h->data[size_t(kTilesIndex)]);
  int32_t *positions =
      kPositionsIndex >= 0 ? static_cast<int32_t *>(h->data[size_t(kPositionsIndex)]) : nullptr;
  int64_t n_tiles = 0;
  for (int s = 0; s < n_seqs; ++s) {
    const int32_t len = cu[s + 1] - cu[s];
    const int32_t n = int32_t((len + kPackedQTile - 1) / kPackedQTile);
    for (int32_t i = 0; i < n; ++i, ++n_tiles) {
      const int32_t odd = i % 2;
      int32_t *row = tiles + 5 * n_tiles;
      row[0] = cu[s], row[1] = len;
      row[2] = kContextIndex >= 0 ? cu_k[s] : cu[s];
      row[3] = kContextIndex >= 0 ? cu_k[s + 1] - cu_k[s] : len;
      row[4] = odd * (n - 1) + (1 - 2 * odd) * (i / 2);
    }
    for (int32_t t = 0; positions != nullptr && t < len; ++t) positions[cu[s] + t] = t;
  }
  set_call_shape(h, 1, total, total_kv, n_tiles);
  Extras e{fn.c_str(), nullptr, nullptr, nullptr};
  e.context = context;
  return execute(h, fn, x, total, y, e, 1, total_kv, true);
}

#if MHA_DEVICE_CUDA
static_assert(kOutCols == kOutDModel, "a CUDA artifact's output buffer is the caller's y");

// mha_run_device / mha_run_kernel_device: the caller's device arrays x and y, kernels
// [first, last) launched on `stream` (asynchronous: no copy, no wait).
int run_device(mha_handle *h, const mha_value *x, mha_value *y, void *stream, int first,
               int last, const std::string &fn) {
  clear_error();
  if (h == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT,
                fn + ": handle is NULL (did mha_create fail? see mha_last_error())");
  if (x == nullptr || y == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": x or y is NULL");
  if (kEntry != 0)
    return fail(MHA_ERR_ARGUMENT, fn + ": this layer takes lengths or a context: run it with "
                                       "mha_run_padded / mha_run_cross (host arrays)");
  if (first < 0 || last > kNumLaunches || first >= last)
    return fail(MHA_ERR_ARGUMENT, fn + ": kernel " + std::to_string(first) + " is not one of "
                                       "0.." + std::to_string(kNumLaunches - 1) +
                                       " (mha_num_kernels())");
  std::lock_guard<std::mutex> lock(h->mutex);
  if (g_driver->CtxSetCurrent(h->context) != cu::kSuccess)
    return fail(MHA_ERR_DEVICE, fn + ": cannot make the GPU's context current");
  DLTensor &in = h->tensors[size_t(kInputIndex)];
  DLTensor &out = h->tensors[size_t(kOutputIndex)];
  in.data = const_cast<mha_value *>(x);   // only read
  out.data = y;
  const int rc = launch(h, first, last, static_cast<cu::Stream>(stream), fn);
  in.data = h->data[size_t(kInputIndex)];
  out.data = h->data[size_t(kOutputIndex)];
  return rc;
}
#endif

// ---- decoding calls with each row's own new tokens, and paged caches -------------------------
// The arguments of mha_run_cached (packed artifacts), mha_run_cached_varlen, mha_run_paged.
struct DecodeCall {
  const char *fn;
  bool paged;                   // called as mha_run_paged
  int rows;                     // the call's rows: cache rows, or sequences of the pool
  int total;                    // new tokens in all (x's and y's rows), with cu_seqlens
  const int32_t *cu_seqlens;    // [rows + 1], or nullptr: every row seq_len new tokens
  int seq_len;
  mha_cache_value *k_cache;     // the caches, or the pools
  mha_cache_value *v_cache;
  int num_blocks;               // paged: the pools' blocks
  const int32_t *block_tables;  // paged: [rows, kMaxBlocks]
  int32_t *cache_lens;          // [rows], advanced by each row's count on success
};

// Checks a decoding call against this artifact; fills counts (each row's new tokens).
int check_decode(const DecodeCall &c, std::vector<int64_t> *counts, int64_t *total) {
  const std::string fn = c.fn;
  if (kLengthsKind != 2)
    return fail(MHA_ERR_ARGUMENT, fn + ": this artifact is no decoding layer (no K/V cache)");
  const bool paged = kBlockTablesIndex >= 0, packed = kCuSeqlensIndex >= 0;
  if (c.paged != paged)
    return fail(MHA_ERR_ARGUMENT, fn + (paged ? ": this artifact reads a paged cache: run it "
                                                "with mha_run_paged"
                                              : ": this artifact reads a contiguous cache: run "
                                                "it with mha_run_cached / mha_run_cached_varlen"));
  if (c.cu_seqlens != nullptr && !packed)
    return fail(MHA_ERR_ARGUMENT, fn + ": each row's own new tokens (cu_seqlens) need an "
                                       "artifact built for any number (mhagen build --max-seq-len"
                                       " N, MHA_VARLEN 1); pass NULL");
  const int least = paged && packed ? 1 : kBatch;
  if (c.rows < least || c.rows > kBatch)
    return fail(MHA_ERR_SHAPE, fn + ": got " + std::to_string(c.rows) + " rows; this artifact "
                                    "runs " + (least < kBatch ? "1.." : "") +
                                    std::to_string(kBatch) + " (MHA_BATCH)");
  counts->assign(size_t(c.rows), c.seq_len);
  if (c.cu_seqlens != nullptr) {
    if (c.cu_seqlens[0] != 0 || c.cu_seqlens[c.rows] != c.total)
      return fail(MHA_ERR_ARGUMENT, fn + ": cu_seqlens must start at 0 and end at total (" +
                                        std::to_string(c.total) + "), got " +
                                        std::to_string(c.cu_seqlens[0]) + " .. " +
                                        std::to_string(c.cu_seqlens[c.rows]));
    for (int b = 0; b < c.rows; ++b) {
      if (c.cu_seqlens[b + 1] < c.cu_seqlens[b])
        return fail(MHA_ERR_ARGUMENT, fn + ": cu_seqlens must never decrease: entry " +
                                          std::to_string(b + 1) + " is below entry " +
                                          std::to_string(b));
      (*counts)[size_t(b)] = c.cu_seqlens[b + 1] - c.cu_seqlens[b];
    }
    *total = c.total;
  } else {
    if (packed ? c.seq_len < 1 || c.seq_len > kSeqLen : c.seq_len != kSeqLen)
      return fail(MHA_ERR_SHAPE, fn + ": got seq_len=" + std::to_string(c.seq_len) +
                                     "; this artifact runs " + (packed ? "1.." : "") +
                                     std::to_string(kSeqLen) + " (MHA_SEQ_LEN)");
    *total = int64_t(c.rows) * c.seq_len;
  }
  if (*total < 1 || *total > kBatch * kSeqLen)
    return fail(MHA_ERR_SHAPE, fn + ": the call has " + std::to_string(*total) + " new tokens; "
                                    "this artifact runs 1.." + std::to_string(kBatch * kSeqLen));
  if (c.cache_lens == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": the lengths are NULL");
  if (c.k_cache == nullptr || c.v_cache == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT, fn + ": k_cache or v_cache is NULL");
  if (!usable_in_place(c.k_cache) || !usable_in_place(c.v_cache))
    return fail(MHA_ERR_ARGUMENT, fn + ": the caches must be 64-byte aligned (aligned_alloc(64, "
                                       "...))");
  for (int b = 0; b < c.rows; ++b) {
    const int64_t held = c.cache_lens[b], n = (*counts)[size_t(b)];
    if (held < 0 || held + n > kMaxLen)
      return fail(MHA_ERR_ARGUMENT, fn + ": length " + std::to_string(held) + " of row " +
                                        std::to_string(b) + " is outside 0.." +
                                        std::to_string(kMaxLen - n) + " (the cache holds " +
                                        std::to_string(kMaxLen) + " tokens; " +
                                        std::to_string(n) + " new ones)");
  }
  if (!paged) return MHA_OK;
  if (c.num_blocks < 1) return fail(MHA_ERR_ARGUMENT, fn + ": num_blocks must be positive");
  if (c.block_tables == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": block_tables is NULL");
  // a contiguous cache's configuration has kBlockSize 0 (this code never runs there)
  constexpr int64_t block_size = kBlockSize > 0 ? kBlockSize : 1;
  for (int b = 0; b < c.rows; ++b) {
    const int64_t blocks = (c.cache_lens[b] + (*counts)[size_t(b)] + block_size - 1) / block_size;
    for (int64_t j = 0; j < blocks; ++j) {
      const int32_t block = c.block_tables[b * kMaxBlocks + j];
      if (block < 0 || block >= c.num_blocks)
        return fail(MHA_ERR_ARGUMENT, fn + ": block_tables[" + std::to_string(b) + "][" +
                                          std::to_string(j) + "] = " + std::to_string(block) +
                                          " is outside the pool's blocks 0.." +
                                          std::to_string(c.num_blocks - 1));
    }
  }
  return MHA_OK;
}

int run_decode(mha_handle *h, const mha_value *x, mha_value *y, const DecodeCall &c) {
  clear_error();
  const std::string fn = c.fn;
  if (h == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT,
                fn + ": handle is NULL (did mha_create fail? see mha_last_error())");
  if (x == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": x is NULL");
  if (y == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, fn + ": y is NULL");
#if MHA_DEVICE_CUDA
  return fail(MHA_ERR_ARGUMENT, fn + ": CUDA artifacts have no decoding layers");
#else
  std::vector<int64_t> counts;
  int64_t total = 0;
  if (check_decode(c, &counts, &total) != MHA_OK) return g_code;
  std::lock_guard<std::mutex> lock(h->mutex);
  if (kCuSeqlensIndex >= 0) set_call_shape(h, 1, total, 0, 1);   // packed: batch 1 x total rows
  void *in_scratch = h->data[size_t(kInputIndex)];
  void *out_scratch = h->data[size_t(kOutputIndex)];
  DLTensor &in = h->tensors[size_t(kInputIndex)];
  DLTensor &out = h->tensors[size_t(kOutputIndex)];
  if (usable_in_place(x))
    in.data = const_cast<mha_value *>(x);   // the kernels only read their input
  else
    std::memcpy(in_scratch, x, size_t(total * kDModel) * sizeof(mha_value));
  int32_t *lens = static_cast<int32_t *>(h->data[size_t(kLengthsIndex)]);
  for (int b = 0; b < kBatch; ++b) lens[b] = b < c.rows ? c.cache_lens[b] : 0;
  if (kCuSeqlensIndex >= 0) {   // rows past the call's: no tokens
    int32_t *cu = static_cast<int32_t *>(h->data[size_t(kCuSeqlensIndex)]);
    cu[0] = 0;
    for (int b = 0; b < kBatch; ++b)
      cu[b + 1] = int32_t(cu[b] + (b < c.rows ? counts[size_t(b)] : 0));
  }
  if (kBlockTablesIndex >= 0) {
    int32_t *tables = static_cast<int32_t *>(h->data[size_t(kBlockTablesIndex)]);
    std::memset(tables, 0, size_t(kBatch * kMaxBlocks) * sizeof(int32_t));
    std::memcpy(tables, c.block_tables, size_t(c.rows * kMaxBlocks) * sizeof(int32_t));
    for (int i : {kKCacheIndex, kVCacheIndex})   // the pools' size: the call's
      h->shapes[size_t(i) * kMaxDims] = c.num_blocks;
  }
  h->tensors[size_t(kKCacheIndex)].data = c.k_cache;
  h->tensors[size_t(kVCacheIndex)].data = c.v_cache;
  const bool direct = kOutCols == kOutDModel && usable_in_place(y);
  if (direct) out.data = y;
  int rc = MHA_OK;
  try {
    for (size_t k = 0; rc == MHA_OK && k < h->kernels.size(); ++k) {
      tvm::ffi::Any result;
      h->kernels[k].CallPacked(h->args[k].data(), int32_t(h->args[k].size()), &result);
    }
  } catch (const std::exception &ex) {
    rc = fail(MHA_ERR_RUNTIME, fn + ": a kernel failed: " + ex.what());
  }
  in.data = in_scratch;
  out.data = out_scratch;
  h->tensors[size_t(kKCacheIndex)].data = nullptr;
  h->tensors[size_t(kVCacheIndex)].data = nullptr;
  if (rc == MHA_OK && !direct) {
    const mha_value *src = static_cast<const mha_value *>(out_scratch);
    for (int64_t r = 0; r < total; ++r)
      std::memcpy(y + r * kOutDModel, src + r * kOutCols, size_t(kOutDModel) * sizeof(mha_value));
  }
  if (rc == MHA_OK)
    for (int b = 0; b < c.rows; ++b) c.cache_lens[b] += int32_t(counts[size_t(b)]);
  return rc;
#endif
}

// The C entry points' shared exception guard.
template <typename F>
int guarded(const char *fn, F &&body) {
  try {
    return body();
  } catch (const std::bad_alloc &) {
    return fail(MHA_ERR_NO_MEMORY, std::string(fn) + ": out of memory");
  } catch (const std::exception &ex) {
    return fail(MHA_ERR_RUNTIME, std::string(fn) + ": " + ex.what());
  } catch (...) {
    return fail(MHA_ERR_RUNTIME, std::string(fn) + ": unknown error");
  }
}

}  // namespace
}  // namespace mha

extern "C" {

MHA_API mha_handle *mha_create(const char *artifact_dir) {
  try {
    return mha::create(artifact_dir);
  } catch (const std::bad_alloc &) {
    mha::fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory");
  } catch (const std::exception &e) {
    mha::fail(MHA_ERR_RUNTIME, std::string("mha_create: ") + e.what());
  } catch (...) {
    mha::fail(MHA_ERR_RUNTIME, "mha_create: unknown error");
  }
  return nullptr;
}

MHA_API int mha_run(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                    mha_value *y) {
  return mha::guarded("mha_run", [&] {
    return mha::run(handle, x, batch, seq_len, y, {"mha_run", nullptr, nullptr, nullptr}, 0);
  });
}

MHA_API int mha_run_padded(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           const int32_t *kv_lens, mha_value *y) {
  return mha::guarded("mha_run_padded", [&] {
    return mha::run(handle, x, batch, seq_len, y,
                    {"mha_run_padded", kv_lens, nullptr, nullptr}, 1);
  });
}

MHA_API int mha_run_cached(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                           mha_cache_value *k_cache, mha_cache_value *v_cache,
                           int32_t *cache_lens, mha_value *y) {
  return mha::guarded("mha_run_cached", [&] {
    if (mha::config::kCuSeqlensIndex >= 0 || mha::config::kBlockTablesIndex >= 0)
      return mha::run_decode(handle, x, y, {"mha_run_cached", false, batch, 0, nullptr,
                                            seq_len, k_cache, v_cache, 0, nullptr, cache_lens});
    return mha::run(handle, x, batch, seq_len, y,
                    {"mha_run_cached", cache_lens, k_cache, v_cache}, 2);
  });
}

MHA_API int mha_run_cached_varlen(mha_handle *handle, const mha_value *x, int total,
                                  const int32_t *cu_seqlens, mha_cache_value *k_cache,
                                  mha_cache_value *v_cache, int32_t *cache_lens, mha_value *y) {
  return mha::guarded("mha_run_cached_varlen", [&] {
    if (cu_seqlens == nullptr)
      return mha::fail(MHA_ERR_NULL_ARGUMENT, "mha_run_cached_varlen: cu_seqlens is NULL");
    return mha::run_decode(handle, x, y, {"mha_run_cached_varlen", false, int(mha::config::kBatch),
                                          total, cu_seqlens, 0, k_cache, v_cache, 0, nullptr,
                                          cache_lens});
  });
}

MHA_API int mha_run_paged(mha_handle *handle, const mha_value *x, int num_seqs, int total,
                          const int32_t *cu_seqlens, mha_cache_value *k_pool,
                          mha_cache_value *v_pool, int num_blocks,
                          const int32_t *block_tables, int32_t *cache_lens, mha_value *y) {
  return mha::guarded("mha_run_paged", [&] {
    const int seq_len = cu_seqlens != nullptr || num_seqs < 1 ? 0 : total / num_seqs;
    if (cu_seqlens == nullptr && num_seqs >= 1 && total != num_seqs * seq_len)
      return mha::fail(MHA_ERR_SHAPE, "mha_run_paged: without cu_seqlens every sequence adds "
                                      "total / num_seqs tokens; " + std::to_string(total) +
                                      " is no multiple of " + std::to_string(num_seqs));
    return mha::run_decode(handle, x, y, {"mha_run_paged", true, num_seqs, total, cu_seqlens,
                                          seq_len, k_pool, v_pool, num_blocks, block_tables,
                                          cache_lens});
  });
}

MHA_API int mha_run_cross(mha_handle *handle, const mha_value *x, int batch, int seq_len,
                          const mha_value *context, int kv_seq_len, const int32_t *kv_lens,
                          mha_value *y) {
  return mha::guarded("mha_run_cross", [&] {
    mha::Extras e{"mha_run_cross", kv_lens, nullptr, nullptr};
    e.context = context;
    e.kv_seq_len = kv_seq_len;
    return mha::run(handle, x, batch, seq_len, y, e, 3);
  });
}

MHA_API int mha_run_varlen(mha_handle *handle, const mha_value *x, const int32_t *cu_seqlens,
                           int n_seqs, const mha_value *context, const int32_t *cu_seqlens_k,
                           mha_value *y) {
  return mha::guarded("mha_run_varlen", [&] {
    return mha::run_varlen(handle, x, cu_seqlens, n_seqs, context, cu_seqlens_k, y);
  });
}

#if MHA_DEVICE_CUDA
MHA_API int mha_run_device(mha_handle *handle, const mha_value *x, mha_value *y,
                           void *stream) {
  return mha::guarded("mha_run_device", [&] {
    return mha::run_device(handle, x, y, stream, 0, mha::config::kNumLaunches,
                           "mha_run_device");
  });
}

MHA_API int mha_run_kernel_device(mha_handle *handle, int kernel, const mha_value *x,
                                  mha_value *y, void *stream) {
  return mha::guarded("mha_run_kernel_device", [&] {
    return mha::run_device(handle, x, y, stream, kernel, kernel + 1, "mha_run_kernel_device");
  });
}
#endif

#endif  // MHA_LOADER

MHA_API int mha_num_kernels(void) { return mha::config::kNumKernels; }

MHA_API const char *mha_kernel_name(int kernel) {
  return kernel >= 0 && kernel < mha::config::kNumKernels ? mha::config::kKernels[kernel].name
                                                          : nullptr;
}

#if !MHA_LOADER
MHA_API void mha_destroy(mha_handle *handle) {
  try {
    delete handle;
  } catch (...) {
  }
}

MHA_API const char *mha_last_error(void) { return mha::g_message.c_str(); }

MHA_API int mha_last_error_code(void) { return mha::g_code; }
#endif

MHA_API const char *mha_status_name(int status) {
  switch (status) {
#define MHA_STATUS_CASE(name) \
  case name:                  \
    return #name;
    MHA_STATUS_LIST(MHA_STATUS_CASE)
#undef MHA_STATUS_CASE
    default:
      return "MHA_ERR_UNKNOWN";
  }
}

}  // extern "C"
