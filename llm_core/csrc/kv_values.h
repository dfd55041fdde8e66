// What both attention kernels read from a KV pool: an element as float (the
// pool's own dtype, or an e4m3 byte through a 256-entry table of its exact
// value), and exp over the non-positive logits of an online softmax.
#pragma once

#include "fast_exp.h"
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace swallow_cpu {

// exp(x) for x <= 0, clamped in the base-2 domain (fast_exp.h).
inline float exp_nonpositive(float x) { return pow2_normal(std::max(x * kLog2E, -126.0f)); }

// The e4m3 value of every byte, exact in float.
inline const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// One element of a K or V row as float: the pool's own dtype, or an e4m3 byte.
template <typename kv_t>
struct KVElement {
  static inline float at(const kv_t* row, int64_t c, const float*) { return static_cast<float>(row[c]); }
};
template <>
struct KVElement<uint8_t> {
  static inline float at(const uint8_t* row, int64_t c, const float* table) { return table[row[c]]; }
};

}  // namespace swallow_cpu
