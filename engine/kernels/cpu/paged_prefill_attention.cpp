#include "engine/kernels/cpu/paged_prefill_attention.h"

#include "engine/kernels/cpu/paged_attention_impl.h"
#include "engine/kernels/cpu/quant_impl.h"
#include "engine/kernels/cpu/thread_pool.h"
#include "engine/kernels/cpu/vector_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpipe {
namespace {

using namespace paged_impl;

// Keys a chunk holds, at positions c0 .. c0 + 31 with c0 a multiple of 32: a row's chunks are
// the same whatever tile it is in.
constexpr int64_t kKeys = 32;
// Query rows (tokens x the group's query heads) a work item takes: enough to share each
// chunk's decoded keys and values among many rows, few enough that a causal prompt's diagonal
// chunks waste little and a prompt of a few hundred tokens still makes an item per thread.
constexpr int64_t kTileRows = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The tile kernels of the portable build: scores s[r, j] = scale * q_r . k_j with k held
// transposed (kt[d * kKeys + j]), one float sum per score over d in order; the softmax terms
// exp(s - m); acc_r += sum_j p[r, j] v_j, key by key.
struct PortableTile {
  static void scores(const float* q, int64_t rows, int64_t hd, const float* kt, float scale, float* s) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kKeys; ++j) {
        float a = 0.0f;
        for (int64_t d = 0; d < hd; ++d) a += q[r * hd + d] * kt[d * kKeys + j];
        s[r * kKeys + j] = a * scale;
      }
  }
  static float row_max(const float* s) { return *std::max_element(s, s + kKeys); }
  static float exp_sum(float* s, float m) {
    float sum = 0.0f;
    for (int64_t j = 0; j < kKeys; ++j) sum += s[j] = std::exp(s[j] - m);
    return sum;
  }
  static void accumulate(const float* p, int64_t rows, int64_t hd, const float* const* v, float* acc) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kKeys; ++j) PortableOps::axpy(acc + r * hd, p[r * kKeys + j], v[j], hd);
  }
};

#if defined(__x86_64__)
// Six rows by sixteen keys (twelve accumulators) per pass over the head's values; each score is
// one FMA chain over d in order.
template <int MR>
KVPIPE_PAGED_AVX2 void scores_rows(const float* q, int64_t hd, const float* kt, float scale, float* s) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t half = 0; half < kKeys; half += 16) {
    __m256 a[MR][2];
    for (int r = 0; r < MR; ++r) a[r][0] = _mm256_setzero_ps(), a[r][1] = _mm256_setzero_ps();
    const float* k = kt + half;
    for (int64_t d = 0; d < hd; ++d) {
      const __m256 k0 = _mm256_loadu_ps(k + d * kKeys), k1 = _mm256_loadu_ps(k + d * kKeys + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q + r * hd + d);
        a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(s + r * kKeys + half, _mm256_mul_ps(a[r][0], sc));
      _mm256_storeu_ps(s + r * kKeys + half + 8, _mm256_mul_ps(a[r][1], sc));
    }
  }
}

// Six rows by NV * 8 of the head's values, accumulators in registers over the chunk's keys.
template <int MR, int NV>
KVPIPE_PAGED_AVX2 void accumulate_rows(const float* p, int64_t hd, const float* const* v, float* acc, int64_t d0) {
  __m256 c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NV; ++t) c[r][t] = _mm256_loadu_ps(acc + r * hd + d0 + 8 * t);
  for (int64_t j = 0; j < kKeys; ++j) {
    __m256 vj[NV];
    for (int t = 0; t < NV; ++t) vj[t] = _mm256_loadu_ps(v[j] + d0 + 8 * t);
    for (int r = 0; r < MR; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * kKeys + j);
      for (int t = 0; t < NV; ++t) c[r][t] = _mm256_fmadd_ps(pb, vj[t], c[r][t]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int t = 0; t < NV; ++t) _mm256_storeu_ps(acc + r * hd + d0 + 8 * t, c[r][t]);
}

