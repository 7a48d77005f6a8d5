// cpu_linear and cpu_bmm against a float64 recompute, for the layouts the engine hands them
// (bias or not, transposed and narrowed views of K and V), and the BLAS they resolve to.
#include "engine/kernels/cpu/blas_gemm.h"
#include "tests/support/logprob_compare.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

double max_error(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>();
}

// ctest runs each test in a process of its own: these use OpenBLAS whatever the processor.
void use_openblas() {
  setenv("KVPIPE_CPU_BLAS", "openblas", 1);
  ASSERT_EQ(cpu_blas_name(), "openblas");
}

TEST(CpuBlasGemm, LinearMatchesFloat64) {
  use_openblas();
  at::manual_seed(1);
  for (const int64_t n : {9, 64, 300}) {
    const at::Tensor x = at::randn({n, 96}), w = at::randn({130, 96}), b = at::randn({130});
    const at::Tensor want = at::mm(x.to(at::kDouble), w.to(at::kDouble).t());
    EXPECT_LT(max_error(cpu_linear(x, w), want), 1e-4) << n;
    EXPECT_LT(max_error(cpu_linear(x, w, b), want + b.to(at::kDouble)), 1e-4) << n;
    // Rows of a wider matrix (a narrowed view: rows further apart than their length).
    const at::Tensor wide = at::randn({n, 200});
    const at::Tensor xv = wide.narrow(1, 10, 96);
    EXPECT_LT(max_error(cpu_linear(xv, w), at::mm(xv.to(at::kDouble), w.to(at::kDouble).t())), 1e-4) << n;
  }
}

// Split over LibTorch's threads, each slice a single-threaded OpenBLAS call: same values.
TEST(CpuBlasGemm, ThreadsSplitTheOutput) {
  use_openblas();
  at::manual_seed(3);
  const at::Tensor x = at::randn({200, 160}), w = at::randn({1000, 160}), b = at::randn({1000});
  const at::Tensor q = at::randn({4, 64, 32}), kt = at::randn({4, 32, 90});
  const at::Tensor one = cpu_linear(x, w, b), one_bmm = cpu_bmm(q, kt);
  at::set_num_threads(2);
  const at::Tensor two = cpu_linear(x, w, b), two_bmm = cpu_bmm(q, kt);
  at::set_num_threads(1);
  EXPECT_LT((one - two).abs().max().item<float>(), 1e-5);
  EXPECT_LT((one_bmm - two_bmm).abs().max().item<float>(), 1e-5);
  EXPECT_LT(max_error(two, at::addmm(b.to(at::kDouble), x.to(at::kDouble), w.to(at::kDouble).t())), 1e-4);
}

TEST(CpuBlasGemm, BmmMatchesFloat64ForEveryLayout) {
  use_openblas();
  at::manual_seed(2);
  const int64_t heads = 3, hd = 16, L = 40, rows = 36;  // enough rows for OpenBLAS
  const at::Tensor k = at::randn({L, heads, hd}), v = at::randn({L, heads, hd});
  const at::Tensor q = at::randn({heads, rows, hd}), p = at::softmax(at::randn({heads, rows, L}), -1);
  const at::Tensor kt_view = k.permute({1, 2, 0});               // strided: K^T as a view
  const at::Tensor kt = kt_view.contiguous();                     // [heads, hd, L]
  const at::Tensor vt_view = v.permute({1, 0, 2});                // rows kv*hd apart
  for (const at::Tensor& c : {kt_view, kt, kt.narrow(2, 0, 25)}) {
    const at::Tensor want = at::bmm(q.to(at::kDouble), c.to(at::kDouble));
    EXPECT_LT(max_error(cpu_bmm(q, c), want), 1e-4);
  }
  for (const at::Tensor& c : {vt_view, vt_view.contiguous()}) {
    const at::Tensor want = at::bmm(p.to(at::kDouble), c.to(at::kDouble));
    EXPECT_LT(max_error(cpu_bmm(p, c), want), 1e-5);
  }
  const at::Tensor qt = q.transpose(1, 2).contiguous().transpose(1, 2);  // column-major A
  EXPECT_LT(max_error(cpu_bmm(qt, kt), at::bmm(q.to(at::kDouble), kt.to(at::kDouble))), 1e-4);
  EXPECT_EQ(cpu_bmm(q.narrow(1, 0, 0), kt).sizes(), (at::IntArrayRef{heads, 0, L}));
}

TEST(CpuBlasGemm, OpenBlasOnProcessorsThatAreNotIntels) {
  __builtin_cpu_init();
  const char* forced = std::getenv("KVPIPE_CPU_BLAS");
  if (!forced || !*forced) {
    EXPECT_EQ(cpu_blas_name(), __builtin_cpu_is("intel") ? "torch" : "openblas");
    set_cpu_blas_threads(2);  // the threads are kvpipe's pool's: the choice stays
    EXPECT_EQ(cpu_blas_name(), __builtin_cpu_is("intel") ? "torch" : "openblas");
    set_cpu_blas_threads(1);
  }
  // The cblas_sgemm this process calls is OpenBLAS's, not one exported by LibTorch's MKL.
  void* sym = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  ASSERT_NE(sym, nullptr);
  Dl_info info{};
  ASSERT_NE(dladdr(sym, &info), 0);
  EXPECT_NE(std::string(info.dli_fname).find("openblas"), std::string::npos) << info.dli_fname;
}

// The same job with either library gives the same tokens and log-probabilities within 1e-4;
// a library that is neither is refused by name.
TEST(CpuBlasGemm, BothLibrariesGiveTheSameGeneration) {
  const auto dir = kvpipe::testing::make_scratch_dir();
  std::string prompt;
  for (int i = 0; i < 300; ++i) prompt += (i ? "," : "") + std::to_string((i * 37) % 500 + 3);
  kvpipe::testing::write_greedy_job(dir, "\"dummy:tiny\"", prompt, 8);
  std::vector<kvpipe::testing::LogprobStep> steps[2];
  for (int i = 0; i < 2; ++i) {
    const std::string blas = i == 0 ? "openblas" : "torch";
    const auto run = kvpipe::testing::run_kvpipe_logprobs("KVPIPE_CPU_BLAS=" + blas + " " + KVPIPE_BINARY, "",
                                                          dir, "dummy:tiny", 1);
    ASSERT_EQ(run.result.code, 0) << blas << ": " << run.result.err;
    steps[i] = run.steps;
  }
  const auto c = kvpipe::testing::compare_logprob_steps(steps[0], steps[1], 8, 1e-4, 1e-3);
  EXPECT_TRUE(c.failure.empty()) << c.failure;
  EXPECT_EQ(c.compared, 8);
  const auto bad = kvpipe::testing::run_kvpipe_logprobs(std::string("KVPIPE_CPU_BLAS=mkl ") + KVPIPE_BINARY, "",
                                                        dir, "dummy:tiny", 1);
  EXPECT_EQ(bad.result.code, 2) << bad.result.err;
  EXPECT_NE(bad.result.err.find("KVPIPE_CPU_BLAS"), std::string::npos) << bad.result.err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvpipe
