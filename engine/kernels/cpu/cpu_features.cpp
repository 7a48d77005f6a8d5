#include "engine/kernels/cpu/cpu_features.h"

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace kvpipe {
namespace {

thread_local sigjmp_buf* trial_jump = nullptr;

void on_trial_fault(int sig) {
  if (trial_jump != nullptr) siglongjmp(*trial_jump, sig);
  // A fault on another thread while a trial runs is not the trial's: die of it as usual.
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

#if defined(__x86_64__)

struct CpuidBits {
  uint32_t leaf1_ecx = 0, leaf7_ebx = 0, leaf7_ecx = 0, leaf7_edx = 0, leaf7_1_eax = 0;
  uint64_t xcr0 = 0;  // 0 when the OS has not enabled XSAVE (OSXSAVE clear)
};

CpuidBits read_cpuid() {
  CpuidBits bits;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) bits.leaf1_ecx = c;
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    bits.leaf7_ebx = b;
    bits.leaf7_ecx = c;
    bits.leaf7_edx = d;
    const unsigned subleaves = a;  // leaf 7's highest subleaf
    if (subleaves >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      bits.leaf7_1_eax = a;
    }
  }
  if (bits.leaf1_ecx & (1u << 27)) {  // OSXSAVE: xgetbv may be executed
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    bits.xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  return bits;
}

bool all_bits(uint64_t value, uint64_t mask) { return (value & mask) == mask; }

// Trials: a few instructions of the set on values the compiler cannot fold away.
volatile float trial_sink = 0;
volatile int trial_ok = 0;

__attribute__((target("avx2,fma,f16c"))) void trial_avx2_fma() {
  const __m256 x = _mm256_set1_ps(trial_sink + 1.0f);
  const __m256i i = _mm256_add_epi32(_mm256_set1_epi32(1), _mm256_castps_si256(x));
  const __m256 h = _mm256_cvtph_ps(_mm_set1_epi16(0x3c00));  // 1.0 in half precision
  trial_sink = _mm256_cvtss_f32(_mm256_fmadd_ps(x, h, _mm256_castsi256_ps(i)));
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) void trial_avx512() {
  const __m512 x = _mm512_set1_ps(trial_sink + 1.0f);
  const __mmask16 m = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512i b = _mm512_add_epi8(_mm512_set1_epi8(1), _mm512_castps_si512(x));
  trial_sink = _mm512_cvtss_f32(_mm512_mask_fmadd_ps(x, m, x, _mm512_castsi512_ps(b)));
}

// One 8-bit dot product (unsigned by signed bytes, four to a 32-bit lane), checked.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"))) void trial_avx512_vnni() {
  volatile int seed = 200;  // not foldable
  const __m256i u = _mm256_set1_epi8(static_cast<char>(seed));
  const __m256i s = _mm256_set1_epi8(-3);
  const __m256i r = _mm256_dpbusd_epi32(_mm256_set1_epi32(1), u, s);
  trial_ok = _mm256_extract_epi32(r, 7) == 1 + 4 * 200 * -3;
  if (!trial_ok) std::raise(SIGFPE);  // wrong sum: counts as a fault
}

// One bfloat16 pair product into a float lane (2 * 1.5 + 0.5 * 4 = 5), checked.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))) void trial_avx512_bf16() {
  volatile float seed = 1.5f;  // not foldable
  const __m256 a = _mm256_setr_ps(2.0f, 0.5f, 2.0f, 0.5f, 2.0f, 0.5f, 2.0f, 0.5f);
  const __m256 b = _mm256_setr_ps(seed, 4.0f, seed, 4.0f, seed, 4.0f, seed, 4.0f);
  const __m128bh pa = _mm256_cvtneps_pbh(a), pb = _mm256_cvtneps_pbh(b);
  const __m128 r = _mm_dpbf16_ps(_mm_setzero_ps(), pa, pb);
  trial_ok = _mm_cvtss_f32(r) == 5.0f;
  if (!trial_ok) std::raise(SIGFPE);  // wrong sum: counts as a fault
}

// One int8 tile product (16x64 by 64x16 of ones and twos) through the tile registers, in
// inline assembly so that no compiler's AMX intrinsics are needed. trial_ok says whether the
// product came out right.
void trial_amx() {
  alignas(64) uint8_t config[64] = {};
  config[0] = 1;  // palette 1; tiles 0..2: 16 rows of 64 bytes
  for (int t = 0; t < 3; ++t) {
    config[16 + 2 * t] = 64;
    config[48 + t] = 16;
  }
  alignas(64) int8_t a[16 * 64], b[16 * 64];
  alignas(64) int32_t c[16 * 16] = {};
  std::memset(a, 1, sizeof(a));
  std::memset(b, 2, sizeof(b));
  const int64_t stride = 64;
  __asm__ volatile(
      "ldtilecfg %[cfg]\n\t"
      "tilezero %%tmm0\n\t"
      "tileloadd (%[a],%[s],1), %%tmm1\n\t"
      "tileloadd (%[b],%[s],1), %%tmm2\n\t"
      "tdpbssd %%tmm2, %%tmm1, %%tmm0\n\t"
      "tilestored %%tmm0, (%[c],%[s],1)\n\t"
      "tilerelease"
      :
      : [cfg] "m"(config), [a] "r"(a), [b] "r"(b), [c] "r"(c), [s] "r"(stride)
      : "memory");
  trial_ok = c[0] == 64 * 2 && c[255] == 64 * 2;
}

