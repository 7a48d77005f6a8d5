// The CPU kernels' dispatch: a kernel set is chosen only for a feature that the processor
// advertises, the OS enables and a trial executes; a fault in a trial is caught and reported.
#include "engine/kernels/cpu/cpu_features.h"
#include "engine/kernels/cpu/quant_types.h"

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <string>

namespace kvpipe {
namespace {

CpuFeatureProbe probe_of(bool advertised, bool os_enabled, bool executes) {
  CpuFeatureProbe p;
  p.advertised = advertised;
  p.os_enabled = os_enabled;
  p.executes = executes;
  return p;
}

TEST(CpuFeatures, KernelSetNeedsAFeatureThatIsPresentAndUsable) {
  EXPECT_STREQ(choose_kernel_isa(probe_of(true, true, true), false), "avx2");
  EXPECT_EQ(probe_of(true, true, true).describe(), "usable");
}

TEST(CpuFeatures, PresentButUnusableFallsBackToPortable) {
  // Advertised by cpuid, but the OS does not save the registers (XCR0) ...
  EXPECT_STREQ(choose_kernel_isa(probe_of(true, false, false), false), "portable");
  EXPECT_EQ(probe_of(true, false, false).describe(), "not enabled by the OS");
  // ... or enabled, and the trial instruction faults (AMX in some virtual machines).
  EXPECT_STREQ(choose_kernel_isa(probe_of(true, true, false), false), "portable");
  EXPECT_EQ(probe_of(true, true, false).describe(), "faults");
}

TEST(CpuFeatures, AbsentOrForcedPortableIsPortable) {
  EXPECT_STREQ(choose_kernel_isa(probe_of(false, false, false), false), "portable");
  EXPECT_EQ(probe_of(false, false, false).describe(), "absent");
  EXPECT_STREQ(choose_kernel_isa(probe_of(true, true, true), true), "portable");
}

void trial_returns() {}
void trial_illegal_instruction() { __builtin_trap(); }  // ud2 on x86-64: SIGILL
void trial_segfault() { std::raise(SIGSEGV); }

TEST(CpuFeatures, TrialFaultsAreCaughtAndHandlersRestored) {
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGSEGV, nullptr, &before), 0);
  EXPECT_TRUE(runs_without_fault(trial_returns));
  EXPECT_FALSE(runs_without_fault(trial_illegal_instruction));
  EXPECT_FALSE(runs_without_fault(trial_segfault));
  EXPECT_TRUE(runs_without_fault(trial_returns));  // a trial after a fault still runs
  // The guard is gone afterwards: the process's own SIGSEGV disposition is back.
  struct sigaction after {};
  ASSERT_EQ(sigaction(SIGSEGV, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

TEST(CpuFeatures, ProbesOfThisProcessorAreConsistent) {
  for (CpuFeature f : {CpuFeature::kAvx2Fma, CpuFeature::kAvx512, CpuFeature::kAvx512Vnni, CpuFeature::kAvx512Bf16,
                        CpuFeature::kAmx}) {
    const CpuFeatureProbe p = probe_cpu_feature(f);
    EXPECT_TRUE(p.advertised || (!p.os_enabled && !p.executes)) << p.describe();
    EXPECT_TRUE(p.os_enabled || !p.executes) << p.describe();
  }
#if defined(__x86_64__)
  __builtin_cpu_init();
  // cpuid's view agrees with the compiler runtime's; every x86-64 processor with AVX2 that
  // these machines use lets a process run it.
  EXPECT_EQ(probe_cpu_feature(CpuFeature::kAvx2Fma).advertised,
            __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  EXPECT_EQ(probe_cpu_feature(CpuFeature::kAvx512).advertised, __builtin_cpu_supports("avx512f") &&
                                                                    __builtin_cpu_supports("avx512bw") &&
                                                                    __builtin_cpu_supports("avx512dq") &&
                                                                    __builtin_cpu_supports("avx512vl"));
  EXPECT_EQ(probe_cpu_feature(CpuFeature::kAvx512Vnni).advertised,
            probe_cpu_feature(CpuFeature::kAvx512).advertised && __builtin_cpu_supports("avx512vnni"));
  // VNNI is part of AVX-512 here: usable only where the AVX-512 probe passes too.
  EXPECT_TRUE(!probe_cpu_feature(CpuFeature::kAvx512Vnni).usable() || probe_cpu_feature(CpuFeature::kAvx512).usable());
  EXPECT_EQ(probe_cpu_feature(CpuFeature::kAvx512Bf16).advertised,
            probe_cpu_feature(CpuFeature::kAvx512).advertised && __builtin_cpu_supports("avx512bf16"));
  EXPECT_TRUE(!probe_cpu_feature(CpuFeature::kAvx512Bf16).usable() || probe_cpu_feature(CpuFeature::kAvx512).usable());
#endif
  const char* env = std::getenv("KVPIPE_CPU_KERNELS");
  const bool forced = env != nullptr && std::string(env) == "portable";
  EXPECT_STREQ(dot_kernel_isa(), choose_kernel_isa(probe_cpu_feature(CpuFeature::kAvx2Fma), forced));
  const std::string all = describe_cpu_features();
  EXPECT_NE(all.find("avx2+fma "), std::string::npos) << all;
  EXPECT_NE(all.find(", avx512-vnni "), std::string::npos) << all;
  EXPECT_NE(all.find(", avx512-bf16 "), std::string::npos) << all;
  EXPECT_NE(all.find(", amx "), std::string::npos) << all;
  std::printf("this processor: %s\n", all.c_str());
}

}  // namespace
}  // namespace kvpipe
