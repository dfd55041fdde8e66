// What both attention ops check of, and how they read, a KV pool pair: K and
// V in q's dtype, in bfloat16 under wider queries, or float8_e4m3fn with
// their (k, v) scales; page ids int32 or int64.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace swallow_cpu {

struct PoolFormat {
  bool fp8 = false;
  bool bf16_pool = false;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

inline PoolFormat pool_format(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const std::optional<torch::Tensor>& kv_scales) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "K/V rows must be contiguous");
  PoolFormat format;
  format.fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  format.bf16_pool = k_cache.scalar_type() == at::kBFloat16 && q.scalar_type() != at::kBFloat16;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V must share a dtype");
  TORCH_CHECK(format.fp8 || format.bf16_pool || k_cache.scalar_type() == q.scalar_type(),
              "K/V must be q's dtype, bfloat16 or float8_e4m3fn");
  TORCH_CHECK(format.fp8 == kv_scales.has_value(), "FP8 K/V come with their scales, and only they do");
  if (format.fp8) {
    auto both = kv_scales->to(torch::kFloat).contiguous();
    TORCH_CHECK(both.numel() == 2, "kv_scales holds (k_scale, v_scale)");
    format.k_scale = both.data_ptr<float>()[0];
    format.v_scale = both.data_ptr<float>()[1];
  }
  return format;
}

// fn(k, v) with the pools' data as the kernels read it (FP8 as its bytes),
// for queries of type scalar_t.
template <typename scalar_t, typename Fn>
void with_pools(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const PoolFormat& format, Fn&& fn) {
  if (format.fp8) {
    fn(static_cast<const uint8_t*>(k_cache.data_ptr()), static_cast<const uint8_t*>(v_cache.data_ptr()));
  } else if (format.bf16_pool) {
    fn(static_cast<const at::BFloat16*>(k_cache.data_ptr()), static_cast<const at::BFloat16*>(v_cache.data_ptr()));
  } else {
    fn(static_cast<const scalar_t*>(k_cache.data_ptr()), static_cast<const scalar_t*>(v_cache.data_ptr()));
  }
}

// fn(page ids) for an int32 or int64 table.
template <typename Fn>
void with_page_ids(const torch::Tensor& pages, Fn&& fn) {
  if (pages.scalar_type() == torch::kInt) {
    fn(pages.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(pages.scalar_type() == torch::kLong, "page ids must be int32 or int64");
    fn(pages.data_ptr<int64_t>());
  }
}

}  // namespace swallow_cpu
