"""The fixed part of every generated C API source (C++17, `extern "C"` functions).

capi.py writes, in this order: a comment, `#include "mha.h"`, the artifact's tables (shape,
buffers, kernels, files with sizes and sha256, CPU features) and then BODY below, which only
reads those tables. Nothing here depends on the target: a cross compiler builds it unchanged.

Names the tables must define (see capi.py):
  kFormatVersion, kFormat, kContentHash, kBatch, kSeqLen, kDModel, kOutDModel, kRows, kOutCols,
  kInputIndex, kOutputIndex, kNumBuffers, kBuffers[], kNumKernels, kKernels[],
  kNumFiles, kFiles[], kParamsFile (index into kFiles or -1), missing_cpu_features().
"""

INCLUDES = r"""
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <sched.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace {

enum Role { kInput = 0, kParam = 1, kTemp = 2, kOutput = 3 };

struct BufferSpec {
  const char *name;
  int role;
  uint8_t code;          // DLDataTypeCode
  uint8_t bits;
  int ndim;
  int64_t shape[8];
  int64_t nbytes;
  int64_t offset;        // params: byte offset in params.bin
};

struct KernelSpec {
  const char *name;
  int nargs;
  const int *args;       // indices into kBuffers
};

struct FileSpec {
  const char *name;
  int64_t size;
  const char *sha256;    // hex
};
"""

