#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/layers.h"

namespace kvpipe {
namespace {

// Inputs are drawn as float32 values and the references are computed in float64 from exactly
// those values, so the only difference left is the float32 arithmetic of the implementation.
std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

at::Tensor to_tensor(std::vector<float> values, std::vector<int64_t> shape) {
  return at::from_blob(values.data(), shape, at::TensorOptions().dtype(at::kFloat)).clone();
}

std::vector<double> to_doubles(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous();
  const double* p = c.data_ptr<double>();
  return std::vector<double>(p, p + c.numel());
}

void expect_all_near(const at::Tensor& actual, const std::vector<double>& expected, double tol) {
  const std::vector<double> got = to_doubles(actual);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], expected[i], tol) << "at flat index " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// rms_norm

TEST(LayersRmsNorm, matches_float64_reference) {
  const int64_t T = 3, H = 8;
  const double eps = 1e-5;
  const std::vector<float> x = random_floats(T * H, 11, -2.0f, 2.0f);
  const std::vector<float> w = random_floats(H, 12, 0.5f, 1.5f);

  std::vector<double> expected(T * H);
  for (int64_t t = 0; t < T; ++t) {
    double sum_sq = 0.0;
    for (int64_t i = 0; i < H; ++i) sum_sq += double(x[t * H + i]) * x[t * H + i];
    const double rms = std::sqrt(sum_sq / H + eps);
    for (int64_t i = 0; i < H; ++i) expected[t * H + i] = x[t * H + i] / rms * w[i];
  }

  const at::Tensor y = rms_norm(to_tensor(x, {T, H}), to_tensor(w, {H}), eps);
  ASSERT_EQ(y.sizes(), at::IntArrayRef({T, H}));
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  expect_all_near(y, expected, 1e-5);
}

TEST(LayersRmsNorm, eps_dominates_a_zero_row) {
  // A zero row must give zeros, not NaN: eps keeps the denominator away from zero.
  const at::Tensor y = rms_norm(at::zeros({2, 4}), at::ones({4}), 1e-6);
  expect_all_near(y, std::vector<double>(8, 0.0), 0.0);
}

// ---------------------------------------------------------------------------------------------
// RoPE

// HF rotate-half convention, from its definition rather than the cos/sin tables.
std::vector<double> rope_reference(const std::vector<float>& x, const std::vector<int64_t>& pos,
                                   int64_t heads, int64_t d, double theta) {
  const int64_t half = d / 2;
  std::vector<double> out(x.size());
  for (size_t t = 0; t < pos.size(); ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const size_t base = (t * heads + h) * d;
      for (int64_t j = 0; j < half; ++j) {
        const double inv_freq = std::pow(theta, -2.0 * j / d);
        const double angle = pos[t] * inv_freq;
        const double a = x[base + j], b = x[base + j + half];
        out[base + j] = a * std::cos(angle) - b * std::sin(angle);
        out[base + j + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
  }
  return out;
}

class LayersRope : public ::testing::TestWithParam<double> {};

TEST_P(LayersRope, matches_rotate_half_reference) {
  const double theta = GetParam();
  const int64_t T = 4, heads = 3, d = 8, max_position = 128;
  const std::vector<int64_t> positions = {0, 1, 7, 100};
  const std::vector<float> x = random_floats(T * heads * d, 21);

  const RopeTables rope = make_rope_tables(max_position, d, theta, at::kFloat);
  ASSERT_EQ(rope.cos.sizes(), at::IntArrayRef({max_position, d}));
  ASSERT_EQ(rope.sin.sizes(), at::IntArrayRef({max_position, d}));
  EXPECT_EQ(rope.cos.scalar_type(), at::kFloat);

  const at::Tensor pos = at::tensor(positions, at::TensorOptions().dtype(at::kLong));
  const at::Tensor y = apply_rope(to_tensor(x, {T, heads, d}), pos, rope);
  ASSERT_EQ(y.sizes(), at::IntArrayRef({T, heads, d}));
  expect_all_near(y, rope_reference(x, positions, heads, d, theta), 1e-5);
}

TEST_P(LayersRope, preserves_norm_of_every_head_vector) {
  const double theta = GetParam();
  const int64_t T = 4, heads = 3, d = 8;
  const std::vector<int64_t> positions = {0, 1, 7, 100};
  const std::vector<float> x = random_floats(T * heads * d, 22);
  const RopeTables rope = make_rope_tables(128, d, theta, at::kFloat);
  const std::vector<double> y = to_doubles(
      apply_rope(to_tensor(x, {T, heads, d}), at::tensor(positions, at::kLong), rope));

  for (int64_t v = 0; v < T * heads; ++v) {
    double in_sq = 0.0, out_sq = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      in_sq += double(x[v * d + j]) * x[v * d + j];
      out_sq += y[v * d + j] * y[v * d + j];
    }
    EXPECT_NEAR(std::sqrt(out_sq), std::sqrt(in_sq), 1e-5) << "vector " << v;
  }
}

TEST_P(LayersRope, position_zero_is_identity) {
  const int64_t T = 2, heads = 3, d = 8;
  const at::Tensor x = to_tensor(random_floats(T * heads * d, 23), {T, heads, d});
  const RopeTables rope = make_rope_tables(16, d, GetParam(), at::kFloat);
  const at::Tensor y = apply_rope(x, at::zeros({T}, at::kLong), rope);
  // cos(0) = 1 and sin(0) = 0 exactly, so nothing may move at all.
  EXPECT_TRUE(at::equal(y, x));
}

TEST_P(LayersRope, partial_tables_rotate_the_first_dimensions_and_scale_them) {
  // Phi-3's partial_rotary_factor: the first `rotated` dimensions of a head turn as a head of
  // that size would, the rest pass through; yarn's attention factor multiplies cos and sin.
  const double theta = GetParam(), factor = 1.25;
  const int64_t T = 4, heads = 3, d = 12, rotated = 8;
  const std::vector<int64_t> positions = {0, 1, 7, 100};
  const std::vector<float> x = random_floats(T * heads * d, 24);
  std::vector<double> inv_freq(rotated / 2);
  for (int64_t j = 0; j < rotated / 2; ++j) inv_freq[j] = std::pow(theta, -2.0 * j / rotated);
  const RopeTables rope = make_rope_tables(128, inv_freq, at::kFloat, factor);
  ASSERT_EQ(rope.cos.sizes(), at::IntArrayRef({128, rotated}));
  const std::vector<double> y =
      to_doubles(apply_rope(to_tensor(x, {T, heads, d}), at::tensor(positions, at::kLong), rope));
  std::vector<float> head_part;
  for (int64_t v = 0; v < T * heads; ++v) head_part.insert(head_part.end(), x.begin() + v * d, x.begin() + v * d + rotated);
  const std::vector<double> want = rope_reference(head_part, positions, heads, rotated, theta);
  for (int64_t v = 0; v < T * heads; ++v) {
    for (int64_t j = 0; j < rotated; ++j) EXPECT_NEAR(y[v * d + j], factor * want[v * rotated + j], 1e-5) << v << "," << j;
    for (int64_t j = rotated; j < d; ++j) EXPECT_EQ(y[v * d + j], x[v * d + j]) << v << "," << j;
  }
}

INSTANTIATE_TEST_SUITE_P(LayersThetas, LayersRope, ::testing::Values(10000.0, 500000.0),
                         [](const ::testing::TestParamInfo<double>& info) {
                           return "theta_" + std::to_string(static_cast<int64_t>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// causal_attention

struct AttentionCase {
  int64_t heads;
  int64_t kv_heads;
  int64_t n;
};

// Readable failure messages instead of gtest's byte dump of the struct.
void PrintTo(const AttentionCase& c, std::ostream* os) {
  *os << "heads=" << c.heads << " kv_heads=" << c.kv_heads << " n=" << c.n;
}

std::string attention_case_name(const ::testing::TestParamInfo<AttentionCase>& info) {
  return "heads" + std::to_string(info.param.heads) + "_kv" + std::to_string(info.param.kv_heads) +
         "_n" + std::to_string(info.param.n);
}

std::vector<double> attention_reference(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, int64_t n, int64_t heads,
                                        int64_t kv_heads, int64_t L, int64_t hd, double scale) {
  const int64_t group = heads / kv_heads;
  std::vector<double> out(n * heads * hd, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t last_key = L - n + i;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      std::vector<double> scores(last_key + 1);
      double max_score = -INFINITY;
      for (int64_t j = 0; j <= last_key; ++j) {
        double dot = 0.0;
        for (int64_t e = 0; e < hd; ++e) {
          dot += double(q[(i * heads + h) * hd + e]) * k[(j * kv_heads + g) * hd + e];
        }
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double denom = 0.0;
      for (double& s : scores) denom += (s = std::exp(s - max_score));
      for (int64_t j = 0; j <= last_key; ++j) {
        for (int64_t e = 0; e < hd; ++e) {
          out[i * heads * hd + h * hd + e] += scores[j] / denom * v[(j * kv_heads + g) * hd + e];
        }
      }
    }
  }
  return out;
}

class LayersCausalAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(LayersCausalAttention, matches_float64_reference) {
  const AttentionCase c = GetParam();
  const int64_t L = 5, hd = 4;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  // A wide range makes the softmax far from uniform, so a wrong mask or head shows.
  const std::vector<float> q = random_floats(c.n * c.heads * hd, 31, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(L * c.kv_heads * hd, 32, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(L * c.kv_heads * hd, 33);

  const at::Tensor out = causal_attention(to_tensor(q, {c.n, c.heads, hd}),
                                          to_tensor(k, {L, c.kv_heads, hd}),
                                          to_tensor(v, {L, c.kv_heads, hd}), scale);
  ASSERT_EQ(out.sizes(), at::IntArrayRef({c.n, c.heads * hd}));
  expect_all_near(out, attention_reference(q, k, v, c.n, c.heads, c.kv_heads, L, hd, scale), 1e-5);
}

TEST_P(LayersCausalAttention, each_query_head_reads_its_own_kv_head) {
  // V constant per kv head (value g + 1 for head g): whatever the softmax weights, the output
  // of query head h is exactly the constant of kv head h / group.
  const AttentionCase c = GetParam();
  const int64_t L = 5, hd = 4, group = c.heads / c.kv_heads;
  std::vector<float> v(L * c.kv_heads * hd);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t g = 0; g < c.kv_heads; ++g)
      for (int64_t e = 0; e < hd; ++e) v[(j * c.kv_heads + g) * hd + e] = static_cast<float>(g + 1);

  const at::Tensor out = causal_attention(
      to_tensor(random_floats(c.n * c.heads * hd, 34), {c.n, c.heads, hd}),
      to_tensor(random_floats(L * c.kv_heads * hd, 35), {L, c.kv_heads, hd}),
      to_tensor(v, {L, c.kv_heads, hd}), 0.5);
  std::vector<double> expected(c.n * c.heads * hd);
  for (int64_t i = 0; i < c.n; ++i)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t e = 0; e < hd; ++e) expected[(i * c.heads + h) * hd + e] = h / group + 1;
  expect_all_near(out, expected, 1e-5);
}

TEST_P(LayersCausalAttention, queries_ignore_keys_after_their_position) {
  // Changing the last key/value may change only the last query's output.
  const AttentionCase c = GetParam();
  const int64_t L = 5, hd = 4;
  const at::Tensor q = to_tensor(random_floats(c.n * c.heads * hd, 36), {c.n, c.heads, hd});
  const at::Tensor k = to_tensor(random_floats(L * c.kv_heads * hd, 37), {L, c.kv_heads, hd});
  const at::Tensor v = to_tensor(random_floats(L * c.kv_heads * hd, 38), {L, c.kv_heads, hd});
  at::Tensor k2 = k.clone(), v2 = v.clone();
  k2[L - 1].fill_(3.0);
  v2[L - 1].fill_(-7.0);

  const at::Tensor a = causal_attention(q, k, v, 0.5);
  const at::Tensor b = causal_attention(q, k2, v2, 0.5);
  if (c.n > 1) {
    EXPECT_TRUE(at::equal(a.narrow(0, 0, c.n - 1), b.narrow(0, 0, c.n - 1)));
  }
  EXPECT_FALSE(at::allclose(a[c.n - 1], b[c.n - 1]));
}

// Long prompts go through the attention in blocks of queries, each stopping at its last
// query's key: a 600-token chunk after 100 cached tokens against the float64 reference.
TEST(LayersLongAttention, blocked_prefill_matches_float64_reference) {
  const int64_t n = 600, L = 700, heads = 4, kv_heads = 2, hd = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const std::vector<float> q = random_floats(n * heads * hd, 41, -2.0f, 2.0f);
  const std::vector<float> k = random_floats(L * kv_heads * hd, 42, -2.0f, 2.0f);
  const std::vector<float> v = random_floats(L * kv_heads * hd, 43);
  const at::Tensor out = causal_attention(to_tensor(q, {n, heads, hd}), to_tensor(k, {L, kv_heads, hd}),
                                          to_tensor(v, {L, kv_heads, hd}), scale);
  expect_all_near(out, attention_reference(q, k, v, n, heads, kv_heads, L, hd, scale), 1e-5);
}

// Keys out of position order cannot be cut short: every block then sees every key. The
// same window over the same keys, in order and shuffled, must agree.
TEST(LayersLongAttention, window_with_keys_in_any_order) {
  const int64_t n = 530, L = 530, heads = 4, kv_heads = 2, hd = 8;
  const at::Tensor q = to_tensor(random_floats(n * heads * hd, 44, -2.0f, 2.0f), {n, heads, hd});
  const at::Tensor k = to_tensor(random_floats(L * kv_heads * hd, 45, -2.0f, 2.0f), {L, kv_heads, hd});
  const at::Tensor v = to_tensor(random_floats(L * kv_heads * hd, 46), {L, kv_heads, hd});
  const at::Tensor positions = at::arange(L, at::kLong);
  const AttentionWindow window{4, 100};
  const at::Tensor ordered = windowed_attention(q, k, v, positions, positions, window, 0.3);
  const at::Tensor perm = at::randperm(L, at::TensorOptions().dtype(at::kLong));
  const at::Tensor shuffled = windowed_attention(q, k.index_select(0, perm), v.index_select(0, perm), positions,
                                                 positions.index_select(0, perm), window, 0.3);
  EXPECT_TRUE(at::allclose(ordered, shuffled, 1e-5, 1e-6));
  // And the window matters: without it the last queries see far more keys.
  EXPECT_FALSE(at::allclose(ordered, windowed_attention(q, k, v, positions, positions, {}, 0.3), 1e-3, 1e-4));
}

// A layer's own sliding window (Gemma 2) masks a single decode query too, which sees only
// the last `sliding` keys; soft-capping bounds each score by the cap: both against a float64
// computation over the same keys.
TEST(LayersLongAttention, sliding_window_and_soft_cap_mask_and_bound_every_query) {
  const int64_t L = 20, heads = 4, kv_heads = 2, hd = 8, sliding = 6;
  const double scale = 0.7, cap = 1.5;
  const at::Tensor q = to_tensor(random_floats(heads * hd, 47, -2.0f, 2.0f), {1, heads, hd});
  const at::Tensor k = to_tensor(random_floats(L * kv_heads * hd, 48, -2.0f, 2.0f), {L, kv_heads, hd});
  const at::Tensor v = to_tensor(random_floats(L * kv_heads * hd, 49), {L, kv_heads, hd});
  const at::Tensor kp = at::arange(L, at::kLong), qp = at::full({1}, L - 1, at::kLong);
  AttentionWindow window;
  window.sliding = sliding;
  window.softcap = cap;
  const at::Tensor out = windowed_attention(q, k, v, qp, kp, window, scale);
  // Reference: query head h reads kv head h / 2, over keys L - sliding .. L - 1 only.
  const at::Tensor qd = q.to(at::kDouble)[0], kd = k.to(at::kDouble), vd = v.to(at::kDouble);
  std::vector<at::Tensor> heads_out;
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor keys = kd.narrow(0, L - sliding, sliding).select(1, h / 2);
    const at::Tensor scores = (keys.matmul(qd[h]) * scale / cap).tanh() * cap;
    heads_out.push_back(at::softmax(scores, 0).matmul(vd.narrow(0, L - sliding, sliding).select(1, h / 2)));
  }
  const at::Tensor ref = at::cat(heads_out).view({1, heads * hd});
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), ref, 1e-5, 1e-6)) << (out.to(at::kDouble) - ref).abs().max();
  // Without the window the same query sees all 20 keys.
  window.sliding = 0;
  EXPECT_FALSE(at::allclose(windowed_attention(q, k, v, qp, kp, window, scale).to(at::kDouble), ref, 1e-3, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(LayersHeadLayouts, LayersCausalAttention,
                         ::testing::Values(AttentionCase{8, 2, 1}, AttentionCase{8, 2, 3},
                                           AttentionCase{4, 4, 1}, AttentionCase{4, 4, 3},
                                           AttentionCase{4, 1, 1}, AttentionCase{4, 1, 3}),
                         attention_case_name);

// ---------------------------------------------------------------------------------------------
// swiglu

TEST(LayersSwiglu, matches_float64_reference) {
  const int64_t T = 3, ff = 5;
  const std::vector<float> gu = random_floats(T * 2 * ff, 41, -4.0f, 4.0f);
  std::vector<double> expected(T * ff);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < ff; ++i) {
      const double gate = gu[t * 2 * ff + i], up = gu[t * 2 * ff + ff + i];
      expected[t * ff + i] = gate / (1.0 + std::exp(-gate)) * up;
    }
  }
  const at::Tensor y = swiglu(to_tensor(gu, {T, 2 * ff}));
  ASSERT_EQ(y.sizes(), at::IntArrayRef({T, ff}));
  expect_all_near(y, expected, 1e-5);
}

// ---------------------------------------------------------------------------------------------
// dense

std::vector<double> dense_reference(const std::vector<float>& x, const std::vector<float>& w,
                                    const std::vector<float>* bias, int64_t rows, int64_t in,
                                    int64_t out) {
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias ? (*bias)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += double(x[r * in + i]) * w[o * in + i];
      y[r * out + o] = acc;
    }
  }
  return y;
}

