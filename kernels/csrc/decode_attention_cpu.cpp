// Paged decode attention on CPU: one query token per sequence against its K/V read in
// place from the paged cache through the block table (no gather copy).
//
// One task per (decode token, KV head): the group of query heads sharing that KV head
// computes its scores over the whole context (dot products of head_dim floats), takes a
// numerically stable softmax (max subtracted) and sums the value rows. Tasks run on
// ATen's intra-op pool (at::parallel_for, OpenMP). Float32 accumulation throughout;
// bfloat16 caches are widened on load.
//
// Formulation: vLLM's paged attention (Kwon et al., 2023, "Efficient Memory Management
// for Large Language Model Serving with PagedAttention"), written here for CPU.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// e^x for x <= 0 (softmax after the max is subtracted), in a form the compiler
// vectorizes: Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then Cephes' degree-6
// polynomial for e^r (Moshier, Cephes Math Library, expf.c), scaled by 2^n built in the
// exponent bits. Relative error about 2e-7; inputs below -87 give ~0 (no denormals).
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

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * widen(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * widen(x[i]);
}

template <typename T>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                           const torch::Tensor& seq_lens, const torch::Tensor& token_idx,
                           const torch::Tensor& seq_idx, double scale) {
  const int64_t n = token_idx.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_token_stride = q.stride(0), out_token_stride = out.stride(0);
  const int64_t cache_block_stride = k_cache.stride(0), cache_token_stride = k_cache.stride(1);
  const T* q_ptr = q.data_ptr<T>();
  T* out_ptr = out.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tokens = token_idx.data_ptr<int32_t>();
  const int32_t* seqs = seq_idx.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t token = tokens[i], seq = seqs[i];
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + token * q_token_stride + (kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = widen(src[d]) * fscale;
      }
      scores.resize(group * len);
      std::vector<float> row_max(group, -std::numeric_limits<float>::infinity());
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* k = k_ptr + table[b] * cache_block_stride + kvh * head_dim;
        const int64_t t0 = b * block_size, t1 = std::min(len, t0 + block_size);
        for (int64_t t = t0; t < t1; ++t, k += cache_token_stride) {
          for (int64_t g = 0; g < group; ++g) {
            const float s = dot(qf.data() + g * head_dim, k, head_dim);
            scores[g * len + t] = s;
            row_max[g] = std::max(row_max[g], s);
          }
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float m = row_max[g];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = exp_nonpositive(s[t] - m);
          sum += s[t];
        }
        denom[g] = sum;
      }
      for (int64_t b = 0; b < num_blocks; ++b) {
        const T* v = v_ptr + table[b] * cache_block_stride + kvh * head_dim;
        const int64_t t0 = b * block_size, t1 = std::min(len, t0 + block_size);
        for (int64_t t = t0; t < t1; ++t, v += cache_token_stride) {
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], v, acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_ptr + token * out_token_stride + (kvh * group + g) * head_dim;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

// out, q: [num_tokens, num_heads, head_dim] (rows of q/out contiguous in heads and dims);
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
// token_idx, seq_idx: [n] int32, the decode tokens and their sequences.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor token_idx,
                      torch::Tensor seq_idx, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out rows must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(), "q, out and caches must share a dtype");
  for (const auto* t : {&block_tables, &seq_lens, &token_idx, &seq_idx}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "index tensors must be contiguous int32");
  }
  TORCH_CHECK(token_idx.sizes() == seq_idx.sizes(), "token_idx and seq_idx must have one length");
  if (q.scalar_type() == torch::kFloat32) {
    decode_attention_impl<float>(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_attention_impl<at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx, scale);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention on CPU (writes out in place)");
}