BODY = r"""
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
    std::memcpy(block_, data, n);
    fill_ += n;
  }
  std::string hex() {
    uint64_t bits = length_ * 8;
    uint8_t pad[72] = {0x80};
    size_t padlen = (fill_ < 56 ? 56 : 120) - fill_;
    for (int i = 0; i < 8; ++i) pad[padlen + i] = uint8_t(bits >> (56 - 8 * i));
    update(pad, padlen + 8);
    static const char digits[] = "0123456789abcdef";
    std::string out(64, '0');
    for (int i = 0; i < 32; ++i) {
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
// Reads `path` into `out`; expected < 0 means any size (up to 64 MiB, for the manifest).
int read_file(const std::string &path, int64_t expected, std::string *out) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0)
    return fail(MHA_ERR_NOT_FOUND, "mha_create: " + path + " is missing (" +
                                       std::strerror(errno) +
                                       "); copy the whole artifact directory");
  if (!S_ISREG(st.st_mode))
    return fail(MHA_ERR_NOT_FOUND, "mha_create: " + path + " is not a regular file");
  int64_t size = int64_t(st.st_size);
  if (expected >= 0 && size != expected)
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " has " + std::to_string(size) +
                                     " bytes, expected " + std::to_string(expected) + " (" +
                                     (size < expected ? "truncated" : "replaced or corrupted") +
                                     "); rebuild the artifact or copy it again");
  if (expected < 0 && size > (int64_t(64) << 20))
    return fail(MHA_ERR_CORRUPT, "mha_create: " + path + " is implausibly large");
  std::FILE *f = std::fopen(path.c_str(), "rb");
  if (!f)
    return fail(MHA_ERR_NOT_FOUND,
                "mha_create: cannot open " + path + " (" + std::strerror(errno) + ")");
  out->resize(size_t(size));
  size_t got = size ? std::fread(&(*out)[0], 1, size_t(size), f) : 0;
  std::fclose(f);
  if (got != size_t(size))
    return fail(MHA_ERR_CORRUPT, "mha_create: could not read all of " + path);
  return MHA_OK;
}

std::string sha256_hex(const std::string &bytes) {
  Sha256 h;
  h.update(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size());
  return h.hex();
}

// ---- manifest.json: find a top-level key's value without a JSON parser ----------------------
size_t top_level_value(const std::string &s, const char *key) {
  const size_t n = s.size(), keylen = std::strlen(key);
  int depth = 0;
  for (size_t i = 0; i < n;) {
    char c = s[i];
    if (c == '"') {
      size_t start = ++i;
      while (i < n && s[i] != '"') i += (s[i] == '\\') ? 2 : 1;
      if (i >= n) return std::string::npos;
      size_t end = i++;
      if (depth == 1) {
        size_t j = i;
        while (j < n && (s[j] == ' ' || s[j] == '\n' || s[j] == '\r' || s[j] == '\t')) ++j;
        if (j < n && s[j] == ':' && end - start == keylen &&
            s.compare(start, keylen, key) == 0) {
          for (++j; j < n && (s[j] == ' ' || s[j] == '\n' || s[j] == '\r' || s[j] == '\t');) ++j;
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

// ---- threads: size TVM's pool to the usable CPUs unless TVM_NUM_THREADS is set --------------
void prepare_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
#ifdef __linux__
    if (std::getenv("TVM_NUM_THREADS") == nullptr) {
      cpu_set_t set;
      if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        setenv("TVM_NUM_THREADS", std::to_string(CPU_COUNT(&set)).c_str(), 0);
    }
#endif
  });
}

}  // namespace

// ---- the handle ------------------------------------------------------------------------------
struct mha_handle {
  std::mutex mutex;                 // one run at a time: temps and staging buffers are shared
  tvm::ffi::Optional<tvm::ffi::Module> module;
  std::vector<tvm::ffi::Function> kernels;
  std::vector<std::vector<tvm::ffi::AnyView>> args;
  DLTensor tensors[kNumBuffers];
  void *data[kNumBuffers] = {};     // 64-byte aligned; input/output: staging copies
  ~mha_handle() {
    args.clear();
    kernels.clear();
    module = tvm::ffi::Optional<tvm::ffi::Module>();
    for (void *p : data) std::free(p);
  }
};

namespace {

constexpr size_t kAlign = 64;

bool aligned(const void *p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

mha_handle *create(const char *dir_c) {
  clear_error();
  if (dir_c == nullptr) {
    fail(MHA_ERR_NULL_ARGUMENT, "mha_create: artifact_dir is NULL");
    return nullptr;
  }
  const std::string dir(dir_c);
  struct stat st;
  if (dir.empty() || stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail(MHA_ERR_NOT_FOUND, "mha_create: no artifact directory at '" + dir +
                                "' (write one with `mhagen build ... --out DIR`)");
    return nullptr;
  }
  // The manifest: format, version and content hash must be the ones baked in here.
  std::string manifest;
  const std::string mpath = dir + "/manifest.json";
  if (read_file(mpath, -1, &manifest) != MHA_OK) return nullptr;
  std::string format, hash;
  long version = 0;
  if (!top_level_string(manifest, "format", &format) || format != kFormat) {
    fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " is not an mhagen module manifest "
                          "(corrupted?); rebuild the artifact");
    return nullptr;
  }
  if (!top_level_int(manifest, "version", &version)) {
    fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " has no format version (corrupted?)");
    return nullptr;
  }
  if (version != kFormatVersion) {
    fail(MHA_ERR_VERSION,
         "mha_create: " + dir + " has artifact format version " + std::to_string(version) +
             (version > kFormatVersion ? ", newer than" : ", older than") + " version " +
             std::to_string(kFormatVersion) + " that this libmha.so reads: " +
             (version > kFormatVersion
                  ? "link your program against the mha.h and libmha.so in that directory"
                  : "rebuild the artifact with the current mhagen"));
    return nullptr;
  }
  if (!top_level_string(manifest, "content_hash", &hash)) {
    fail(MHA_ERR_CORRUPT, "mha_create: " + mpath + " has no content_hash (corrupted?)");
    return nullptr;
  }
  if (hash != kContentHash) {
    fail(MHA_ERR_MISMATCH, "mha_create: " + dir + " holds artifact " + hash.substr(0, 16) +
                               ", but this libmha.so was generated for artifact " +
                               std::string(kContentHash).substr(0, 16) +
                               ": use the mha.h and libmha.so of that directory");
    return nullptr;
  }
  std::string missing = missing_cpu_features();
  if (!missing.empty()) {
    fail(MHA_ERR_TARGET, "mha_create: this CPU lacks" + missing + " that the kernels in " +
                             dir + " need; rebuild the artifact on this machine "
                             "(rebuild it for this machine: mhagen build --target x86 on x86, arm-neon on aarch64)");
    return nullptr;
  }
  // Every file the kernels depend on: size, then sha256.
  std::string params;
  for (int i = 0; i < kNumFiles; ++i) {
    std::string bytes;
    const std::string path = dir + "/" + kFiles[i].name;
    if (read_file(path, kFiles[i].size, &bytes) != MHA_OK) return nullptr;
    if (sha256_hex(bytes) != kFiles[i].sha256) {
      fail(MHA_ERR_CORRUPT, "mha_create: " + path + " is corrupted (sha256 mismatch); "
                            "rebuild the artifact or copy it again");
      return nullptr;
    }
    if (i == kParamsFile) params.swap(bytes);
  }
  mha_handle *h = new (std::nothrow) mha_handle();
  if (h == nullptr) {
    fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory");
    return nullptr;
  }
  for (int i = 0; i < kNumBuffers; ++i) {
    const BufferSpec &b = kBuffers[i];
    size_t bytes = (size_t(b.nbytes) + kAlign - 1) / kAlign * kAlign;
    if (posix_memalign(&h->data[i], kAlign, bytes ? bytes : kAlign) != 0) {
      h->data[i] = nullptr;
      delete h;
      fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory (" + std::to_string(bytes) +
                                  " bytes for buffer " + b.name + ")");
      return nullptr;
    }
    if (b.role == kParam)
      std::memcpy(h->data[i], params.data() + b.offset, size_t(b.nbytes));
    else
      std::memset(h->data[i], 0, bytes);
    DLTensor &t = h->tensors[i];
    t.data = h->data[i];
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = b.ndim;
    t.dtype = DLDataType{b.code, b.bits, 1};
    t.shape = const_cast<int64_t *>(b.shape);
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  prepare_threads();
  const std::string kpath = dir + "/kernel.so";
  try {
    h->module = tvm::ffi::Module::LoadFromFile(kpath);
    for (int k = 0; k < kNumKernels; ++k) {
      auto f = h->module.value()->GetFunction(kKernels[k].name);
      if (!f.has_value()) {
        delete h;
        fail(MHA_ERR_CORRUPT, "mha_create: " + kpath + " has no kernel '" + kKernels[k].name +
                                  "'; rebuild the artifact");
        return nullptr;
      }
      h->kernels.push_back(*f);
      std::vector<tvm::ffi::AnyView> args;
      for (int a = 0; a < kKernels[k].nargs; ++a)
        args.push_back(tvm::ffi::AnyView(&h->tensors[kKernels[k].args[a]]));
      h->args.push_back(std::move(args));
    }
  } catch (const std::exception &e) {
    delete h;
    fail(MHA_ERR_RUNTIME, "mha_create: TVM could not load " + kpath + ": " + e.what());
    return nullptr;
  }
  return h;
}

int run(mha_handle *h, const float *x, int batch, int seq_len, float *y) {
  clear_error();
  if (h == nullptr)
    return fail(MHA_ERR_NULL_ARGUMENT,
                "mha_run: handle is NULL (did mha_create fail? see mha_last_error())");
  if (x == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, "mha_run: x is NULL");
  if (y == nullptr) return fail(MHA_ERR_NULL_ARGUMENT, "mha_run: y is NULL");
  if (batch != kBatch || seq_len != kSeqLen)
    return fail(MHA_ERR_SHAPE,
                "mha_run: got batch=" + std::to_string(batch) + ", seq_len=" +
                    std::to_string(seq_len) + ", but this artifact is compiled for batch=" +
                    std::to_string(kBatch) + ", seq_len=" + std::to_string(kSeqLen) +
                    " only (x is float32 [" + std::to_string(kBatch) + ", " +
                    std::to_string(kSeqLen) + ", " + std::to_string(kDModel) +
                    "]); build another artifact: mhagen build --batch " +
                    std::to_string(batch) + " --seq-len " + std::to_string(seq_len) + " ...");
  std::lock_guard<std::mutex> lock(h->mutex);
  DLTensor &in = h->tensors[kInputIndex];
  DLTensor &out = h->tensors[kOutputIndex];
  const size_t in_bytes = size_t(kBuffers[kInputIndex].nbytes);
  if (aligned(x)) {
    in.data = const_cast<float *>(x);   // the kernels only read their input
  } else {
    std::memcpy(h->data[kInputIndex], x, in_bytes);
    in.data = h->data[kInputIndex];
  }
  const bool direct = kOutCols == kOutDModel && aligned(y);
  out.data = direct ? static_cast<void *>(y) : h->data[kOutputIndex];
  try {
    for (int k = 0; k < kNumKernels; ++k) {
      tvm::ffi::Any result;
      h->kernels[k].CallPacked(h->args[k].data(), int32_t(h->args[k].size()), &result);
    }
  } catch (const std::exception &e) {
    in.data = h->data[kInputIndex];
    out.data = h->data[kOutputIndex];
    return fail(MHA_ERR_RUNTIME, std::string("mha_run: a kernel failed: ") + e.what());
  }
  in.data = h->data[kInputIndex];
  out.data = h->data[kOutputIndex];
  if (!direct) {
    const float *src = static_cast<const float *>(h->data[kOutputIndex]);
    for (int64_t r = 0; r < kRows; ++r)
      std::memcpy(y + r * kOutDModel, src + r * kOutCols, size_t(kOutDModel) * sizeof(float));
  }
  return MHA_OK;
}

}  // namespace

extern "C" {

MHA_API mha_handle *mha_create(const char *artifact_dir) {
  try {
    return create(artifact_dir);
  } catch (const std::bad_alloc &) {
    fail(MHA_ERR_NO_MEMORY, "mha_create: out of memory");
  } catch (const std::exception &e) {
    fail(MHA_ERR_RUNTIME, std::string("mha_create: ") + e.what());
  } catch (...) {
    fail(MHA_ERR_RUNTIME, "mha_create: unknown error");
  }
  return nullptr;
}

MHA_API int mha_run(mha_handle *handle, const float *x, int batch, int seq_len, float *y) {
  try {
    return run(handle, x, batch, seq_len, y);
  } catch (const std::bad_alloc &) {
    return fail(MHA_ERR_NO_MEMORY, "mha_run: out of memory");
  } catch (const std::exception &e) {
    return fail(MHA_ERR_RUNTIME, std::string("mha_run: ") + e.what());
  } catch (...) {
    return fail(MHA_ERR_RUNTIME, "mha_run: unknown error");
  }
}

MHA_API void mha_destroy(mha_handle *handle) {
  try {
    delete handle;
  } catch (...) {
  }
}

MHA_API const char *mha_last_error(void) { return g_message.c_str(); }

MHA_API int mha_last_error_code(void) { return g_code; }

MHA_API const char *mha_status_name(int status) {
  switch (status) {
    case MHA_OK: return "MHA_OK";
    case MHA_ERR_NULL_ARGUMENT: return "MHA_ERR_NULL_ARGUMENT";
    case MHA_ERR_SHAPE: return "MHA_ERR_SHAPE";
    case MHA_ERR_NOT_FOUND: return "MHA_ERR_NOT_FOUND";
    case MHA_ERR_CORRUPT: return "MHA_ERR_CORRUPT";
    case MHA_ERR_VERSION: return "MHA_ERR_VERSION";
    case MHA_ERR_MISMATCH: return "MHA_ERR_MISMATCH";
    case MHA_ERR_TARGET: return "MHA_ERR_TARGET";
    case MHA_ERR_NO_MEMORY: return "MHA_ERR_NO_MEMORY";
    case MHA_ERR_RUNTIME: return "MHA_ERR_RUNTIME";
    default: return "MHA_ERR_UNKNOWN";
  }
}

}  // extern "C"
"""
