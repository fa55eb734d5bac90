// y[i] += (x[i] @ A[s_i][:, :w_s]) @ B[s_i][:w_s] for every row i whose adapter slot s_i
// has a width w_s > 0 (backends/lora/ops.py): a whole layer's LoRA delta for a batch that
// mixes adapters, in one call (punica's SGMV shape, on the CPU).
//
// A fused layer (q/k/v, gate/up) holds P parts: a slot's A has each part's w_s / P
// columns side by side and its B is block-diagonal (lora/pool.py), so the second product
// only visits the part's own rank block for the part's output columns (part_cols: the
// P + 1 column boundaries), a third of the work at q/k/v and half at gate/up.
//
// The torch version is one matmul pair per adapter plus a gather and a scatter: at a
// decode step of 16 rows and 4 adapters that is ~2,800 small ops over the model, each
// costing its dispatch more than its arithmetic (LoRA adds ~7% of the base's MACs per
// row). Here the rows are grouped by slot, x @ A runs per row against A's rows in order
// (a row's R floats stay in L1), then the deltas go out in column blocks so each block
// of B is read once per slot and reused by all of that slot's rows. Plain loops the
// compiler vectorises (-O3 -march=native): any x86 or ARM CPU, no AVX512 needed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;   // output columns per work item of the second product
constexpr int64_t kLanes = 16;   // columns of the first product held in registers at once
constexpr int64_t kChains = 4;   // independent accumulations over k

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

template <typename XT, typename YT>
void sgmv(YT* y, const XT* x, const float* A, const float* B, const int32_t* row_slots,
          const int32_t* widths, const std::vector<int64_t>& part_cols, int64_t n, int64_t in, int64_t rank,
          int64_t out, int64_t slots) {
  const int64_t parts = static_cast<int64_t>(part_cols.size()) - 1;
  // the rows of each slot that changes this layer, in batch order
  std::vector<std::vector<int64_t>> rows(slots);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = row_slots[i];
    TORCH_CHECK(s >= 0 && s < slots, "lora_sgmv: row ", i, " has slot ", s, " of ", slots);
    if (s > 0 && widths[s] > 0) rows[s].push_back(i);
  }
  std::vector<int64_t> order;   // the adapter rows, grouped by slot
  for (int64_t s = 1; s < slots; ++s) order.insert(order.end(), rows[s].begin(), rows[s].end());
  if (order.empty()) return;

  // t[i] = x[i] @ A[s_i][:, :w], 16 columns at a time in registers, over k in 4
  // independent chains (one chain would wait out each FMA's latency)
  std::vector<float> t(n * rank, 0.0f);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 4, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = order[j];
      const int32_t s = row_slots[i];
      const int64_t w = widths[s];
      const XT* xi = x + i * in;
      const float* As = A + s * in * rank;
      for (int64_t r0 = 0; r0 < w; r0 += kLanes) {
        const int64_t lanes = std::min(kLanes, w - r0);
        float acc[kChains][kLanes] = {};
        int64_t k = 0;
        if (lanes == kLanes) {
          for (; k + kChains <= in; k += kChains)
            for (int64_t u = 0; u < kChains; ++u) {
              const float xv = as_float(xi[k + u]);
              const float* a = As + (k + u) * rank + r0;
#pragma omp simd
              for (int64_t r = 0; r < kLanes; ++r) acc[u][r] += xv * a[r];
            }
        }
        for (; k < in; ++k) {
          const float xv = as_float(xi[k]);
          const float* a = As + k * rank + r0;
          for (int64_t r = 0; r < lanes; ++r) acc[0][r] += xv * a[r];
        }
        float* ti = t.data() + i * rank + r0;
        for (int64_t r = 0; r < lanes; ++r) {
          float sum = 0.0f;
          for (int64_t u = 0; u < kChains; ++u) sum += acc[u][r];
          ti[r] = sum;
        }
      }
    }
  });

  // y[i, block] += t[i] @ B[s_i][:w, block]
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    float acc[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, width = std::min(kBlock, out - c0);
      for (int64_t s = 1; s < slots; ++s) {
        const int64_t part_rank = widths[s] / parts;
        const float* Bs = B + s * rank * out;
        for (const int64_t i : rows[s]) {
          for (int64_t c = 0; c < width; ++c) acc[c] = 0.0f;
          const float* ti = t.data() + i * rank;
          for (int64_t p = 0; p < parts; ++p) {   // the parts this block's columns meet
            const int64_t lo = std::max(c0, part_cols[p]), hi = std::min(c0 + width, part_cols[p + 1]);
            if (lo == c0 && hi == c0 + kBlock) {   // the whole block in one part: a fixed width
              for (int64_t r = p * part_rank; r < (p + 1) * part_rank; ++r) {
                const float tv = ti[r];
                const float* bc = Bs + r * out + c0;
#pragma omp simd
                for (int64_t c = 0; c < kBlock; ++c) acc[c] += tv * bc[c];
              }
              continue;
            }
            for (int64_t r = p * part_rank; lo < hi && r < (p + 1) * part_rank; ++r) {
              const float tv = ti[r];
              const float* bc = Bs + r * out;
              for (int64_t c = lo; c < hi; ++c) acc[c - c0] += tv * bc[c];
            }
          }
          YT* yi = y + i * out + c0;
          for (int64_t c = 0; c < width; ++c) yi[c] = static_cast<YT>(as_float(yi[c]) + acc[c]);
        }
      }
    }
  });
}

