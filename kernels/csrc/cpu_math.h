// Scalar helpers shared by the CPU kernels, written so that GCC vectorizes loops over
// them (`#pragma omp simd`, -O3 -march=native).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace inferq {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// e^x for x <= 0, in a form the compiler vectorizes: Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2 / 2, then Cephes' degree-6 polynomial for e^r (Moshier, Cephes Math Library,
// expf.c), scaled by 2^n built in the exponent bits. Relative error about 2e-7; inputs
// below -87 give ~0 (no denormals).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace inferq
