// Paged attention for a few query rows per request (decode, speculative verification),
// reading K and V in place from their pages: no gather into a padded copy, no mask.
//
// One work item per (request, KV head): the request's queries of that head's GQA group
// (qo_len x group rows) score every key once, take a softmax, and sum the values once.
// Keys and values are read page by page (HND: a page of one head is one contiguous
// [page_size, head_dim] block), converted to float, and used by all rows of the item.
// Accumulation is in float whatever the cache's dtype.
#include <ATen/ATen.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

// 16 independent partial sums: a reduction the compiler vectorizes without -ffast-math.
inline float dot(const float* a, const float* b, int64_t d) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < d; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += part[j];
  return s;
}

inline void axpy(float* y, const float* x, float a, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * x[i];
}

// e^x for x <= 0 (softmax after subtracting the max), vectorizable unlike std::exp:
// 2^(x log2 e) split into an integer power (the float's exponent bits) and 2^f, f in
// [0, 1), by a degree-6 polynomial (relative error ~2e-7).
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;
  const float fi = std::floor(t), f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// SIMD rows of float: 16 lanes (AVX-512) or 8 (AVX2), loaded from float or bf16 (whose
// bits are a float's upper half). Elsewhere, and for fp16 caches, the scalar loops.
#if defined(__AVX512F__)
#define PA_SIMD 1
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define PA_SIMD 1
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline float vsum(vfloat v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}
#endif

constexpr int64_t kMaxHeadDim = 256;

template <typename KV>
constexpr bool simd_type() {
#ifdef PA_SIMD
  return std::is_same_v<KV, float> || std::is_same_v<KV, c10::BFloat16>;
#else
  return false;
#endif
}

// score[r * stride] = q_r . k for each of `rows` query rows (q already scaled, float)
template <typename KV>
inline void score_rows(const KV* k, const float* q, int64_t rows, int64_t d, float* score,
                       int64_t stride, float* row) {
#ifdef PA_SIMD
  if constexpr (simd_type<KV>()) {
    if (d % kLanes == 0 && d <= kMaxHeadDim) {
      vfloat kv[kMaxHeadDim / kLanes];
      const int64_t chunks = d / kLanes;
      for (int64_t c = 0; c < chunks; ++c) kv[c] = vload(k + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        vfloat acc = vzero();
        for (int64_t c = 0; c < chunks; ++c) acc = vfma(vload(q + r * d + c * kLanes), kv[c], acc);
        score[r * stride] = vsum(acc);
      }
      return;
    }
  }
#endif
  load_row(k, row, d);
  for (int64_t r = 0; r < rows; ++r) score[r * stride] = dot(q + r * d, row, d);
}

// acc_r += p[r * stride] * v for each row whose weight is not zero
template <typename KV>
inline void accumulate_rows(const KV* v, const float* p, int64_t stride, int64_t rows, int64_t d,
                            float* acc, float* row) {
#ifdef PA_SIMD
  if constexpr (simd_type<KV>()) {
    if (d % kLanes == 0 && d <= kMaxHeadDim) {
      vfloat vv[kMaxHeadDim / kLanes];
      const int64_t chunks = d / kLanes;
      for (int64_t c = 0; c < chunks; ++c) vv[c] = vload(v + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const float w = p[r * stride];
        if (w == 0.f) continue;
        const vfloat wv = vset1(w);
        float* a = acc + r * d;
        for (int64_t c = 0; c < chunks; ++c) vstore(a + c * kLanes, vfma(wv, vv[c], vload(a + c * kLanes)));
      }
      return;
    }
  }
#endif
  load_row(v, row, d);
  for (int64_t r = 0; r < rows; ++r) {
    const float w = p[r * stride];
    if (w != 0.f) axpy(acc + r * d, row, w, d);
  }
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16: dot products straight from the stored bf16
// (32 pairs per instruction, float accumulation), no conversion of K or V. Keys are
// transposed per block of 16 so that one instruction scores 16 keys for a pair of q's dims
// (no horizontal sums); the outputs of up to 4 rows stay in registers while the values
// stream past once. Against per-row dot products with a transpose-and-add of the sums:
// 4 verify rows of one request 84 against 114 us per layer, 16 decode rows 506 against
// 561 us (~400-token contexts, SmolLM2's 9/3 heads of 64).
#define PA_BF16 1
constexpr int64_t kBlock = 16;   // tokens scored together

// 16 x 16 transpose of 32-bit elements in registers: r[i] holds row i before, column i after
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {   // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // r[i + c], lane L: column 4L + c of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {       // a 4 x 4 transpose of 128-bit lanes
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

inline uint16_t bf16_bits(float f) {   // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m512bh bcast_pair(const uint16_t* pair) {   // (pair[0], pair[1]) in every lane
  int32_t v;
  std::memcpy(&v, pair, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// kt[p], lane j: key j's dims (2p, 2p + 1), for the n <= 16 keys of a block (zeros past n):
// then one dot-product instruction scores 16 keys for one pair of q's dims, no horizontal sums
inline void transpose_keys(const c10::BFloat16* const* keys, int64_t n, int64_t d, __m512i* kt) {
  for (int64_t c = 0; c < d / 32; ++c) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_si512(keys[j] + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; ++i) kt[16 * c + i] = r[i];
  }
}

// scores[i * stride + j] = scale * q_i . key_j for R rows of q (bf16, [R, d]) and a block's
// 16 keys; two accumulators per row halve the dependency chains
template <int R>
inline void score_rows_bf16(const __m512i* kt, const uint16_t* qb, int64_t d, __mmask16 valid, __m512 scale,
                            float* scores, int64_t stride) {
  __m512 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < d / 2; p += 2) {
    const __m512bh k0 = (__m512bh)kt[p], k1 = (__m512bh)kt[p + 1];
    for (int i = 0; i < R; ++i) {
      even[i] = _mm512_dpbf16_ps(even[i], k0, bcast_pair(qb + i * d + 2 * p));
      odd[i] = _mm512_dpbf16_ps(odd[i], k1, bcast_pair(qb + i * d + 2 * p + 2));
    }
  }
  for (int i = 0; i < R; ++i)
    _mm512_mask_storeu_ps(scores + i * stride, valid, _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), scale));
}

