// Extend (prefill) attention over paged KV pools on the CPU, for a mixed
// batch: each request's query rows attend causally (and within a window on
// sliding layers) to its keys, read through the page table.
//
// Unlike running every query row through the decode kernel, a block of a
// request's consecutive query rows shares each block of keys: the keys are
// gathered once (decoded from bfloat16 or FP8 once) into a transposed float
// tile, and every row of the block and of its GQA group scores against the tile
// with products vectorised over keys. Costs: one pass over the visible keys per
// query block, not per query row.
//
// q [T, Hq, D]; k_cache [S, Hkv, D]; v_cache [S, Hkv, Dv]; kv_table: page ids
// (int32 or int64); bounds [B, 5] int64 on the CPU, per request (first query
// row, query rows, offset of its first page in kv_table, keys, position of its
// first key); q_pos [T] absolute query positions. Key i of request b sits at
// position first + i, slot kv_table[start + i / page] * page + i % page. A row
// sees keys with k_pos <= q_pos, and q_pos - k_pos < window when window > 0.
// sinks [Hq] join each head's softmax denominator as one more logit.
// kv_scales [2] (k, v) come with float8_e4m3fn pools (stored = value / scale).
//
// Key blocks are aligned to absolute positions (multiples of kKeys), so a
// row's result depends only on its own position and keys: never on which
// other rows share its batch or its chunk.
#include <torch/extension.h>
#include <torch/library.h>

#include "kv_pools.h"
#include "kv_values.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 32;   // query rows per task
constexpr int64_t kKeys = 64;   // keys per tile
constexpr int64_t kLanes = 16;  // floats per vector
// (row, head) lanes computed together: 4 independent FMA chains per key load
// (the AVX-512 micro-kernels are written for exactly 4).
constexpr int64_t kChunk = 4;

using swallow_cpu::e4m3_table;
using swallow_cpu::exp_nonpositive;
using swallow_cpu::KVElement;

struct Geometry {
  int64_t hq, hkv, group, d, dv, page, window;
  int64_t k_stride0, k_stride1, v_stride0, v_stride1;
};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Scores of kChunk lanes against the tile's keys [j_begin, j_end) (whole
// vectors): s[i][j] = q_i . k_j, summed over the head dim in its fixed order.
inline void chunk_scores(const float* q, int64_t d, const float* kt, int64_t j_begin, int64_t j_end, float* s) {
  for (int64_t jv = j_begin; jv < j_end; jv += kLanes) {
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m512 kc = _mm512_loadu_ps(kt + c * kKeys + jv);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[c]), kc, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[d + c]), kc, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(q[2 * d + c]), kc, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(q[3 * d + c]), kc, a3);
    }
    _mm512_storeu_ps(s + jv, a0);
    _mm512_storeu_ps(s + kKeys + jv, a1);
    _mm512_storeu_ps(s + 2 * kKeys + jv, a2);
    _mm512_storeu_ps(s + 3 * kKeys + jv, a3);
#else
    float acc[kChunk][kLanes] = {};
    for (int64_t c = 0; c < d; ++c) {
      const float* kc = kt + c * kKeys + jv;
      for (int64_t i = 0; i < kChunk; ++i) {
        const float qc = q[i * d + c];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[i][l] += qc * kc[l];
      }
    }
    for (int64_t i = 0; i < kChunk; ++i)
      for (int64_t l = 0; l < kLanes; ++l) s[i * kKeys + jv + l] = acc[i][l];
#endif
  }
}