void trial_amx_checked() {
  trial_ok = 0;
  trial_amx();
  if (!trial_ok) std::raise(SIGFPE);  // wrong product: counts as a fault
}

// Linux keeps AMX's tile data off until the process asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_permitted() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatureProbe probe(CpuFeature feature) {
  const CpuidBits bits = read_cpuid();
  CpuFeatureProbe p;
  void (*trial)() = nullptr;
  switch (feature) {
    case CpuFeature::kAvx2Fma:
      p.advertised = all_bits(bits.leaf7_ebx, 1u << 5) && all_bits(bits.leaf1_ecx, (1u << 12) | (1u << 28) | (1u << 29));
      p.os_enabled = all_bits(bits.xcr0, 0x6);  // SSE and AVX (YMM) state
      trial = trial_avx2_fma;
      break;
    case CpuFeature::kAvx512:
    case CpuFeature::kAvx512Vnni:
    case CpuFeature::kAvx512Bf16: {
      // F, DQ, BW and VL, and for the extensions their own bit (leaf 7 ecx 11; leaf 7.1 eax 5).
      const bool extension = feature == CpuFeature::kAvx512       ? true
                             : feature == CpuFeature::kAvx512Vnni ? all_bits(bits.leaf7_ecx, 1u << 11)
                                                                  : all_bits(bits.leaf7_1_eax, 1u << 5);
      p.advertised = all_bits(bits.leaf7_ebx, (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31)) && extension;
      p.os_enabled = all_bits(bits.xcr0, 0xe6);  // plus opmask, ZMM0-15 upper halves, ZMM16-31
      trial = feature == CpuFeature::kAvx512       ? trial_avx512
              : feature == CpuFeature::kAvx512Vnni ? trial_avx512_vnni
                                                   : trial_avx512_bf16;
      break;
    }
    case CpuFeature::kAmx:
      p.advertised = all_bits(bits.leaf7_edx, (1u << 24) | (1u << 25));
      p.os_enabled = p.advertised && all_bits(bits.xcr0, 0x60000) && amx_permitted();  // TILECFG, TILEDATA
      trial = trial_amx_checked;
      break;
  }
  p.executes = p.advertised && p.os_enabled && runs_without_fault(trial);
  return p;
}

#else

CpuFeatureProbe probe(CpuFeature) { return {}; }

#endif

}  // namespace

std::string CpuFeatureProbe::describe() const {
  if (!advertised) return "absent";
  if (!os_enabled) return "not enabled by the OS";
  return executes ? "usable" : "faults";
}

bool runs_without_fault(void (*trial)()) {
  static std::mutex trial_mutex;
  const std::lock_guard<std::mutex> lock(trial_mutex);
  constexpr int kSignals[] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE};
  struct sigaction guard {};
  guard.sa_handler = on_trial_fault;
  sigemptyset(&guard.sa_mask);
  struct sigaction saved[4];
  for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &guard, &saved[i]);
  sigjmp_buf jump;
  volatile bool ran = false;
  trial_jump = &jump;
  if (sigsetjmp(jump, 1) == 0) {  // 1: the signal mask comes back with the jump
    trial();
    ran = true;
  }
  trial_jump = nullptr;
  for (int i = 0; i < 4; ++i) sigaction(kSignals[i], &saved[i], nullptr);
  return ran;
}

CpuFeatureProbe probe_cpu_feature(CpuFeature feature) {
  switch (feature) {
    case CpuFeature::kAvx2Fma: {
      static const CpuFeatureProbe p = probe(feature);
      return p;
    }
    case CpuFeature::kAvx512: {
      static const CpuFeatureProbe p = probe(feature);
      return p;
    }
    case CpuFeature::kAvx512Vnni: {
      static const CpuFeatureProbe p = probe(feature);
      return p;
    }
    case CpuFeature::kAvx512Bf16: {
      static const CpuFeatureProbe p = probe(feature);
      return p;
    }
    case CpuFeature::kAmx: {
      static const CpuFeatureProbe p = probe(feature);
      return p;
    }
  }
  return {};
}

const char* choose_kernel_isa(const CpuFeatureProbe& avx2_fma, bool force_portable) {
  return !force_portable && avx2_fma.usable() ? "avx2" : "portable";
}

bool cpu_is_intel() {
#if defined(__x86_64__)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

std::string describe_cpu_features() {
  return "avx2+fma " + probe_cpu_feature(CpuFeature::kAvx2Fma).describe() + ", avx512 " +
         probe_cpu_feature(CpuFeature::kAvx512).describe() + ", avx512-vnni " +
         probe_cpu_feature(CpuFeature::kAvx512Vnni).describe() + ", avx512-bf16 " +
         probe_cpu_feature(CpuFeature::kAvx512Bf16).describe() + ", amx " +
         probe_cpu_feature(CpuFeature::kAmx).describe();
}

}  // namespace kvpipe
