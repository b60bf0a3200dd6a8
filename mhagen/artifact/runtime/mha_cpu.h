// mha_cpu.h -- which CPU features the kernels need that this CPU lacks: mha_create's check,
// asked of the CPU itself (x86: CPUID and XGETBV; aarch64: AT_HWCAP and the SVE vector
// length), so that code this CPU cannot run is refused instead of dying of SIGILL.
//
// Reads the lists mha_config.h defines (mhagen/artifact/capi.py writes them from
// mhagen.host.RUNTIME_FEATURES): MHA_X86_FEATURES(X), MHA_AARCH64_HWCAPS(X) and
// MHA_SVE_VECTOR_BITS (see mha_runtime.h). Header-only and free of the rest of the runtime, so
// tests run it alone against every feature mhagen knows.
#ifndef MHA_CPU_H_
#define MHA_CPU_H_

#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#endif

namespace mha {

#if defined(__x86_64__) && defined(__GNUC__)
// Whether CPUID (leaf, subleaf) sets `bit` of register `reg` (0-3: eax..edx) and the OS has
// enabled the register state `xcr0` names (XGETBV; 0: none needed). A leaf beyond the CPU's
// highest reads as absent.
inline bool x86_has(unsigned leaf, unsigned subleaf, int reg, int bit, unsigned xcr0) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
  if (!((r[reg] >> bit) & 1u)) return false;
  if (xcr0 == 0) return true;
  if (!__get_cpuid(1, &r[0], &r[1], &r[2], &r[3]) || !(r[2] & (1u << 27)))   // OSXSAVE
    return false;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & xcr0) == xcr0;
}

// Whether this process may use AMX tiles: Linux (5.16+) grants their state on request
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); the first tile instruction without
// it is SIGILL. Granted for the whole process; asking again is harmless.
inline bool amx_permitted() {
#if defined(__linux__)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}
#endif

// " avx2 fma" for the features this CPU lacks; "" when it has them all.
inline std::string missing_cpu_features() {
  std::string missing;
#if defined(__x86_64__) && defined(__GNUC__)
#define MHA_CHECK_X86(name, leaf, subleaf, reg, bit, xcr0)                            \
  if (!x86_has(leaf, subleaf, reg, bit, xcr0))                                        \
    missing += " " name;                                                              \
  else if (std::string(name) == "amx-tile" && !amx_permitted())                       \
    missing += " amx-tile (Linux refused this process the AMX tile state: arch_prctl " \
               "ARCH_REQ_XCOMP_PERM needs Linux 5.16 or later)";
  MHA_X86_FEATURES(MHA_CHECK_X86)
#undef MHA_CHECK_X86
#elif defined(__aarch64__) && defined(__linux__)
  [[maybe_unused]] const unsigned long hwcap = getauxval(AT_HWCAP);
#define MHA_CHECK_HWCAP(name, bit) \
  if (!(hwcap & (1UL << (bit)))) missing += " " name;
  MHA_AARCH64_HWCAPS(MHA_CHECK_HWCAP)
#undef MHA_CHECK_HWCAP
  constexpr unsigned long kHwcapSve = 1UL << 22;
  constexpr int kPrSveGetVl = 51;   // PR_SVE_GET_VL, linux/prctl.h
  if (MHA_SVE_VECTOR_BITS > 0 && (hwcap & kHwcapSve)) {
    const int vl = prctl(kPrSveGetVl, 0, 0, 0, 0);
    if (vl >= 0 && (vl & 0xffff) * 8 < MHA_SVE_VECTOR_BITS)
      missing += " sve with " + std::to_string(MHA_SVE_VECTOR_BITS) +
                 "-bit vectors (this CPU's are " + std::to_string((vl & 0xffff) * 8) + "-bit)";
  }
#endif
  return missing;
}

}  // namespace mha

#endif  // MHA_CPU_H_
