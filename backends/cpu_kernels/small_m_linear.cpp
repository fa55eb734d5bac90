// y = x @ w.T (+ bias) for bf16 x [M, K] with M <= 8 and bf16 w [N, K]: a decode step's
// linears at batch 1 to 8, where the time is mostly reading the weight from memory.
//
// The weight is packed once (pack()) so that 16 outputs' pairs of k lie in one 64-byte
// line: one AVX512-BF16 dot-product instruction per line and row of x accumulates 16
// outputs in float, with no horizontal sums, while the weight streams through in order.
// oneDNN's kernel read it at about half a core's bandwidth at these shapes. Only on CPUs
// with AVX512-BF16; elsewhere the ops are not registered and the caller keeps oneDNN.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kMaxRows = 8;   // rows of x (beyond 8 oneDNN measured as fast: the dot products bound it)
constexpr int64_t kLanes = 16;    // outputs per block of the packed weight

// The packed weight: [N / 16][K / 2][16][2] bf16, so each 64-byte load holds two
// consecutive k of 16 outputs, and a block's K / 2 loads are one sequential stream.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "small_m_linear_pack: bf16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kLanes == 0 && k % 2 == 0, "small_m_linear_pack: N a multiple of 16, K even");
  return w.view({n / kLanes, kLanes, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// M rows of x; kChains independent accumulators per row hide dpbf16's latency when
// M alone does not (below 4 rows)
template <int64_t M>
void blocks(const int32_t* x, const __m512i* w, const c10::BFloat16* bias, c10::BFloat16* y,
            int64_t b0, int64_t b1, int64_t pairs, int64_t n) {
  constexpr int64_t kChains = M >= 4 ? 1 : 4;
  for (int64_t b = b0; b < b1; ++b) {
    const __m512i* wb = w + b * pairs;
    __m512 acc[M][kChains];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + kChains <= pairs; p += kChains) {
      for (int64_t c = 0; c < kChains; ++c) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + p + c);
        for (int64_t m = 0; m < M; ++m)
          acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(x[m * pairs + p + c]), wv);
      }
    }
    for (; p < pairs; ++p) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + p);
      for (int64_t m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_set1_epi32(x[m * pairs + p]), wv);
    }
    for (int64_t m = 0; m < M; ++m) {
      __m512 sum = acc[m][0];
      for (int64_t c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
      if (bias) {
        const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + b * kLanes));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16)));
      }
      // round to nearest even, as oneDNN and c10::BFloat16 round
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n + b * kLanes), (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// f(std::integral_constant<int64_t, m>{}) for m in 1..kMaxRows
template <int64_t M = 1, typename F>
void dispatch(int64_t m, F&& f) {
  if constexpr (M <= kMaxRows) {
    if (m == M) return f(std::integral_constant<int64_t, M>{});
    dispatch<M + 1>(m, f);
  }
}

// y [M, N] = x [M, K] @ w.T (+ bias) from pack(w)
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "small_m_linear: bf16 x and weight only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 && packed.is_contiguous(),
              "small_m_linear: the weight must come from small_m_linear_pack");
  const int64_t m = x.size(0), pairs = packed.size(1), n = packed.size(0) * kLanes;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * pairs, "small_m_linear: x [M, K] with the weight's K");
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "small_m_linear: 1 to ", kMaxRows, " rows of x");
  const at::Tensor xc = x.contiguous();
  const c10::BFloat16* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "small_m_linear: bf16 bias [N]");
    bc = bias->contiguous();
    bp = bc.data_ptr<c10::BFloat16>();
  }
  auto y = at::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const int32_t*>(xc.data_ptr());   // pairs of bf16
  const auto* wp = reinterpret_cast<const __m512i*>(packed.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kLanes, 4, [&](int64_t b0, int64_t b1) {
    dispatch(m, [&](auto rows) { blocks<decltype(rows)::value>(xp, wp, bp, yp, b0, b1, pairs, n); });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("small_m_linear_pack(Tensor weight) -> Tensor");
  m.def("small_m_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("small_m_linear_pack", &pack);
  m.impl("small_m_linear", &small_m_linear);
}
#endif