struct Avx2Tile {
  KVPIPE_PAGED_AVX2 static void scores(const float* q, int64_t rows, int64_t hd, const float* kt, float scale,
                                       float* s) {
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) scores_rows<6>(q + r * hd, hd, kt, scale, s + r * kKeys);
    switch (rows - r) {
      case 5: return scores_rows<5>(q + r * hd, hd, kt, scale, s + r * kKeys);
      case 4: return scores_rows<4>(q + r * hd, hd, kt, scale, s + r * kKeys);
      case 3: return scores_rows<3>(q + r * hd, hd, kt, scale, s + r * kKeys);
      case 2: return scores_rows<2>(q + r * hd, hd, kt, scale, s + r * kKeys);
      case 1: return scores_rows<1>(q + r * hd, hd, kt, scale, s + r * kKeys);
      default: return;
    }
  }
  KVPIPE_PAGED_AVX2 static float row_max(const float* s) {
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8)),
                             _mm256_max_ps(_mm256_loadu_ps(s + 16), _mm256_loadu_ps(s + 24)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  KVPIPE_PAGED_AVX2 static float exp_sum(float* s, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kKeys; j += 8) {
      const __m256 e = vector_exp::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    return horizontal_sum(sum);
  }
  template <int MR>
  KVPIPE_PAGED_AVX2 static void accumulate_block(const float* p, int64_t hd, const float* const* v, float* acc) {
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) accumulate_rows<MR, 2>(p, hd, v, acc, d);
    if (d < hd) accumulate_rows<MR, 1>(p, hd, v, acc, d);  // head sizes are multiples of 8 here
  }
  KVPIPE_PAGED_AVX2 static void accumulate(const float* p, int64_t rows, int64_t hd, const float* const* v,
                                           float* acc) {
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) accumulate_block<6>(p + r * kKeys, hd, v, acc + r * hd);
    switch (rows - r) {
      case 5: return accumulate_block<5>(p + r * kKeys, hd, v, acc + r * hd);
      case 4: return accumulate_block<4>(p + r * kKeys, hd, v, acc + r * hd);
      case 3: return accumulate_block<3>(p + r * kKeys, hd, v, acc + r * hd);
      case 2: return accumulate_block<2>(p + r * kKeys, hd, v, acc + r * hd);
      case 1: return accumulate_block<1>(p + r * kKeys, hd, v, acc + r * hd);
      default: return;
    }
  }
};
#endif

// Tokens [first, last) of sequence `seq`'s new ones, for KV head `head`.
struct Item {
  int64_t seq = 0, head = 0, first = 0, last = 0;
  int64_t keys = 0;  // the last token's position + 1: the work's measure, for the order
};

struct TileScratch {
  std::vector<float> q, kt, v, s, m, l, acc, row;
  std::vector<const float*> values;  // [kKeys]: each value row as float32 (the pool's own for float32)
  std::vector<VisibleKeys> seen;  // [tokens]: the keys each token sees
  std::vector<uint8_t> visible;   // [tokens, kKeys]
  std::vector<uint8_t> any;       // [kKeys]
};

