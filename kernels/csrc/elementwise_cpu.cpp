// Row-wise CPU kernels of the Llama block, each one pass over memory instead of PyTorch's
// chain of element-wise ops (the CPU counterparts of kernels/silu_and_mul.py,
// kernels/fused_add_rms_norm.py and kernels/rotary.py, same contracts):
//   silu_and_mul        out = silu(x[:, :I]) * x[:, I:]      (Shazeer, 2020, SwiGLU)
//   fused_add_rms_norm  res_out = x + residual; out = rms_norm(res_out) * weight
//                       (Zhang & Sennrich, 2019)
//   rotary              q, k rotated in place by their positions (Su et al., 2021,
//                       RoFormer; the rotate-half layout of Hugging Face's Llama)
// Rows are split over ATen's intra-op pool (at::parallel_for); math in float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_math.h"

namespace {

using inferq::exp_nonpositive;
using inferq::widen;

// Rows per parallel chunk so that each chunk holds at least ~64k elements (smaller work
// runs on the calling thread: waking the pool costs more than it saves).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems)); }

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const int64_t sx = x.stride(0), so = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * sx;
      const T* up = gate + inter;
      T* dst = op + r * so;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = widen(gate[i]);
        // sigmoid(g) from e = e^-|g| (never overflows): 1/(1+e) for g >= 0, e/(1+e) below.
        const float e = exp_nonpositive(g >= 0.f ? -g : g);
        const float inv = 1.f / (1.f + e);
        const float act = g * (g >= 0.f ? inv : e * inv);
        // Round SiLU to the input dtype before the product, as the unfused path does.
        dst[i] = static_cast<T>(widen(static_cast<T>(act)) * widen(up[i]));
      }
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& out, at::Tensor& res_out, const at::Tensor& x, const at::Tensor* residual,
                       const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rop = res_out.data_ptr<T>();
  const int64_t sx = x.stride(0), sr = residual != nullptr ? residual->stride(0) : 0;
  const int64_t so = out.stride(0), sro = res_out.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + r * sx;
      T* sum_row = rop + r * sro;
      float ss = 0.f;
      if (rp != nullptr) {
        const T* res = rp + r * sr;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; ++i) {
          const T v = static_cast<T>(widen(src[i]) + widen(res[i]));
          sum_row[i] = v;
          ss += widen(v) * widen(v);
        }
        src = sum_row;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; ++i) ss += widen(src[i]) * widen(src[i]);
      }
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(hidden) + feps);
      T* dst = op + r * so;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<T>(widen(src[i]) * rstd * widen(wp[i]));
    }
  });
}

template <typename T>
void rotate_heads(T* base, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = base + h * head_stride;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float a = widen(x1[d]), b = widen(x2[d]);
      x1[d] = static_cast<T>(a * c[d] - b * s[d]);
      x2[d] = static_cast<T>(b * c[d] + a * s[d]);
    }
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t sc = cos.stride(0);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  at::parallel_for(0, tokens, grain((q_heads + k_heads) * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * sc;
      const float* s = sp + pos[t] * sc;
      rotate_heads(qp + t * q.stride(0), q_heads, q.stride(1), half, c, s);
      rotate_heads(kp + t * k.stride(0), k_heads, k.stride(1), half, c, s);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, n], contiguous in n");
}

template <typename Fn>
void dispatch_float(at::ScalarType dtype, const char* op, Fn&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kBFloat16) {
    fn(at::BFloat16{});
  } else {
    TORCH_CHECK(false, op, " supports float32 and bfloat16, got ", dtype);
  }
}

}  // namespace

// x: [rows, 2 * I]; out: [rows, I], x's dtype.
void silu_and_mul_cpu(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2,
              "out must be [rows, I] for x [rows, 2I]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share a dtype");
  dispatch_float(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    silu_and_mul_impl<decltype(tag)>(out, x);
  });
}

// x, residual (optional), out, res_out: [rows, hidden]; weight: [hidden] contiguous.
void fused_add_rms_norm_cpu(at::Tensor out, at::Tensor res_out, at::Tensor x, std::optional<at::Tensor> residual,
                            at::Tensor weight, double eps) {
  for (const auto* t : {&out, &res_out, &x}) check_rows(*t, "x, out and res_out");
  TORCH_CHECK(out.sizes() == x.sizes() && res_out.sizes() == x.sizes(), "out and res_out must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && res_out.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(), "x, out, res_out and weight must share a dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual must match x");
  }
  dispatch_float(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    add_rms_norm_impl<decltype(tag)>(out, res_out, x, residual ? &*residual : nullptr, weight, eps);
  });
}

// positions: [T] int64; q: [T, H, D], k: [T, KVH, D] (head_dim contiguous; rotated in
// place); cos, sin: [max_positions, D] float32, head_dim contiguous, halves equal.
void rotary_cpu(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q and k must be [T, heads, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(1) == 1 &&
                  sin.strides() == cos.strides(), "cos and sin must be float32 tables contiguous in D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  dispatch_float(q.scalar_type(), "rotary", [&](auto tag) {
    rotary_impl<decltype(tag)>(positions, q, k, cos, sin);
  });
}