// in place on y [N, out]; x [N, in]; A [S, in, R] and B [S, R, out] fp32 (the pool's
// dtype on a CPU); row_slots int32 [N] (0: no adapter); widths int32 [S] (the columns of
// A each slot's adapter fills in this layer, 0: it leaves the layer alone); part_cols the
// output column where each part starts, and out
void lora_sgmv_(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& row_slots, const at::Tensor& widths, at::IntArrayRef part_cols) {
  TORCH_CHECK(A.scalar_type() == at::kFloat && B.scalar_type() == at::kFloat, "lora_sgmv: fp32 A and B");
  TORCH_CHECK(A.dim() == 3 && B.dim() == 3 && A.is_contiguous() && B.is_contiguous() &&
              A.size(0) == B.size(0) && A.size(2) == B.size(1), "lora_sgmv: A [S, in, R] and B [S, R, out], contiguous");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && y.is_contiguous() && x.size(0) == y.size(0) &&
              x.size(1) == A.size(1) && y.size(1) == B.size(2), "lora_sgmv: x [N, in] and contiguous y [N, out]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "lora_sgmv: x and y both fp32 or both bf16");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.numel() == x.size(0) &&
              widths.scalar_type() == at::kInt && widths.numel() == A.size(0), "lora_sgmv: int32 row_slots [N], widths [S]");
  const at::Tensor xc = x.contiguous(), rs = row_slots.contiguous(), ws = widths.contiguous();
  const int64_t n = x.size(0), in = x.size(1), rank = A.size(2), out = y.size(1), slots = A.size(0);
  const std::vector<int64_t> cols(part_cols.begin(), part_cols.end());
  const int64_t parts = static_cast<int64_t>(cols.size()) - 1;
  TORCH_CHECK(parts >= 1 && cols.front() == 0 && cols.back() == out, "lora_sgmv: part_cols from 0 to out");
  for (int64_t p = 0; p < parts; ++p) TORCH_CHECK(cols[p] < cols[p + 1], "lora_sgmv: part_cols increasing");
  const int32_t* wp = ws.data_ptr<int32_t>();
  for (int64_t s = 0; s < ws.numel(); ++s)
    TORCH_CHECK(wp[s] >= 0 && wp[s] <= rank && wp[s] % parts == 0, "lora_sgmv: slot ", s, " width ", wp[s],
                " beyond rank ", rank, " or not a multiple of the ", parts, " parts");
  if (x.scalar_type() == at::kFloat) {
    sgmv(y.data_ptr<float>(), xc.data_ptr<float>(), A.data_ptr<float>(), B.data_ptr<float>(),
         rs.data_ptr<int32_t>(), wp, cols, n, in, rank, out, slots);
  } else {
    sgmv(y.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>(), A.data_ptr<float>(), B.data_ptr<float>(),
         rs.data_ptr<int32_t>(), wp, cols, n, in, rank, out, slots);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("lora_sgmv_(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor row_slots, Tensor widths, int[] part_cols) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("lora_sgmv_", &lora_sgmv_);
}