inline void score_block_bf16(const __m512i* kt, int64_t n, const uint16_t* qb, int64_t rows, int64_t d,
                             float scale, float* scores, int64_t stride) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  const __m512 s = _mm512_set1_ps(scale);
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) score_rows_bf16<4>(kt, qb + r * d, d, valid, s, scores + r * stride, stride);
  switch (rows - r) {
    case 3: score_rows_bf16<3>(kt, qb + r * d, d, valid, s, scores + r * stride, stride); break;
    case 2: score_rows_bf16<2>(kt, qb + r * d, d, valid, s, scores + r * stride, stride); break;
    case 1: score_rows_bf16<1>(kt, qb + r * d, d, valid, s, scores + r * stride, stride); break;
    default: break;
  }
}

// R rows' outputs (per row, chunk c of 32 dims: 16 float lanes "lo" then 16 "hi", in unpack
// order) = sum over tokens of p * v, tokens in pairs (t, t + 1): w[i * wstride + t / 2] is row
// i's (p_t, p_t+1) in bf16. The accumulators stay in registers; each value pair is loaded and
// interleaved once for the R rows. C = d / 32.
template <int R, int C>
inline void accumulate_values_bf16(const c10::BFloat16* const* vals, int64_t kv_len, const uint16_t* zeros,
                                   const uint32_t* w, int64_t wstride, float* acc, int64_t d) {
  __m512 a[R][2 * C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 2 * C; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < kv_len; t += 2) {
    const void* va = vals[t];
    const void* vb = t + 1 < kv_len ? static_cast<const void*>(vals[t + 1]) : zeros;
    __m512bh lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(static_cast<const char*>(va) + 64 * c);
      const __m512i y = _mm512_loadu_si512(static_cast<const char*>(vb) + 64 * c);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);   // per 128-bit lane: (x_i, y_i), i = 0..3
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);   //                   (x_i, y_i), i = 4..7
    }
    for (int i = 0; i < R; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[i * wstride + t / 2]));
      for (int c = 0; c < C; ++c) {
        a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], lo[c], p);
        a[i][2 * c + 1] = _mm512_dpbf16_ps(a[i][2 * c + 1], hi[c], p);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + i * d * 2 + 64 * c, a[i][2 * c]);
      _mm512_storeu_ps(acc + i * d * 2 + 64 * c + 16, a[i][2 * c + 1]);
    }
}

// every row's outputs, in groups of rows that keep their accumulators in registers
template <int C>
inline void accumulate_rows_bf16(const c10::BFloat16* const* vals, int64_t kv_len, const uint16_t* zeros,
                                 const uint32_t* w, int64_t wstride, int64_t rows, float* acc, int64_t d) {
  constexpr int R = C <= 2 ? 4 : (C == 4 ? 2 : 1);   // 4 x 2C accumulators fit the 32 registers
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    accumulate_values_bf16<R, C>(vals, kv_len, zeros, w + r * wstride, wstride, acc + r * d * 2, d);
  for (; r < rows; ++r)
    accumulate_values_bf16<1, C>(vals, kv_len, zeros, w + r * wstride, wstride, acc + r * d * 2, d);
}

