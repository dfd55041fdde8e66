// Routed experts of one MoE layer on the CPU, float32: tokens grouped by
// expert, each expert's gate/up product, SiLU gate and down product run over
// its own tokens only (top_k / experts of the dense flops), and each token's
// output the weighted sum of its k expert rows.
//
// x [T, H]; weights [T, K]; expert_ids [T, K] (int64, < E); gate_up [E, 2I, H]
// (gate rows first, then up); down [E, H, I]. Each output row of a product is
// computed the same way whatever rows share its tile, and a token's k rows
// are summed in k order: a token's output depends on its own inputs only,
// never on the batch around it.
#include <torch/extension.h>
#include <torch/library.h>

#include "fast_exp.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A tile keeps R x V vector accumulators and V weight vectors in registers:
// 4 x 4 of 16 floats fit AVX-512's 32 registers, but on AVX2 (16 registers of
// 8 floats) that tile spills on every step of the sum and runs ~5x slower, so
// there it is 4 x 2 of 8 floats. Either way each output sums its products in
// the same order, so the result does not depend on the choice.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kColumnVectors = 4;
#else
constexpr int64_t kLanes = 8;
constexpr int kColumnVectors = 2;
#endif
typedef float lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// exp(x) over float's range (fast_exp.h): the SiLU loop vectorises.
inline float exp_approx(float x) {
  return swallow_cpu::pow2_normal(std::min(std::max(x * swallow_cpu::kLog2E, -126.0f), 127.0f));
}

inline void store(float* p, lanes v) { std::memcpy(p, &v, sizeof(v)); }

// R rows of out[i][j] = sum_c a[i][c] * wt[c][j] for columns [j0, j0 + V * kLanes):
// R x V accumulators, one broadcast per row and V loads per c.
template <int R, int V>
inline void tile(const float* a, int64_t lda, const float* wt, int64_t ldw, int64_t k, float* out, int64_t ldo,
                 int64_t j0) {
  lanes s[R][V] = {};
  for (int64_t c = 0; c < k; ++c) {
    const float* w = wt + c * ldw + j0;
    lanes wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + c];
      for (int v = 0; v < V; ++v) s[r][v] += x * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(out + r * ldo + j0 + v * kLanes, s[r][v]);
}

template <int R>
void rows_times(const float* a, int64_t lda, const float* wt, int64_t ldw, int64_t m, int64_t k, float* out,
                int64_t ldo) {
  int64_t j = 0;
  for (; j + kColumnVectors * kLanes <= m; j += kColumnVectors * kLanes)
    tile<R, kColumnVectors>(a, lda, wt, ldw, k, out, ldo, j);
  for (; j + kLanes <= m; j += kLanes) tile<R, 1>(a, lda, wt, ldw, k, out, ldo, j);
  for (; j < m; ++j) {  // the last columns one by one, summed in the same order as every lane
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t c = 0; c < k; ++c) s += a[r * lda + c] * wt[c * ldw + j];
      out[r * ldo + j] = s;
    }
  }
}

// out [n, m] = a [n, k] @ wt [k, m] (wt rows contiguous, stride ldw). Rows go in
// tiles of up to 4, each row's arithmetic the same in any tile: a row's result
// depends on that row alone.
void matmul_rows(const float* a, int64_t lda, int64_t n, const float* wt, int64_t ldw, int64_t m, int64_t k,
                 float* out, int64_t ldo) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) rows_times<4>(a + i * lda, lda, wt, ldw, m, k, out + i * ldo, ldo);
  const int64_t rest = n - i;
  a += i * lda;
  out += i * ldo;
  if (rest == 3) rows_times<3>(a, lda, wt, ldw, m, k, out, ldo);
  if (rest == 2) rows_times<2>(a, lda, wt, ldw, m, k, out, ldo);
  if (rest == 1) rows_times<1>(a, lda, wt, ldw, m, k, out, ldo);
}

}  // namespace

torch::Tensor routed_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor expert_ids,
                             torch::Tensor gate_up, torch::Tensor down) {
  TORCH_CHECK(x.device().is_cpu() && gate_up.device().is_cpu() && down.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && gate_up.scalar_type() == at::kFloat &&
                  down.scalar_type() == at::kFloat, "float32 activations and experts only");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && expert_ids.dim() == 2,
              "x [T, H], expert_ids [T, K], gate_up [E, 2I, H], down [E, H, I]");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = expert_ids.size(1);
  const int64_t experts = gate_up.size(0), inter = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && gate_up.size(2) == hidden && down.size(0) == experts &&
                  down.size(1) == hidden && expert_ids.size(0) == tokens && weights.sizes() == expert_ids.sizes(),
              "shapes do not agree");
  x = x.contiguous();
  // Experts in k-major memory ([E, H, 2I] and [E, I, H] underneath): products
  // then vectorise along each output row. The CPU loader stores them so; any
  // other layout is transposed here, per call.
  const auto gate_up_t = gate_up.transpose(1, 2).contiguous();
  const auto down_t = down.transpose(1, 2).contiguous();
  const auto ids = expert_ids.to(torch::kLong).contiguous();
  const auto route = weights.to(torch::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t slots = tokens * top_k;

  // Slots grouped by expert, in slot order within an expert (a counting sort).
  std::vector<int64_t> start(experts + 1, 0), slot_of(slots), row_of(slots);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < experts, "expert id ", id[s], " out of range for ", experts, " experts");
    ++start[id[s] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < slots; ++s) {
      row_of[s] = next[id[s]]++;
      slot_of[row_of[s]] = s;
    }
  }
  auto expert_out = torch::empty({slots, hidden}, x.options());  // one row per slot, grouped by expert
  const float* xp = x.data_ptr<float>();
  const float* gu = gate_up_t.data_ptr<float>();
  const float* dn = down_t.data_ptr<float>();
  float* eo = expert_out.data_ptr<float>();
  at::parallel_for(0, experts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs, both, act;
    for (int64_t e = begin; e < end; ++e) {
      const int64_t n = start[e + 1] - start[e];
      if (n == 0) continue;
      xs.resize(n * hidden);
      both.resize(n * 2 * inter);
      act.resize(n * inter);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(xs.data() + r * hidden, xp + (slot_of[start[e] + r] / top_k) * hidden, hidden * sizeof(float));
      matmul_rows(xs.data(), hidden, n, gu + e * 2 * inter * hidden, 2 * inter, 2 * inter, hidden, both.data(),
                  2 * inter);
      for (int64_t r = 0; r < n; ++r) {
        const float* g = both.data() + r * 2 * inter;
        float* a = act.data() + r * inter;
#pragma omp simd
        for (int64_t c = 0; c < inter; ++c) a[c] = g[c] / (1.0f + exp_approx(-g[c])) * g[inter + c];
      }
      matmul_rows(act.data(), inter, n, dn + e * hidden * inter, hidden, hidden, inter, eo + start[e] * hidden,
                  hidden);
    }
  });
  auto out = torch::empty({tokens, hidden}, x.options());
  float* op = out.data_ptr<float>();
  const float* rw = route.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * hidden;
      std::fill(o, o + hidden, 0.0f);
      for (int64_t q = 0; q < top_k; ++q) {
        const int64_t s = t * top_k + q;
        const float w = rw[s];
        const float* h = eo + row_of[s] * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * h[c];
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(swallow_cpu, m) {
  m.def("routed_experts(Tensor x, Tensor weights, Tensor expert_ids, Tensor gate_up, Tensor down) -> Tensor");
}

TORCH_LIBRARY_IMPL(swallow_cpu, CPU, m) {
  m.impl("routed_experts", &routed_experts);
}
