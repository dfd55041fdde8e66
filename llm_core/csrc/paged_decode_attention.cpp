// Decode attention over paged KV pools on the CPU: one query per request,
// K/V read in place through the page table (never gathered into a copy), an
// online softmax per query head, a GQA group sharing each K/V load.
//
// q [B, Hq, D]; k_cache [S, Hkv, D]; v_cache [S, Hkv, Dv]; pages [B, P] page
// ids (int32 or int64); kv_len [B]: query b's keys are its last kv_len[b]
// positions up to q_pos[b], key i at slot row[i / page] * page + i % page.
// window > 0 keeps keys with q_pos - k_pos < window. sinks [Hq] (optional)
// join each head's softmax denominator as one more logit with no value.
// K/V may be float8_e4m3fn pools (stored = value / scale): kv_scales [2]
// (k, v) then scale the scores and the output, and each stored byte is read
// through a 256-entry table of its e4m3 value.
#include <torch/extension.h>
#include <torch/library.h>

#include "kv_pools.h"
#include "kv_values.h"
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // keys per block: scores, then one vectorised pass of exps

using swallow_cpu::e4m3_table;
using swallow_cpu::exp_nonpositive;
using swallow_cpu::KVElement;

#ifdef __AVX512F__
// float32 queries over float32 pools with AVX-512: each key's dot products
// stay 16-wide partial sums until 16 keys are done, then one transposing
// reduction yields all 16 scores at once (no horizontal sum per key).

// v[j] -> lane j of the result: the sum of v[j]'s lanes, in a fixed order.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // quarters: [x0+x2, x1+x3, y0+y2, y1+y3] of v[2i], v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q: 4 partial sums of key 4i + q
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter q: 2 partials of key 8i + q, then 2 of key 8i + 4 + q
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // Lane 4q + m holds key 4m + q: put key j in lane j.
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i key_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(key_order, r);
}

inline __mmask16 tail_mask(int64_t n) {
  return n % 16 ? static_cast<__mmask16>((1u << (n % 16)) - 1) : static_cast<__mmask16>(0xFFFF);
}

