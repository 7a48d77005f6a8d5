// The build is the CUDA build of LibTorch from PyPI's torch wheel: libtorch_cuda is linked
// (not dropped by --as-needed), the process holds exactly one NCCL and one CUDA runtime (the
// ones torch ships), and CPU operators work with no GPU or driver.
#include "parallel/communicator.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <link.h>

#include <set>
#include <string>

namespace kvpipe {
namespace {

// Loaded shared objects whose file name contains `stem`, by path.
std::set<std::string> loaded_objects(const std::string& stem) {
  struct Search {
    std::string stem;
    std::set<std::string> found;
  } search{stem, {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        const std::string path = info->dlpi_name ? info->dlpi_name : "";
        const std::string name = path.substr(path.find_last_of('/') + 1);
        if (name.find(s->stem) != std::string::npos) s->found.insert(path);
        return 0;
      },
      &search);
  return search.found;
}

TEST(Platform, LibtorchCudaIsLinked) {
  // Without libtorch_cuda the CUDA hooks are the stubs, which throw here.
  long runtime = 0;
  ASSERT_NO_THROW(runtime = at::detail::getCUDAHooks().versionCUDART());
  EXPECT_GE(runtime, 13000) << "CUDA runtime of the linked LibTorch";
  EXPECT_EQ(loaded_objects("libtorch_cuda.so").size(), 1u);
}

TEST(Platform, OneNcclAndOneCudaRuntimePerProcess) {
  const int version = nccl_version();
  EXPECT_GE(version, 22800) << "NCCL " << version;
  const auto nccl = loaded_objects("libnccl.so");
  EXPECT_EQ(nccl.size(), 1u) << "more than one NCCL in the process";
  const auto cudart = loaded_objects("libcudart.so");
  EXPECT_EQ(cudart.size(), 1u) << "more than one CUDA runtime in the process";
  // Torch's own copy, beside the torch package (nvidia/nccl/lib of the same site-packages).
  for (const auto& path : nccl) EXPECT_NE(path.find("nvidia/nccl/lib"), std::string::npos) << path;
  for (const auto& path : cudart) EXPECT_NE(path.find("nvidia/cu13/lib"), std::string::npos) << path;
}

TEST(Platform, CpuOperatorsRunWithoutAGpu) {
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  const at::Tensor b = at::matmul(a, a.t());
  EXPECT_FLOAT_EQ(b[1][1].item<float>(), 9 + 16 + 25);
  if (!cuda_device_available()) {
    EXPECT_FALSE(cuda_unavailable_reason().empty());
  }
}

}  // namespace
}  // namespace kvpipe
