// mha_cuda_driver.h -- the part of the CUDA driver API that a CUDA artifact's libmha.so uses,
// loaded at mha_create with dlopen("libcuda.so.1") (MHA_CUDA_DRIVER overrides the path), so
// libmha.so links neither the CUDA toolkit nor TVM and loads on a machine without a GPU (where
// mha_create then says there is no driver). The types and constants are those of cuda.h
// (tests/test_cuda_capi.py compiles them against the toolkit's cuda.h); the symbol names
// are the driver's exported ones (cuda.h maps cuMemAlloc to cuMemAlloc_v2 and so on).
#ifndef MHA_CUDA_DRIVER_H_
#define MHA_CUDA_DRIVER_H_

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace mha {
namespace cu {

typedef int Result;                       // CUresult
typedef int Device;                       // CUdevice
typedef struct CUctx_st *Context;         // CUcontext
typedef struct CUmod_st *ModuleHandle;    // CUmodule
typedef struct CUfunc_st *Function;       // CUfunction
typedef struct CUstream_st *Stream;       // CUstream (= cudaStream_t)
typedef unsigned long long DevicePtr;     // CUdeviceptr

constexpr Result kSuccess = 0;                          // CUDA_SUCCESS
constexpr int kAttrComputeCapabilityMajor = 75;         // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeCapabilityMinor = 76;         // ..._MINOR
constexpr int kAttrMaxSharedPerBlockOptin = 97;         // ..._MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kFuncAttrMaxDynamicShared = 8;            // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr unsigned kStaticSharedLimit = 48 * 1024;      // above it (static + dynamic) a
                                                        // kernel must opt in

// X(field, exported symbol, function type)
#define MHA_CUDA_DRIVER_FUNCTIONS(X)                                                         \
  X(Init, "cuInit", Result(unsigned))                                                        \
  X(DeviceGetCount, "cuDeviceGetCount", Result(int *))                                       \
  X(DeviceGet, "cuDeviceGet", Result(Device *, int))                                         \
  X(DeviceGetAttribute, "cuDeviceGetAttribute", Result(int *, int, Device))                  \
  X(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", Result(Context *, Device))                 \
  X(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", Result(Device))                       \
  X(CtxSetCurrent, "cuCtxSetCurrent", Result(Context))                                       \
  X(ModuleLoadData, "cuModuleLoadData", Result(ModuleHandle *, const void *))                \
  X(ModuleUnload, "cuModuleUnload", Result(ModuleHandle))                                    \
  X(ModuleGetFunction, "cuModuleGetFunction", Result(Function *, ModuleHandle,               \
                                                         const char *))                      \
  X(FuncSetAttribute, "cuFuncSetAttribute", Result(Function, int, int))                      \
  X(MemAlloc, "cuMemAlloc_v2", Result(DevicePtr *, size_t))                                  \
  X(MemFree, "cuMemFree_v2", Result(DevicePtr))                                              \
  X(MemsetD8, "cuMemsetD8_v2", Result(DevicePtr, unsigned char, size_t))                     \
  X(MemcpyHtoD, "cuMemcpyHtoD_v2", Result(DevicePtr, const void *, size_t))                  \
  X(MemcpyDtoH, "cuMemcpyDtoH_v2", Result(void *, DevicePtr, size_t))                        \
  X(LaunchKernel, "cuLaunchKernel",                                                          \
    Result(Function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,             \
               unsigned, Stream, void **, void **))                                          \
  X(CtxSynchronize, "cuCtxSynchronize", Result(void))                                        \
  X(GetErrorString, "cuGetErrorString", Result(Result, const char **))

struct Driver {
#define MHA_CUDA_FIELD(field, symbol, type) \
  using field##Fn = type;                                                                    \
  field##Fn *field = nullptr;
  MHA_CUDA_DRIVER_FUNCTIONS(MHA_CUDA_FIELD)
#undef MHA_CUDA_FIELD
  void *library = nullptr;
};

// The process's driver, loaded once (the library stays loaded). Empty `why`: ready.
inline const Driver &driver(std::string *why) {
  static Driver d;
  static std::string problem = [] {
    const char *path = std::getenv("MHA_CUDA_DRIVER");
    const char *name = path && *path ? path : "libcuda.so.1";
    d.library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (d.library == nullptr)
      return std::string("no CUDA driver (") + name + ": " + dlerror() +
             "); run on a machine with an NVIDIA GPU and its driver";
#define MHA_CUDA_LOAD(field, symbol, type)                                                   \
  d.field = reinterpret_cast<decltype(d.field)>(dlsym(d.library, symbol));                   \
  if (d.field == nullptr)                                                                    \
    return std::string("the CUDA driver ") + name + " lacks " + symbol +                     \
           " (too old? CUDA 12 or newer is needed)";
    MHA_CUDA_DRIVER_FUNCTIONS(MHA_CUDA_LOAD)
#undef MHA_CUDA_LOAD
    const Result rc = d.Init(0);
    if (rc != kSuccess)
      return "cuInit failed (CUDA error " + std::to_string(rc) + "): no usable GPU?";
    return std::string();
  }();
  *why = problem;
  return d;
}

// "CUDA_ERROR_... (n): message" for a failed call.
inline std::string error_text(const Driver &d, Result rc) {
  const char *text = nullptr;
  if (d.GetErrorString == nullptr || d.GetErrorString(rc, &text) != kSuccess || !text)
    text = "unknown error";
  return "CUDA error " + std::to_string(rc) + ": " + text;
}

}  // namespace cu
}  // namespace mha

#endif  // MHA_CUDA_DRIVER_H_
