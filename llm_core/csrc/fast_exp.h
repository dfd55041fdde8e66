// 2^t for t in [-126, 127] to ~2 ulp: t split into integer and fraction, the
// fraction through a degree-6 polynomial. Plain arithmetic, so a simd loop
// vectorises it (std::exp does not without -ffast-math). Callers clamp t:
// 2^-126 is the smallest normal float, so the exponent bits stay valid
// (letting the exponent underflow would flip the sign bit).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace swallow_cpu {

inline float pow2_normal(float t) {
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr float kLog2E = 1.4426950408889634f;

}  // namespace swallow_cpu