// acc_i += sum_j p_i[j] v_j for kChunk lanes over keys [j_begin, j_end).
inline void chunk_values(const float* p, const float* vt, int64_t dvp, int64_t j_begin, int64_t j_end, float* acc) {
  for (int64_t cv = 0; cv < dvp; cv += kLanes) {
#ifdef __AVX512F__
    __m512 a0 = _mm512_loadu_ps(acc + cv), a1 = _mm512_loadu_ps(acc + dvp + cv);
    __m512 a2 = _mm512_loadu_ps(acc + 2 * dvp + cv), a3 = _mm512_loadu_ps(acc + 3 * dvp + cv);
    for (int64_t j = j_begin; j < j_end; ++j) {
      const __m512 vj = _mm512_loadu_ps(vt + j * dvp + cv);
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), vj, a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[kKeys + j]), vj, a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[2 * kKeys + j]), vj, a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[3 * kKeys + j]), vj, a3);
    }
    _mm512_storeu_ps(acc + cv, a0);
    _mm512_storeu_ps(acc + dvp + cv, a1);
    _mm512_storeu_ps(acc + 2 * dvp + cv, a2);
    _mm512_storeu_ps(acc + 3 * dvp + cv, a3);
#else
    float a[kChunk][kLanes];
    for (int64_t i = 0; i < kChunk; ++i)
      for (int64_t l = 0; l < kLanes; ++l) a[i][l] = acc[i * dvp + cv + l];
    for (int64_t j = j_begin; j < j_end; ++j) {
      const float* vj = vt + j * dvp + cv;
      for (int64_t i = 0; i < kChunk; ++i) {
        const float pj = p[i * kKeys + j];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) a[i][l] += pj * vj[l];
      }
    }
    for (int64_t i = 0; i < kChunk; ++i)
      for (int64_t l = 0; l < kLanes; ++l) acc[i * dvp + cv + l] = a[i][l];
#endif
  }
}