inline void accumulate_bf16(const c10::BFloat16* const* vals, int64_t kv_len, const uint16_t* zeros,
                            const uint32_t* w, int64_t wstride, int64_t rows, float* acc, int64_t d) {
  switch (d / 32) {
    case 1: accumulate_rows_bf16<1>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 2: accumulate_rows_bf16<2>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 3: accumulate_rows_bf16<3>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 4: accumulate_rows_bf16<4>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 5: accumulate_rows_bf16<5>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 6: accumulate_rows_bf16<6>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    case 7: accumulate_rows_bf16<7>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
    default: accumulate_rows_bf16<8>(vals, kv_len, zeros, w, wstride, rows, acc, d); break;
  }
}

// the unpack order back to dims: chunk c, half h, lane l -> dim 32c + 8(l / 4) + 4h + l % 4
inline void unpermute_bf16(const float* acc, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d / 32; ++c)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t l = 0; l < 16; ++l)
          out[r * d + 32 * c + 8 * (l / 4) + 4 * h + l % 4] = acc[r * d * 2 + 64 * c + 16 * h + l];
}
#endif

struct Geometry {
  int64_t page_size, head_dim, group;
  int64_t page_stride, head_stride, token_stride;  // in elements, same for k and v caches
};

template <typename Q, typename KV>
void attend(const Geometry& g, const Q* q, int64_t q_token_stride, Q* out, int64_t out_token_stride,
            const KV* k_cache, const KV* v_cache, const int64_t* qo_indptr,
            const int64_t* kv_indptr, const int64_t* kv_indices, const int64_t* kv_lens,
            bool causal, float scale, int64_t batch, int64_t num_kv_heads) {
  const int64_t d = g.head_dim;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, acc, row(d), acc2;
    std::vector<uint16_t> qb, zeros;
    std::vector<uint32_t> weights;
    std::vector<const KV*> ptrs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t q0 = qo_indptr[b], qo_len = qo_indptr[b + 1] - q0;
      const int64_t kv_len = kv_lens[b];
      if (qo_len <= 0 || kv_len <= 0) continue;
      const int64_t rows = qo_len * g.group;  // row r: query r / group, head h * group + r % group
      scores.assign(rows * kv_len, 0.f);
      acc.assign(rows * d, 0.f);
      auto q_row = [&](int64_t r) {
        return q + (q0 + r / g.group) * q_token_stride + (h * g.group + r % g.group) * d;
      };
      // the last key row r may see: with causal, query i of qo_len sits at kv_len - qo_len + i
      auto visible = [&](int64_t r) {
        return causal ? kv_len - qo_len + r / g.group + 1 : kv_len;
      };
      const int64_t* pages = kv_indices + kv_indptr[b];
      // calls f(t, pointer to token t's row of head h) over the request's tokens, page by page
      auto for_each_token = [&](const KV* cache, auto&& f) {
        for (int64_t start = 0, p = 0; start < kv_len; start += g.page_size, ++p) {
          const KV* base = cache + pages[p] * g.page_stride + h * g.head_stride;
          const int64_t n = std::min(g.page_size, kv_len - start);
          for (int64_t i = 0; i < n; ++i) f(start + i, base + i * g.token_stride);
        }
      };
#ifdef PA_BF16
      constexpr bool bf16_path = std::is_same_v<KV, c10::BFloat16>;
      const bool dot_bf16 = bf16_path && d % 32 == 0 && d <= kMaxHeadDim;
#else
      const bool dot_bf16 = false;
#endif
      if (dot_bf16) {
#ifdef PA_BF16
        if constexpr (bf16_path) {
          qb.resize(rows * d);   // q unscaled in bf16 (a bf16 model's q is bf16 already)
          for (int64_t r = 0; r < rows; ++r) {
            const Q* src = q_row(r);
            for (int64_t i = 0; i < d; ++i) qb[r * d + i] = bf16_bits(to_float(src[i]));
          }
          ptrs.clear();
          for_each_token(k_cache, [&](int64_t, const KV* k) { ptrs.push_back(k); });
          alignas(64) __m512i kt[kMaxHeadDim / 2];
          for (int64_t first = 0; first < kv_len; first += kBlock) {
            const int64_t n = std::min(kBlock, kv_len - first);
            transpose_keys(ptrs.data() + first, n, d, kt);
            score_block_bf16(kt, n, qb.data(), rows, d, scale, scores.data() + first, kv_len);
          }
        }
#endif
      } else {
        qf.resize(rows * d);   // q scaled, in float
        for (int64_t r = 0; r < rows; ++r) {
          load_row(q_row(r), qf.data() + r * d, d);
          for (int64_t i = 0; i < d; ++i) qf[r * d + i] *= scale;
        }
        for_each_token(k_cache, [&](int64_t t, const KV* k) {
          score_rows(k, qf.data(), rows, d, scores.data() + t, kv_len, row.data());
        });
      }
      std::vector<float> denom(rows);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * kv_len;
        const int64_t n = visible(r);
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          s[t] = exp_nonpositive(s[t] - m);
          sum += s[t];
        }
        for (int64_t t = n; t < kv_len; ++t) s[t] = 0.f;
        denom[r] = sum;
      }
      if (dot_bf16) {
#ifdef PA_BF16
        if constexpr (bf16_path) {
          // each row's weights in bf16 pairs of tokens (t, t + 1); an odd last token pairs
          // with a zero row of weight 0
          const int64_t npairs = (kv_len + 1) / 2;
          weights.assign(rows * npairs, 0u);
          for (int64_t r = 0; r < rows; ++r) {
            const float* s = scores.data() + r * kv_len;
            uint32_t* w = weights.data() + r * npairs;
            for (int64_t t = 0; t < kv_len; t += 2)
              w[t / 2] = bf16_bits(s[t]) | (t + 1 < kv_len ? static_cast<uint32_t>(bf16_bits(s[t + 1])) << 16 : 0u);
          }
          ptrs.clear();
          for_each_token(v_cache, [&](int64_t, const KV* v) { ptrs.push_back(v); });
          zeros.assign(d, 0);
          acc2.assign(rows * d * 2, 0.f);
          accumulate_bf16(ptrs.data(), kv_len, zeros.data(), weights.data(), npairs, rows, acc2.data(), d);
          unpermute_bf16(acc2.data(), rows, d, acc.data());
        }
#endif
      } else {
        for_each_token(v_cache, [&](int64_t t, const KV* v) {
          accumulate_rows(v, scores.data() + t, kv_len, rows, d, acc.data(), row.data());
        });
      }
      for (int64_t r = 0; r < rows; ++r) {
        Q* dst = out + (q0 + r / g.group) * out_token_stride + (h * g.group + r % g.group) * d;
        const float inv = 1.f / denom[r];
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<Q>(acc[r * d + i] * inv);
      }
    }
  });
}