template <typename page_t>
void decode_kernel_avx512(const float* q, const float* k, const float* v, const page_t* pages,
                          const int64_t* kv_len, const float* sinks, float* out,
                          int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t dv, int64_t width,
                          int64_t page, int64_t window, int64_t k_stride0, int64_t k_stride1,
                          int64_t v_stride0, int64_t v_stride1) {
  const int64_t group = hq / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t q_chunks = (d + 15) / 16, v_chunks = (dv + 15) / 16;
  const __mmask16 k_tail = tail_mask(d), v_tail = tail_mask(dv);
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    // Queries zero-padded to whole vectors; keys past d are read masked (never past a row).
    std::vector<float> qf(group * q_chunks * 16, 0.0f), acc(group * v_chunks * 16), m(group), l(group);
    alignas(64) float scores[16];
    alignas(64) float probs[16];
    const float* keys[16];
    const float* values[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t n = kv_len[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;  // q_pos - k_pos < window
      for (int64_t g = 0; g < group; ++g) {
        const float* qrow = q + (b * hq + h * group + g) * d;
        for (int64_t c = 0; c < d; ++c) qf[g * q_chunks * 16 + c] = qrow[c] * scale;
        m[g] = sinks ? sinks[h * group + g] : -std::numeric_limits<float>::infinity();
        l[g] = sinks ? 1.0f : 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const page_t* row = pages + b * width;
      int64_t page_index = lo / page, offset = lo % page;
      for (int64_t i0 = lo; i0 < n; i0 += 16) {
        const int64_t count = std::min<int64_t>(16, n - i0);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t slot = static_cast<int64_t>(row[page_index]) * page + offset;
          if (++offset == page) {
            offset = 0;
            ++page_index;
          }
          keys[j] = k + slot * k_stride0 + h * k_stride1;
          values[j] = v + slot * v_stride0 + h * v_stride1;
        }
        const __mmask16 valid = static_cast<__mmask16>(count == 16 ? 0xFFFF : (1u << count) - 1);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * q_chunks * 16;
          __m512 partial[16];
          for (int64_t j = 0; j < 16; ++j) {
            __m512 dot = _mm512_setzero_ps();
            if (j < count) {
              for (int64_t c = 0; c < q_chunks; ++c) {
                const __m512 key = c + 1 < q_chunks ? _mm512_loadu_ps(keys[j] + 16 * c)
                                                    : _mm512_maskz_loadu_ps(k_tail, keys[j] + 16 * c);
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), key, dot);
              }
            }
            partial[j] = dot;
          }
          const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                sum_lanes_16(partial));
          const float block_max = _mm512_reduce_max_ps(s);
          float* a = acc.data() + g * v_chunks * 16;
          if (block_max > m[g]) {  // a new max: rescale what was summed so far
            const float c = std::exp(m[g] - block_max);
            l[g] *= c;
            for (int64_t j = 0; j < v_chunks * 16; ++j) a[j] *= c;
            m[g] = block_max;
          }
          _mm512_store_ps(scores, s);
          const float mg = m[g];
          float total = 0.0f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < 16; ++j) {
            probs[j] = j < count ? exp_nonpositive(scores[j] - mg) : 0.0f;
            total += probs[j];
          }
          l[g] += total;
          for (int64_t j = 0; j < count; ++j) {
            const __m512 pj = _mm512_set1_ps(probs[j]);
            for (int64_t c = 0; c < v_chunks; ++c) {
              const __m512 value = c + 1 < v_chunks ? _mm512_loadu_ps(values[j] + 16 * c)
                                                    : _mm512_maskz_loadu_ps(v_tail, values[j] + 16 * c);
              _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(pj, value, _mm512_loadu_ps(a + 16 * c)));
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * hq + h * group + g) * dv;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t j = 0; j < dv; ++j) o[j] = acc[g * v_chunks * 16 + j] * inv;
      }
    }
  });
}
#endif  // __AVX512F__

template <typename scalar_t, typename kv_t, typename page_t>
void decode_kernel(const scalar_t* q, const kv_t* k, const kv_t* v, const page_t* pages,
                   const int64_t* kv_len, const float* sinks, scalar_t* out,
                   int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t dv, int64_t width,
                   int64_t page, int64_t window, int64_t k_stride0, int64_t k_stride1,
                   int64_t v_stride0, int64_t v_stride1, float k_scale, float v_scale) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<kv_t, float>) {
    decode_kernel_avx512(q, k, v, pages, kv_len, sinks, out, batch, hq, hkv, d, dv, width, page, window,
                         k_stride0, k_stride1, v_stride0, v_stride1);
    return;
  }
