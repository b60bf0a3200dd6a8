// mha_runtime.h -- the types of the tables that describe one compiled mhagen artifact.
//
// mhagen ships this file and mha_runtime.cc unchanged in every artifact directory; the only
// artifact-specific C++ is the generated mha_config.h (data only, written by
// mhagen/artifact/capi.py from manifest.json), which defines in namespace mha::config:
//
//   kFormatVersion, kFormat, kContentHash     what mha_create expects in manifest.json
//   kBatch, kSeqLen, kDModel, kOutDModel      the shape the kernels run (the largest, when
//                                             kSymbolicBatch / kSymbolicSeq: any batch, seq
//                                             up to them; kRowTile pads the GEMM rows)
//   kRows, kOutCols                           output buffer: kRows rows of kOutCols floats
//   kInputIndex, kOutputIndex                 the input and output in kBuffers
//   kLengthsIndex, kLengthsKind               the int32 [batch] lengths input (-1 / 0: none;
//                                             kind 1 key lengths, 2 tokens in the K/V cache)
//   kKCacheIndex, kVCacheIndex, kMaxLen       decoding layers: the caller's caches (kState)
//   kCuSeqlensIndex, kBlockTablesIndex        packed decoding (the rows' offsets, int32
//   kBlockSize, kMaxBlocks                    [batch + 1]) and a paged cache (block tables
//                                             [batch, kMaxBlocks], blocks of kBlockSize
//                                             tokens; -1 / 0: none)
//   kNumBuffers, kBuffers[]                   every kernel argument (BufferSpec)
//   kNumKernels, kKernels[]                   the kernels of kernel.so, called in order
//   kNumPackedKernels, kPackedKernels[]       those a packed call runs (mha_run_varlen; 0:
//                                             the artifact takes none), in order
//   kPackedQTile, kTilesIndex, kPositionsIndex  packed calls: the query tiles of their tile
//                                             table, its buffer and the tokens' positions'
//                                             (RoPE; -1: none), both written per call
//   kNumFiles, kFiles[], kParamsFile          the files mha_create checks (FileSpec)
//   kDeviceType                               where the buffers live (DLPack device type)
//   MHA_DEVICE_CUDA                           1: a CUDA artifact (kernels.fatbin launched
//                                             through the CUDA driver, mha_cuda_driver.h)
//   kComputeCapability, kDeviceFileIndex      CUDA: the architecture (90: sm_90), the fatbin
//   kNumLaunches, kLaunches[]                 CUDA: the GPU kernels, in run order (LaunchSpec)
//   kSveVectorBits                            aarch64: SVE vector length the kernels need, or 0
// and the lists (X-macros: each expands X once per entry)
//   MHA_STATUS_LIST(X)        X(name) per status code of mha.h, in order
//   MHA_X86_FEATURES(X)       X("avx2", leaf, subleaf, register, bit, xcr0) per x86 feature:
//                             its CPUID bit (register 0-3: eax..edx) and the XCR0 register
//                             state the OS must enable (0: none)
//   MHA_AARCH64_HWCAPS(X)     X("neon", bit) per aarch64 feature and its AT_HWCAP bit
#ifndef MHA_RUNTIME_H_
#define MHA_RUNTIME_H_

#include <dlpack/dlpack.h>

#include <cstdint>

namespace mha {

// kState: the caller's memory, written in place (a decoding layer's K/V cache); never allocated
enum Role { kInput = 0, kParam = 1, kTemp = 2, kOutput = 3, kState = 4 };

// Symbolic-length artifacts: the axis of a buffer that follows the call (BufferSpec.sym_axis;
// the shape holds its largest value) and what it is, and the scalar kernel arguments.
// (cross-attention: kDimKvRows = batch * kv_seq rows of the context, kDimKvPaddedRows those
// padded to kRowTile; packed calls: kDimTiles = the rows of their tile table)
// (kDimPoolBlocks: a paged cache's pools, [num_blocks, ...] with num_blocks the call's)
enum SymbolicDim {
  kFixed = 0, kDimBatch = 1, kDimRows = 2, kDimPaddedRows = 3, kDimKvRows = 4,
  kDimKvPaddedRows = 5, kDimTiles = 6, kDimPoolBlocks = 7
};
enum ScalarArg { kArgBatch = -1, kArgSeq = -2, kArgKvSeq = -3 };   // KernelSpec.args below 0

constexpr int kMaxDims = 8;

struct BufferSpec {
  const char *name;
  int role;                 // Role
  uint8_t code;             // DLDataTypeCode
  uint8_t bits;
  int ndim;
  int64_t shape[kMaxDims];
  int64_t nbytes;
  int64_t offset;           // params: byte offset in weights.safetensors; else -1
  int sym_axis;             // the axis that follows the call (SymbolicDim), or -1
  int sym_kind;             // SymbolicDim
};

struct KernelSpec {
  const char *name;         // the function's name in kernel.so
  int nargs;
  const int *args;          // indices into kBuffers, or a ScalarArg
};

struct LaunchSpec {
  const char *entry;        // the GPU function in kernels.fatbin
  unsigned grid[3];         // blocks (x, y, z)
  unsigned block[3];        // threads (x, y, z)
  unsigned dynamic_shared;  // bytes of dynamic shared memory
  unsigned static_shared;   // bytes of static shared memory (opt in when both exceed 48 KiB)
  int nargs;
  const int *args;          // indices into kBuffers, in the function's parameter order
};

constexpr int kMaxLaunchArgs = 16;

struct FileSpec {
  const char *name;         // relative to the artifact directory
  int64_t size;             // bytes
  const char *sha256;       // hex; nullptr: the size is checked, the bytes are never read
};

}  // namespace mha

#endif  // MHA_RUNTIME_H_