template <class Ops, class Tile>
void attend_tile(const float* q, int64_t num_heads, const PagedKvLayer& kv, const int32_t* table, int64_t max_blocks,
                 int64_t first_position, int64_t group, const Item& item, const PagedDecodeWindow& window, float scale,
                 float* out, TileScratch& t) {
  const int64_t hd = kv.head_dim, bs = kv.block_size;
  const int64_t tokens = item.last - item.first, rows = tokens * group;
  t.q.resize(static_cast<size_t>(rows * hd));
  t.acc.assign(static_cast<size_t>(rows * hd), 0.0f);
  t.kt.resize(static_cast<size_t>(hd * kKeys));
  t.v.resize(static_cast<size_t>(kKeys * hd));
  t.s.resize(static_cast<size_t>(rows * kKeys));
  t.m.assign(static_cast<size_t>(rows), kNegInf);
  t.l.assign(static_cast<size_t>(rows), 0.0f);
  t.row.resize(static_cast<size_t>(hd));
  t.values.resize(kKeys);
  t.visible.resize(static_cast<size_t>(tokens * kKeys));
  t.any.resize(kKeys);
  // Row r = i * group + g: token first + i, query head head * group + g.
  for (int64_t i = 0; i < tokens; ++i)
    std::memcpy(t.q.data() + i * group * hd, q + ((item.first + i) * num_heads + item.head * group) * hd,
                static_cast<size_t>(group * hd) * sizeof(float));
  const int64_t p_first = first_position + item.first, p_last = first_position + item.last - 1;
  t.seen.resize(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) t.seen[i] = visible_keys(p_first + i + 1, window);
  // Every key a token of the tile sees lies in [a0, a1) or [b0, p_last]: the first token's
  // ranges joined to the last one's (a visible range's ends only move forward with the position).
  const int64_t a0 = t.seen.front().a0, a1 = t.seen.back().a1, b0 = t.seen.front().b0;
  const float softcap = static_cast<float>(window.softcap);
  for (int64_t c0 = std::min(a0, b0) / kKeys * kKeys; c0 <= p_last; c0 += kKeys) {
    const int64_t c1 = c0 + kKeys;
    if (!(c0 < a1 && a0 < c1) && !(b0 < c1)) continue;
    // Which keys each token sees; no mask where every token sees the whole chunk.
    const bool all_visible = std::all_of(t.seen.begin(), t.seen.end(),
                                         [&](const VisibleKeys& v) { return v.covers(c0, c1); });
    if (!all_visible) {
      std::fill(t.any.begin(), t.any.end(), uint8_t{0});
      for (int64_t i = 0; i < tokens; ++i)
        for (int64_t j = 0; j < kKeys; ++j) {
          const uint8_t v = t.seen[i].contains(c0 + j) ? 1 : 0;
          t.visible[i * kKeys + j] = v;
          t.any[j] |= v;
        }
      if (std::find(t.any.begin(), t.any.end(), uint8_t{1}) == t.any.end()) continue;
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t k = c0 + j;
      float* vrow = t.v.data() + j * hd;
      if (!all_visible && !t.any[j]) {
        std::fill(vrow, vrow + hd, 0.0f);
        t.values[j] = vrow;
        for (int64_t d = 0; d < hd; ++d) t.kt[d * kKeys + j] = 0.0f;
        continue;
      }
      const int64_t b = k / bs;
      const int32_t block = b < max_blocks ? table[b] : -1;
      if (block < 0 || block >= kv.num_blocks)
        throw std::invalid_argument("paged prefill attention: block_tables entry " + std::to_string(block) +
                                    " for position " + std::to_string(k) + " is outside the pool's " +
                                    std::to_string(kv.num_blocks) + " blocks");
      const int64_t slot_row = (static_cast<int64_t>(block) * bs + k % bs) * kv.kv_heads + item.head;
      const float* key = load_row<Ops>(kv, kv.keys, kv.key_scales, slot_row, t.row.data());
      for (int64_t d = 0; d < hd; ++d) t.kt[d * kKeys + j] = key[d];
      t.values[j] = load_row<Ops>(kv, kv.values, kv.value_scales, slot_row, vrow);
    }
    Tile::scores(t.q.data(), rows, hd, t.kt.data(), scale, t.s.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* s = t.s.data() + r * kKeys;
      if (softcap > 0)
        for (int64_t j = 0; j < kKeys; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
      if (!all_visible) {
        const uint8_t* vis = t.visible.data() + (r / group) * kKeys;
        for (int64_t j = 0; j < kKeys; ++j)
          if (!vis[j]) s[j] = kNegInf;
      }
      const float chunk_max = Tile::row_max(s);
      if (chunk_max == kNegInf) {  // this row sees none of the chunk: its terms are all 0
        std::fill(s, s + kKeys, 0.0f);
        continue;
      }
      const float m_new = std::max(t.m[r], chunk_max);
      if (m_new > t.m[r] && t.l[r] > 0) {
        const float f = std::exp(t.m[r] - m_new);
        t.l[r] *= f;
        Ops::scale(t.acc.data() + r * hd, f, hd);
      }
      t.m[r] = m_new;
      t.l[r] += Tile::exp_sum(s, m_new);
    }
    Tile::accumulate(t.s.data(), rows, hd, t.values.data(), t.acc.data());
  }
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      float* o = out + ((item.first + i) * num_heads + item.head * group + g) * hd;
      std::memcpy(o, t.acc.data() + r * hd, static_cast<size_t>(hd) * sizeof(float));
      Ops::scale(o, 1.0f / t.l[r], hd);
    }
}

