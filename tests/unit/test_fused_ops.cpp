// The fused row kernels behind engine/layers.h on the CPU (engine/kernels/cpu/fused_ops.h)
// against LibTorch's unfused composition of the same formulas and a float64 recompute: RMSNorm,
// the residual add fused with it, RoPE (whole and partial rotary, on strided views as the fused
// q/k projection hands it, and in place in its rows), SwiGLU and GeGLU, at decode's one row and
// prefill's many (split over two threads).
#include "engine/kernels/cpu/fused_ops_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "engine/layers.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

double max_error(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

at::Tensor unfused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, true).add_(eps)) * w;
}

at::Tensor unfused_rope(const at::Tensor& x, const at::Tensor& positions, const RopeTables& rope) {
  const int64_t rotated = rope.cos.size(-1), half = rotated / 2, dim = x.size(-1);
  const at::Tensor xr = x.narrow(-1, 0, rotated);
  const at::Tensor cos = rope.cos.index_select(0, positions).unsqueeze(1);
  const at::Tensor sin = rope.sin.index_select(0, positions).unsqueeze(1);
  const at::Tensor out = xr * cos + at::cat({xr.narrow(-1, half, half).neg(), xr.narrow(-1, 0, half)}, -1) * sin;
  return rotated == dim ? out : at::cat({out, x.narrow(-1, rotated, dim - rotated)}, -1);
}

class FusedOps : public ::testing::TestWithParam<int> {  // the pool's thread count
 protected:
  void SetUp() override { ThreadPool::instance().set_threads(GetParam()); }
  void TearDown() override { ThreadPool::instance().set_threads(1); }
};

TEST_P(FusedOps, RmsNormMatchesTheUnfusedCompositionAndFloat64) {
  at::manual_seed(1);
  for (const int64_t rows : {1, 3, 300}) {
    const at::Tensor x = at::randn({rows, 576}) * 3.0, w = at::randn({576});
    const at::Tensor got = rms_norm(x, w, 1e-5);
    EXPECT_LT(max_error(got, unfused_rms_norm(x, w, 1e-5)), 2e-5) << rows;
    const at::Tensor xd = x.to(at::kDouble);
    EXPECT_LT(max_error(got, xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-5) * w.to(at::kDouble)), 2e-5) << rows;
  }
  // Three dimensions (q/k norms over heads), and a view that is not contiguous (LibTorch's path).
  const at::Tensor x3 = at::randn({4, 6, 64}), w3 = at::randn({64});
  EXPECT_LT(max_error(rms_norm(x3, w3, 1e-6), unfused_rms_norm(x3, w3, 1e-6)), 2e-5);
  const at::Tensor strided = at::randn({4, 200}).narrow(1, 10, 64);
  EXPECT_LT(max_error(rms_norm(strided, w3, 1e-6), unfused_rms_norm(strided, w3, 1e-6)), 2e-5);
}

TEST_P(FusedOps, ResidualAddAndNormEqualTheTwoStepsBitForBit) {
  at::manual_seed(4);
  for (const int64_t rows : {1, 3, 300}) {
    const at::Tensor x = at::randn({rows, 576}) * 3.0, w = at::randn({576});
    // The delta as a row-strided view, as an attention or MLP output can be.
    const at::Tensor delta = at::randn({rows, 700}).narrow(1, 50, 576);
    const ResidualAndNorm got = add_rms_norm(x, delta, w, 1e-5);
    const at::Tensor sum = x + delta;
    EXPECT_TRUE(at::equal(got.sum, sum)) << rows;
    EXPECT_TRUE(at::equal(got.normed, rms_norm(sum, w, 1e-5))) << rows;
    EXPECT_LT(max_error(got.normed, unfused_rms_norm(sum, w, 1e-5)), 2e-5) << rows;
    const at::Tensor sd = x.to(at::kDouble) + delta.to(at::kDouble);
    EXPECT_LT(max_error(got.normed, sd * at::rsqrt(sd.pow(2).mean(-1, true) + 1e-5) * w.to(at::kDouble)), 2e-5);
    // The inputs are left as they were.
    EXPECT_TRUE(at::equal(x + delta, sum));
  }
  // Other dtypes take LibTorch's composition.
  const at::Tensor xb = at::randn({2, 64}).to(at::kBFloat16), db = at::randn({2, 64}).to(at::kBFloat16);
  const at::Tensor wb = at::randn({64}).to(at::kBFloat16);
  const ResidualAndNorm bf = add_rms_norm(xb, db, wb, 1e-6);
  EXPECT_TRUE(at::equal(bf.sum, xb + db));
  EXPECT_TRUE(at::equal(bf.normed, rms_norm(xb + db, wb, 1e-6)));
}