class LayersDense : public ::testing::TestWithParam<bool> {};

TEST_P(LayersDense, single_row_and_matrix_paths_match_reference) {
  const bool with_bias = GetParam();
  const int64_t in = 7, out = 6;
  const std::vector<float> w = random_floats(out * in, 51);
  const std::vector<float> b = random_floats(out, 52);
  const std::vector<float> x3 = random_floats(3 * in, 53);
  const std::vector<float> x1(x3.begin(), x3.begin() + in);
  const at::Tensor wt = to_tensor(w, {out, in});
  const at::Tensor bt = with_bias ? to_tensor(b, {out}) : at::Tensor();
  const std::vector<float>* bias = with_bias ? &b : nullptr;

  const at::Tensor y1 = dense(to_tensor(x1, {1, in}), wt, bt);
  ASSERT_EQ(y1.sizes(), at::IntArrayRef({1, out}));
  expect_all_near(y1, dense_reference(x1, w, bias, 1, in, out), 1e-5);

  const at::Tensor y3 = dense(to_tensor(x3, {3, in}), wt, bt);
  ASSERT_EQ(y3.sizes(), at::IntArrayRef({3, out}));
  expect_all_near(y3, dense_reference(x3, w, bias, 3, in, out), 1e-5);

  // Batch-1 decode and a batch of rows take different kernels: a token must not get
  // different activations depending on which one computed it.
  const at::Tensor x3t = to_tensor(x3, {3, in});
  for (int64_t r = 0; r < 3; ++r) {
    const at::Tensor row = dense(x3t.narrow(0, r, 1), wt, bt);
    EXPECT_TRUE(at::allclose(row, y3.narrow(0, r, 1), /*rtol=*/1e-6, /*atol=*/1e-6)) << "row " << r;
  }
}

// Small batches stream the weights once per group of inputs; more rows take the faster of the
// kernels and BLAS. Every size, with a column count that leaves a tail after the 8-wide
// vectors, matches the reference.
TEST_P(LayersDense, small_batch_path_matches_reference) {
  const bool with_bias = GetParam();
  const int64_t in = 37, out = 70;
  const std::vector<float> w = random_floats(out * in, 61);
  const std::vector<float> b = random_floats(out, 62);
  const at::Tensor wt = to_tensor(w, {out, in});
  const at::Tensor bt = with_bias ? to_tensor(b, {out}) : at::Tensor();
  for (int64_t n : {2, 3, 4, 5, 7, 8, 9, 12}) {
    const std::vector<float> x = random_floats(n * in, 63 + n);
    const at::Tensor y = dense(to_tensor(x, {n, in}), wt, bt);
    ASSERT_EQ(y.sizes(), at::IntArrayRef({n, out}));
    expect_all_near(y, dense_reference(x, w, with_bias ? &b : nullptr, n, in, out), 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(LayersBias, LayersDense, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("with_bias") : std::string("no_bias");
                         });

}  // namespace
}  // namespace kvpipe