template <typename Q>
void dispatch_kv(const Geometry& g, const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                 const at::Tensor& kv_indices, const at::Tensor& kv_lens, bool causal, float scale) {
  const int64_t batch = kv_lens.size(0), num_kv_heads = q.size(1) / g.group;
  auto run = [&](auto* k, auto* v) {
    attend(g, q.data_ptr<Q>(), q.stride(0), out.data_ptr<Q>(), out.stride(0), k, v, qo_indptr.data_ptr<int64_t>(),
           kv_indptr.data_ptr<int64_t>(), kv_indices.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
           causal, scale, batch, num_kv_heads);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
    case at::kBFloat16: run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "paged_attention: KV cache dtype ", k_cache.scalar_type(), " is not supported");
  }
}

// q [nnz, Hq, D]; k_cache, v_cache [pages, A, B, D] (NHD: A = page_size, B = heads;
// HND: A = heads, B = page_size), D contiguous; int64 qo_indptr [batch + 1],
// kv_indptr [batch + 1], kv_indices, kv_lens [batch]. Returns [nnz, Hq, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           bool hnd, const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                           const at::Tensor& kv_indices, const at::Tensor& kv_lens, int64_t num_kv_heads,
                           bool causal, double sm_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_attention: q must be [nnz, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "paged_attention: k and v caches must be 4-D views of one shape and layout");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.size(3) == q.size(2),
              "paged_attention: the caches' head_dim must be contiguous and equal q's");
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "paged_attention: q heads must be a multiple of KV heads");
  for (const auto* t : {&qo_indptr, &kv_indptr, &kv_indices, &kv_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_attention: indices must be contiguous int64");
  Geometry g;
  g.head_dim = q.size(2);
  g.group = q.size(1) / num_kv_heads;
  g.page_stride = k_cache.stride(0);
  g.page_size = hnd ? k_cache.size(2) : k_cache.size(1);
  g.head_stride = hnd ? k_cache.stride(1) : k_cache.stride(2);
  g.token_stride = hnd ? k_cache.stride(2) : k_cache.stride(1);
  TORCH_CHECK((hnd ? k_cache.size(1) : k_cache.size(2)) == num_kv_heads,
              "paged_attention: the caches' head count differs from num_kv_heads");
  auto out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's token stride
  const float scale = static_cast<float>(sm_scale);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_kv<float>(g, q, out, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, causal, scale); break;
    case at::kBFloat16: dispatch_kv<c10::BFloat16>(g, q, out, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, causal, scale); break;
    case at::kHalf: dispatch_kv<c10::Half>(g, q, out, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, causal, scale); break;
    default: TORCH_CHECK(false, "paged_attention: q dtype ", q.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, bool hnd, Tensor qo_indptr, "
        "Tensor kv_indptr, Tensor kv_indices, Tensor kv_lens, int num_kv_heads, bool causal, "
        "float sm_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