TEST_P(FusedOps, RopeMatchesTheUnfusedCompositionOnStridedViews) {
  at::manual_seed(2);
  for (const int64_t rotated : {64, 32}) {  // whole head, and partial rotary
    std::vector<double> inv;
    for (int64_t i = 0; i < rotated / 2; ++i) inv.push_back(std::pow(10000.0, -2.0 * i / rotated));
    const RopeTables tables = make_rope_tables(512, inv, at::kFloat);
    for (const int64_t rows : {1, 5, 400}) {
      // q and k heads as the fused projection lays them out: a narrowed view of wider rows.
      const at::Tensor qkv = at::randn({rows, (6 + 2 + 2) * 64});
      const at::Tensor qk = qkv.narrow(1, 0, 8 * 64).view({rows, 8, 64});
      const at::Tensor positions = at::randint(0, 512, {rows}, at::kLong);
      const at::Tensor got = apply_rope(qk, positions, tables);
      EXPECT_LT(max_error(got, unfused_rope(qk, positions, tables)), 1e-5) << rotated << " " << rows;
      // float64: the rotation itself, from the angles.
      const at::Tensor xd = qk.to(at::kDouble);
      const at::Tensor angle = at::outer(positions.to(at::kDouble), at::tensor(inv, at::kDouble));
      const at::Tensor c = angle.cos().unsqueeze(1), s = angle.sin().unsqueeze(1);
      const int64_t half = rotated / 2;
      const at::Tensor x1 = xd.narrow(-1, 0, half), x2 = xd.narrow(-1, half, half);
      EXPECT_LT(max_error(got.narrow(-1, 0, half), x1 * c - x2 * s), 1e-4);
      EXPECT_LT(max_error(got.narrow(-1, half, half), x2 * c + x1 * s), 1e-4);
      if (rotated < 64) EXPECT_TRUE(at::equal(got.narrow(-1, rotated, 64 - rotated), qk.narrow(-1, rotated, 64 - rotated)));
      // In place, in the projection's own rows: the same bits, and the v columns untouched.
      const at::Tensor own = qkv.clone();
      const at::Tensor own_qk = own.narrow(1, 0, 8 * 64).view({rows, 8, 64});
      const at::Tensor rotated_in_place = apply_rope_(own_qk, positions, tables);
      EXPECT_EQ(rotated_in_place.data_ptr(), own.data_ptr());
      EXPECT_TRUE(at::equal(rotated_in_place, got)) << rotated << " " << rows;
      EXPECT_TRUE(at::equal(own.narrow(1, 8 * 64, 2 * 64), qkv.narrow(1, 8 * 64, 2 * 64)));
    }
    EXPECT_THROW(apply_rope(at::randn({1, 2, 64}), at::tensor({512}, at::kLong), tables), std::out_of_range);
    EXPECT_THROW(apply_rope_(at::randn({1, 2, 64}), at::tensor({-1}, at::kLong), tables), std::out_of_range);
  }
}

TEST_P(FusedOps, GatedActivationsMatchTheUnfusedComposition) {
  at::manual_seed(3);
  for (const int64_t rows : {1, 7, 300}) {
    const at::Tensor gate_up = at::randn({rows, 2 * 1536}) * 4.0;
    const at::Tensor g = gate_up.narrow(1, 0, 1536), u = gate_up.narrow(1, 1536, 1536);
    EXPECT_LT(max_error(swiglu(gate_up), at::silu(g) * u), 1e-5) << rows;
    EXPECT_LT(max_error(geglu(gate_up), at::gelu(g, "tanh") * u), 1e-5) << rows;
    const at::Tensor gd = g.to(at::kDouble), ud = u.to(at::kDouble);
    EXPECT_LT(max_error(swiglu(gate_up), gd / (1 + (-gd).exp()) * ud), 1e-4) << rows;
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, FusedOps, ::testing::Values(1, 2));

// The vector SiLU (its own exp) over the whole float range SiLU sees, the ends where exp would
// leave the normal floats included: within 1e-6 of the float64 value, AVX2 and AVX-512 equal bit
// for bit, and a row's tail (a part vector) equal to the same values inside a row.
TEST(FusedOpsSilu, VectorLanesMatchFloat64AndEachOther) {
#if defined(__x86_64__)
  using Fn = void (*)(const float*, const float*, float*, int64_t);
  std::vector<std::pair<const char*, Fn>> isas;
  if (quant_impl::use_avx2()) isas.emplace_back("avx2", fused_impl::silu_mul_avx2);
  else std::printf("silu: avx2 does not run on this processor\n");
  if (quant_impl::use_avx512()) isas.emplace_back("avx512", fused_impl::silu_mul_avx512);
  else std::printf("silu: avx512 does not run on this processor\n");
  if (isas.empty()) GTEST_SKIP() << "no vector SiLU runs here";
  std::vector<float> g;
  for (int i = -4000; i <= 4000; ++i) g.push_back(static_cast<float>(i) * 0.025f);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 86.9f, 87.1f, 87.9f, 88.1f, 89.0f, -86.9f, -87.1f, -87.9f, -88.1f,
                  -89.0f, 200.0f, -200.0f, 1e30f, -3e38f})
    g.push_back(v);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> u(g.size());
  for (auto& v : u) v = normal(gen);
  const int64_t n = static_cast<int64_t>(g.size());
  std::vector<float> first;
  for (const auto& [name, fn] : isas) {
    std::vector<float> o(g.size());
    fn(g.data(), u.data(), o.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const double gd = g[i], want = gd / (1.0 + std::exp(-gd)) * u[i];
      ASSERT_LE(std::fabs(o[i] - want), 1e-6 * std::fabs(want) + 1e-35) << name << " g=" << g[i] << " u=" << u[i];
    }
    if (first.empty()) first = o;
    else EXPECT_EQ(0, std::memcmp(first.data(), o.data(), o.size() * sizeof(float))) << name << " differs from avx2";
    for (int64_t len = 1; len <= 17; ++len) {
      std::vector<float> part(static_cast<size_t>(len));
      fn(g.data() + 1000, u.data() + 1000, part.data(), len);
      EXPECT_EQ(0, std::memcmp(part.data(), o.data() + 1000, part.size() * sizeof(float))) << name << " len=" << len;
    }
  }
#else
  GTEST_SKIP() << "no x86 vector code in this build";
#endif
}

}  // namespace
}  // namespace kvpipe