template <class Ops, class Tile>
void run(const float* q, int64_t num_heads, const PagedKvLayer& kv, const int32_t* block_tables, int64_t max_blocks,
         const int32_t* context_lens, const int32_t* cu_seqlens_q, int64_t num_seqs, const PagedDecodeWindow& window,
         float scale, float* out) {
  const int64_t kvh = kv.kv_heads, group = num_heads / kvh;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  // The work list is rebuilt per call in memory kept from call to call; the pool's threads
  // read it through the pointer.
  thread_local std::vector<Item> items;
  items.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = cu_seqlens_q[s + 1] - cu_seqlens_q[s], len = context_lens[s];
    if (n < 0)
      throw std::invalid_argument("paged prefill attention: cu_seqlens_q decreases at sequence " + std::to_string(s));
    if (n == 0) continue;
    if (len < n || len > max_blocks * kv.block_size)
      throw std::invalid_argument("paged prefill attention: context_lens[" + std::to_string(s) + "] = " +
                                  std::to_string(len) + " is outside [" + std::to_string(n) + ", " +
                                  std::to_string(max_blocks * kv.block_size) + "]");
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t first = 0; first < n; first += tile_tokens) {
        const int64_t last = std::min(n, first + tile_tokens);
        items.push_back({s, h, first, last, len - n + last});
      }
  }
  // Longest first, so that the last items handed out are short ones.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const Item* work = items.data();
  parallel_chunks(static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local TileScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = work[i];
      const int64_t row0 = cu_seqlens_q[item.seq];
      const int64_t n = cu_seqlens_q[item.seq + 1] - row0;
      attend_tile<Ops, Tile>(q + row0 * num_heads * kv.head_dim, num_heads, kv, block_tables + item.seq * max_blocks,
                             max_blocks, context_lens[item.seq] - n, group, item, window, scale,
                             out + row0 * num_heads * kv.head_dim, scratch);
    }
  });
}

}  // namespace

void paged_prefill_attention_cpu(const float* q, int64_t num_heads, const PagedKvLayer& kv,
                                 const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                 const int32_t* cu_seqlens_q, int64_t num_seqs, const PagedDecodeWindow& window,
                                 float scale, float* out) {
  if (num_seqs <= 0) return;
  if (kv.kv_heads < 1 || num_heads % kv.kv_heads != 0)
    throw std::invalid_argument("paged prefill attention: " + std::to_string(num_heads) +
                                " query heads are not a multiple of " + std::to_string(kv.kv_heads) + " KV heads");
  if (kv.dtype == KvDtype::kQ8_0 && kv.head_dim % kQ8Group != 0)
    throw std::invalid_argument("paged prefill attention: q8_0 rows of " + std::to_string(kv.head_dim) +
                                " values are not whole 32-value groups");
#if defined(__x86_64__)
  if (quant_impl::use_avx2() && kv.head_dim % 8 == 0)
    return run<Avx2Ops, Avx2Tile>(q, num_heads, kv, block_tables, max_blocks, context_lens, cu_seqlens_q, num_seqs,
                                  window, scale, out);
#endif
  run<PortableOps, PortableTile>(q, num_heads, kv, block_tables, max_blocks, context_lens, cu_seqlens_q, num_seqs,
                                 window, scale, out);
}

}  // namespace kvpipe
