// Random weights: a tensor's values depend on its name and seed alone, and drawing them takes
// no lock that the draw itself needs (which on a GPU hung every dummy: model). The rule lives
// in seeded_generator, which the CPU and CUDA branches share, so the CPU exercises it here;
// the gpu-label tests draw on a GPU.
#include "engine/model/model_weights.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvpipe {
namespace {

// Runs `draw` on a thread of its own and waits at most 60 s: a draw that waits on a lock its
// own thread holds never returns, and the test reports it instead of hanging.
at::Tensor draw_within_a_minute(std::function<at::Tensor()> draw) {
  auto done = std::make_shared<std::promise<at::Tensor>>();
  std::future<at::Tensor> result = done->get_future();
  std::thread([done, draw] { done->set_value(draw()); }).detach();
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "the draw did not return: it waits on a generator lock";
    return {};
  }
  return result.get();
}

TEST(ModelWeights, SeededGeneratorHoldsNoLockAndLeavesTheSharedOneAlone) {
  at::Generator shared = at::globalContext().defaultGenerator(at::kCPU);
  at::Tensor state_before;
  {
    std::lock_guard<std::mutex> lock(shared.mutex());
    state_before = shared.get_state();
  }
  const at::Generator own = seeded_generator(shared, 42);
  // Nothing is left locked, and the copy is another generator.
  ASSERT_TRUE(shared.mutex().try_lock());
  shared.mutex().unlock();
  EXPECT_NE(own.unsafeGetGeneratorImpl(), shared.unsafeGetGeneratorImpl());
  // The draw locks the copy itself (as the CUDA kernels do): it must find it free.
  const at::Tensor got = draw_within_a_minute([own] { return at::normal(0.0, 1.0, {64}, own); });
  ASSERT_TRUE(got.defined());
  // The same values as a fresh generator of that seed: CPU weights are what they always were.
  const at::Tensor want = at::normal(0.0, 1.0, {64}, at::make_generator<at::CPUGeneratorImpl>(42));
  EXPECT_TRUE(at::equal(got, want));
  std::lock_guard<std::mutex> lock(shared.mutex());
  EXPECT_TRUE(at::equal(shared.get_state(), state_before)) << "the shared generator was reseeded or advanced";
}

TEST(ModelWeights, RandomTensorReturnsAndIsAPureFunctionOfNameAndSeed) {
  const std::vector<int64_t> shape = {33, 17};
  const at::Tensor a = draw_within_a_minute([&] { return random_tensor("model.layers.0.mlp.up_proj.weight", shape, 7, 0.02); });
  ASSERT_TRUE(a.defined());
  EXPECT_TRUE(at::equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", shape, 7, 0.02)));
  EXPECT_FALSE(at::equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", shape, 8, 0.02)));
  EXPECT_FALSE(at::equal(a, random_tensor("model.layers.1.mlp.up_proj.weight", shape, 7, 0.02)));
  // Norms are 1 + N(0, std).
  EXPECT_NEAR(random_tensor("model.norm.weight", {4096}, 7, 0.02).mean().item<double>(), 1.0, 0.01);
}

// Ranks load their layers on one thread, but nothing stops a caller from drawing on several:
// each thread gets the values a lone draw gets.
TEST(ModelWeights, ConcurrentDrawsGetTheSerialValues) {
  const at::Tensor want = random_tensor("model.embed_tokens.weight", {256, 64}, 3, 0.02);
  std::vector<std::future<at::Tensor>> draws;
  for (int i = 0; i < 4; ++i)
    draws.push_back(std::async(std::launch::async, [] {
      at::Tensor last;
      for (int k = 0; k < 20; ++k) last = random_tensor("model.embed_tokens.weight", {256, 64}, 3, 0.02);
      return last;
    }));
  for (auto& d : draws) EXPECT_TRUE(at::equal(d.get(), want));
}

// What the dummy: models on a GPU do: every tensor drawn on the device from its generator's
// kind (the draw that used to wait forever on the generator's lock).
TEST(GpuModelWeights, RandomTensorDrawsOnTheDevice) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device cuda(at::kCUDA, 0);
  const at::Tensor a = draw_within_a_minute([&] { return random_tensor("model.layers.0.mlp.up_proj.weight", {512, 64}, 7, 0.02, cuda); });
  ASSERT_TRUE(a.defined());
  EXPECT_TRUE(a.is_cuda());
  EXPECT_TRUE(at::equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", {512, 64}, 7, 0.02, cuda)));
  EXPECT_NEAR(a.std().item<double>(), 0.02, 0.002);
  const at::Generator shared = at::globalContext().defaultGenerator(cuda);
  const uint64_t seed_before = shared.current_seed();
  random_tensor("model.norm.weight", {64}, 7, 0.02, cuda);
  EXPECT_EQ(shared.current_seed(), seed_before) << "the device's default generator was reseeded";
}

}  // namespace
}  // namespace kvpipe