template <typename scalar_t, typename kv_t, typename page_t>
void extend_kernel(const scalar_t* q, const kv_t* k, const kv_t* v, const page_t* table, const int64_t* bounds,
                   const int64_t* q_pos, const float* sinks, scalar_t* out, int64_t requests, const Geometry& g,
                   float k_scale, float v_scale) {
  const float scale = k_scale / std::sqrt(static_cast<float>(g.d));
  const float* fp8 = e4m3_table();
  const int64_t dvp = round_up(g.dv, kLanes);
  // Tasks: (request, block of kRows query rows, kv head).
  std::vector<int64_t> task_request, task_row;
  for (int64_t b = 0; b < requests; ++b)
    for (int64_t r = 0; r < bounds[b * 5 + 1]; r += kRows) {
      task_request.push_back(b);
      task_row.push_back(r);
    }
  const int64_t tasks = static_cast<int64_t>(task_request.size()) * g.hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Lane (r, hg): query row r of the block, head hg of the GQA group.
    const int64_t lanes = round_up(kRows * g.group, kChunk);
    std::vector<float> kt(g.d * kKeys, 0.0f), vt(kKeys * dvp, 0.0f), qf(lanes * g.d), acc(lanes * dvp);
    std::vector<float> s(lanes * kKeys), m(lanes), l(lanes);
    std::vector<int64_t> pos(lanes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task_request[task / g.hkv], h = task % g.hkv, row0 = task_row[task / g.hkv];
      const int64_t* bd = bounds + b * 5;
      const int64_t q0 = bd[0] + row0, rows = std::min(kRows, bd[1] - row0);
      const int64_t keys = bd[3], first = bd[4];
      const page_t* pages = table + bd[2];
      const int64_t used = round_up(rows * g.group, kChunk);
      int64_t lo_all = keys, hi_all = 0;  // the keys any lane sees: [lo_all, hi_all)
      for (int64_t lane = 0; lane < used; ++lane) {
        const int64_t r = lane / g.group, head = h * g.group + lane % g.group;
        float* qd = qf.data() + lane * g.d;
        m[lane] = -std::numeric_limits<float>::infinity();
        l[lane] = 0.0f;
        if (r >= rows) {  // padding: sees no key
          pos[lane] = -1;
          std::fill(qd, qd + g.d, 0.0f);
          continue;
        }
        const scalar_t* qrow = q + ((q0 + r) * g.hq + head) * g.d;
        for (int64_t c = 0; c < g.d; ++c) qd[c] = static_cast<float>(qrow[c]) * scale;
        // A sink starts the softmax: max = sink, denominator = exp(0) = 1.
        if (sinks) {
          m[lane] = sinks[head];
          l[lane] = 1.0f;
        }
        pos[lane] = q_pos[q0 + r] - first;  // the query's index among the request's keys
        const int64_t hi = std::min(keys, pos[lane] + 1);
        const int64_t lo = g.window > 0 ? std::max<int64_t>(0, pos[lane] - g.window + 1) : 0;
        if (lo < hi) {
          lo_all = std::min(lo_all, lo);
          hi_all = std::max(hi_all, hi);
        }
      }
      std::fill(acc.begin(), acc.begin() + used * dvp, 0.0f);
      // Tiles at absolute positions p0 = multiples of kKeys.
      const int64_t tile_first = lo_all < hi_all ? (first + lo_all) / kKeys * kKeys : first + hi_all;
      for (int64_t p0 = tile_first; p0 < first + hi_all; p0 += kKeys) {
        const int64_t t_lo = std::max(lo_all, p0 - first), t_hi = std::min(hi_all, p0 + kKeys - first);
        const int64_t count = t_hi - t_lo;
        // Gather the tile: K transposed to [d][key], V as [key][dvp], in float.
        for (int64_t j = 0; j < count; ++j) {
          const int64_t i = t_lo + j;
          const int64_t slot = static_cast<int64_t>(pages[i / g.page]) * g.page + i % g.page;
          const kv_t* key = k + slot * g.k_stride0 + h * g.k_stride1;
          const kv_t* value = v + slot * g.v_stride0 + h * g.v_stride1;
          for (int64_t c = 0; c < g.d; ++c) kt[c * kKeys + j] = KVElement<kv_t>::at(key, c, fp8);
          float* vrow = vt.data() + j * dvp;
          for (int64_t c = 0; c < g.dv; ++c) vrow[c] = KVElement<kv_t>::at(value, c, fp8);
        }
        for (int64_t chunk = 0; chunk < used; chunk += kChunk) {
          // Each lane's visible keys in the tile: [j0, j1) of [0, count).
          int64_t j0[kChunk], j1[kChunk], any_lo = count, any_hi = 0;
          for (int64_t i = 0; i < kChunk; ++i) {
            const int64_t p = pos[chunk + i];
            j0[i] = std::max(t_lo, g.window > 0 ? p - g.window + 1 : int64_t{0}) - t_lo;
            j1[i] = std::min(t_hi, p + 1) - t_lo;
            if (p < 0 || j0[i] >= j1[i]) j0[i] = j1[i] = 0;
            if (j0[i] < j1[i]) {
              any_lo = std::min(any_lo, j0[i]);
              any_hi = std::max(any_hi, j1[i]);
            }
          }
          if (any_lo >= any_hi) continue;
          const int64_t v_lo = any_lo / kLanes * kLanes, v_hi = round_up(any_hi, kLanes);
          float* sc = s.data() + chunk * kKeys;
          chunk_scores(qf.data() + chunk * g.d, g.d, kt.data(), v_lo, v_hi, sc);
          for (int64_t i = 0; i < kChunk; ++i) {
            float* si = sc + i * kKeys;
            const int64_t lane = chunk + i;
            if (j0[i] < j1[i]) {
              float tile_max = si[j0[i]];
#pragma omp simd reduction(max : tile_max)
              for (int64_t j = j0[i] + 1; j < j1[i]; ++j) tile_max = std::max(tile_max, si[j]);
              if (tile_max > m[lane]) {  // a new max: rescale what was summed so far
                const float shrink = std::exp(m[lane] - tile_max);
                l[lane] *= shrink;
                float* a = acc.data() + lane * dvp;
                for (int64_t c = 0; c < dvp; ++c) a[c] *= shrink;
                m[lane] = tile_max;
              }
              const float ml = m[lane];
              float total = 0.0f;
#pragma omp simd reduction(+ : total)
              for (int64_t j = j0[i]; j < j1[i]; ++j) {
                si[j] = exp_nonpositive(si[j] - ml);
                total += si[j];
              }
              l[lane] += total;
            }
            // Keys the lane does not see weigh 0 in the chunk's shared pass over values.
            std::fill(si + any_lo, si + std::max(any_lo, j0[i]), 0.0f);
            std::fill(si + std::max(any_lo, j1[i]), si + any_hi, 0.0f);
            if (j0[i] >= j1[i]) std::fill(si + any_lo, si + any_hi, 0.0f);
          }
          chunk_values(sc, vt.data(), dvp, any_lo, any_hi, acc.data() + chunk * dvp);
        }
      }
      for (int64_t lane = 0; lane < rows * g.group; ++lane) {
        const int64_t r = lane / g.group, hg = lane % g.group;
        scalar_t* o = out + ((q0 + r) * g.hq + h * g.group + hg) * g.dv;
        const float inv = l[lane] > 0.0f ? v_scale / l[lane] : 0.0f;
        for (int64_t c = 0; c < g.dv; ++c) o[c] = static_cast<scalar_t>(acc[lane * dvp + c] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor kv_table, int64_t page_size, torch::Tensor bounds,
                                     torch::Tensor q_pos, int64_t window, std::optional<torch::Tensor> sinks,
                                     std::optional<torch::Tensor> kv_scales) {
  const auto format = swallow_cpu::pool_format(q, k_cache, v_cache, kv_scales);
  TORCH_CHECK(page_size > 0 && window >= 0, "page_size must be positive and window non-negative");
  q = q.contiguous();
  kv_table = kv_table.contiguous();
  bounds = bounds.to(torch::kLong).contiguous();
  q_pos = q_pos.to(torch::kLong).contiguous();
  TORCH_CHECK(bounds.device().is_cpu() && bounds.dim() == 2 && bounds.size(1) == 5, "bounds is a CPU [B, 5] tensor");
  torch::Tensor sink_values;
  if (sinks.has_value()) sink_values = sinks->to(torch::kFloat).contiguous();
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(1), dv = v_cache.size(2);
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d && q_pos.numel() == q.size(0), "shapes do not agree");
  const int64_t* bd = bounds.data_ptr<int64_t>();
  for (int64_t b = 0; b < bounds.size(0); ++b)
    TORCH_CHECK(bd[b * 5] >= 0 && bd[b * 5 + 1] >= 0 && bd[b * 5] + bd[b * 5 + 1] <= q.size(0) &&
                    bd[b * 5 + 2] >= 0 && bd[b * 5 + 3] >= 0 &&
                    bd[b * 5 + 2] + (bd[b * 5 + 3] + page_size - 1) / page_size <= kv_table.numel(),
                "request ", b, "'s bounds fall outside q or kv_table");
  const Geometry geometry{hq, hkv, hq / hkv, d, dv, page_size, window,
                          k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)};
  auto out = torch::zeros({q.size(0), hq, dv}, q.options());  // rows no request claims stay 0
  const float* sink_ptr = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_extend_attention", [&] {
    swallow_cpu::with_page_ids(kv_table, [&](auto* table) {
      swallow_cpu::with_pools<scalar_t>(k_cache, v_cache, format, [&](auto* k_ptr, auto* v_ptr) {
        extend_kernel(q.data_ptr<scalar_t>(), k_ptr, v_ptr, table, bd, q_pos.data_ptr<int64_t>(), sink_ptr,
                      out.data_ptr<scalar_t>(), bounds.size(0), geometry, format.k_scale, format.v_scale);
      });
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(swallow_cpu, m) {
  m.def("paged_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_table, int page_size, "
        "Tensor bounds, Tensor q_pos, int window, Tensor? sinks, Tensor? kv_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(swallow_cpu, CPU, m) {
  m.impl("paged_extend_attention", &paged_extend_attention);
}
