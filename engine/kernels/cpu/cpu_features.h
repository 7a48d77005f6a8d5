// What the running processor can execute, for the CPU kernels' run-time dispatch.
//
// cpuid alone is not enough to choose a kernel: an instruction set with registers of its own
// also needs the operating system to save those registers (XCR0, read with xgetbv: AVX needs
// the YMM state, AVX-512 the opmask and ZMM states), AMX needs the process to ask the kernel
// for its tile data (arch_prctl ARCH_REQ_XCOMP_PERM), and a virtual machine may advertise an
// instruction set and still fault on it. So each feature passes three stages: advertised,
// enabled by the OS, and a trial instruction that ran without a fault. Only a feature that
// passed all three is usable; anything else falls back to the next kernel set down.
#pragma once

#include <string>

namespace kvpipe {

enum class CpuFeature {
  kAvx2Fma,  // AVX2 + FMA (+ F16C): the "avx2" dot-product kernels
  kAvx512,   // AVX-512 F/BW/DQ/VL
  kAvx512Vnni,  // kAvx512 + VNNI (8-bit dot products into 32-bit lanes)
  kAvx512Bf16,  // kAvx512 + AVX512-BF16 (bfloat16 pair products into float lanes)
  kAmx,      // AMX-TILE + AMX-INT8
};

struct CpuFeatureProbe {
  bool advertised = false;  // cpuid reports it
  bool os_enabled = false;  // the OS saves its state (and, for AMX, granted the process its use)
  bool executes = false;    // a trial instruction ran without a fault (tried only when enabled)

  bool usable() const { return advertised && os_enabled && executes; }
  // "usable", "absent", "not enabled by the OS" or "faults".
  std::string describe() const;
};

// Probes the running processor for `feature`. The trial runs once per feature and process;
// later calls return the first answer. Asking for kAmx requests the process's AMX
// permission when the processor and the OS offer it.
CpuFeatureProbe probe_cpu_feature(CpuFeature feature);

// The dot-product kernel set for an AVX2 + FMA probe: "avx2" only when it is usable and not
// overridden by `force_portable`, "portable" otherwise.
const char* choose_kernel_isa(const CpuFeatureProbe& avx2_fma, bool force_portable);

// Runs `trial` and reports whether it returned normally rather than faulting (SIGILL, SIGSEGV,
// SIGBUS or SIGFPE). The process's handlers for those signals are restored before it returns.
bool runs_without_fault(void (*trial)());

// Whether the running processor is Intel's (cpuid's vendor): for the choices that follow a
// vendor's cores rather than a feature bit (the float32 BLAS, the BF16 prompt product).
bool cpu_is_intel();

// "avx2+fma usable, avx512 faults, avx512-vnni faults, avx512-bf16 faults, amx absent": every feature's probe, for logs and reports.
std::string describe_cpu_features();

}  // namespace kvpipe