#endif
  const int64_t group = hq / hkv;
  // A K scale multiplies every score: folded into the query's.
  const float scale = k_scale / std::sqrt(static_cast<float>(d));
  const float* table = e4m3_table();
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * dv), m(group), l(group), s(group * kBlock), p(kBlock);
    std::vector<float> kf(d);
    std::vector<const kv_t*> values(kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t n = kv_len[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;  // q_pos - k_pos < window
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (b * hq + h * group + g) * d;
        for (int64_t c = 0; c < d; ++c) qf[g * d + c] = static_cast<float>(qrow[c]) * scale;
        // A sink starts the softmax: max = sink, denominator = exp(0) = 1.
        m[g] = sinks ? sinks[h * group + g] : -std::numeric_limits<float>::infinity();
        l[g] = sinks ? 1.0f : 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      const page_t* row = pages + b * width;
      // Key lo's page and offset, then stepped along: no division per key.
      int64_t page_index = lo / page, offset = lo % page;
      for (int64_t i0 = lo; i0 < n; i0 += kBlock) {
        const int64_t count = std::min(kBlock, n - i0);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t slot = static_cast<int64_t>(row[page_index]) * page + offset;
          if (++offset == page) {
            offset = 0;
            ++page_index;
          }
          const kv_t* key = k + slot * k_stride0 + h * k_stride1;
          values[j] = v + slot * v_stride0 + h * v_stride1;
          // FP8 keys are decoded once for the whole GQA group.
          if constexpr (std::is_same_v<kv_t, uint8_t>) {
            for (int64_t c = 0; c < d; ++c) kf[c] = table[key[c]];
          }
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            float dot = 0.0f;
            // A vectorised reduction: its order is fixed at compile time, so a
            // row's result depends on nothing but its own inputs.
            if constexpr (std::is_same_v<kv_t, uint8_t>) {
#pragma omp simd reduction(+ : dot)
              for (int64_t c = 0; c < d; ++c) dot += qg[c] * kf[c];
            } else {
#pragma omp simd reduction(+ : dot)
              for (int64_t c = 0; c < d; ++c) dot += qg[c] * static_cast<float>(key[c]);
            }
            s[g * kBlock + j] = dot;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* sg = s.data() + g * kBlock;
          float block_max = sg[0];
          for (int64_t j = 1; j < count; ++j) block_max = std::max(block_max, sg[j]);
          float* a = acc.data() + g * dv;
          if (block_max > m[g]) {  // a new max: rescale what was summed so far
            const float c = std::exp(m[g] - block_max);
            l[g] *= c;
            for (int64_t j = 0; j < dv; ++j) a[j] *= c;
            m[g] = block_max;
          }
          const float mg = m[g];
          float total = 0.0f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < count; ++j) {
            p[j] = exp_nonpositive(sg[j] - mg);
            total += p[j];
          }
          l[g] += total;
          for (int64_t j = 0; j < count; ++j) {
            const kv_t* value = values[j];
            const float pj = p[j];
#pragma omp simd
            for (int64_t c = 0; c < dv; ++c) a[c] += pj * KVElement<kv_t>::at(value, c, table);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out + (b * hq + h * group + g) * dv;
        const float inv = l[g] > 0.0f ? v_scale / l[g] : 0.0f;
        for (int64_t j = 0; j < dv; ++j) o[j] = static_cast<scalar_t>(acc[g * dv + j] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor pages, int64_t page_size, torch::Tensor kv_len,
                                     torch::Tensor q_pos, int64_t window, std::optional<torch::Tensor> sinks,
                                     std::optional<torch::Tensor> kv_scales) {
  const auto format = swallow_cpu::pool_format(q, k_cache, v_cache, kv_scales);
  q = q.contiguous();
  pages = pages.contiguous();
  kv_len = kv_len.to(torch::kLong).contiguous();
  q_pos = q_pos.to(torch::kLong).contiguous();
  torch::Tensor sink_values;
  if (sinks.has_value()) sink_values = sinks->to(torch::kFloat).contiguous();
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), dv = v_cache.size(2);
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d && kv_len.numel() == batch, "shapes do not agree");
  TORCH_CHECK(pages.dim() == 2 && pages.size(0) == batch, "pages [B, P], a row per query");
  auto out = torch::empty({batch, hq, dv}, q.options());
  const float* sink_ptr = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    swallow_cpu::with_page_ids(pages, [&](auto* page_ptr) {
      swallow_cpu::with_pools<scalar_t>(k_cache, v_cache, format, [&](auto* k_ptr, auto* v_ptr) {
        decode_kernel(q.data_ptr<scalar_t>(), k_ptr, v_ptr, page_ptr, kv_len.data_ptr<int64_t>(), sink_ptr,
                      out.data_ptr<scalar_t>(), batch, hq, hkv, d, dv, pages.size(-1), page_size, window,
                      k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), format.k_scale,
                      format.v_scale);
      });
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(swallow_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int page_size, "
        "Tensor kv_len, Tensor q_pos, int window, Tensor? sinks, Tensor? kv_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(swallow_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
