// Paged decode attention on CPU: one query token per sequence against its K/V read in
// place from the paged cache through the block table (no gather copy).
//
// One task per decode token (or, with fewer tokens than twice the threads, per partition
// of its blocks): every query head's scores over the context (dot products of head_dim
// floats), a numerically stable softmax (max subtracted) and the weighted sum of the value
// rows. With a sliding window w > 0 the token at position len - 1 sees keys
// len - w .. len - 1 only (transformers' kv_idx > q_idx - w): the key loop starts at the
// first of them, and blocks wholly before it are never read (their table entries may be
// stale). A task reads each block front to back, all KV heads of a token together, so the
// reads stream; tasks run on ATen's intra-op pool (at::parallel_for, OpenMP). Float32
// accumulation throughout; bfloat16 caches are widened on load.
//
// Formulation: vLLM's paged attention (Kwon et al., 2023, "Efficient Memory Management
// for Large Language Model Serving with PagedAttention"), written here for CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

using inferq::exp_nonpositive;
using inferq::widen;

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
struct DecodeArgs {
  const T* q;
  T* out;
  const T* k;
  const T* v;
  const int32_t* tables;
  const int32_t* lens;
  const int32_t* tokens;
  const int32_t* seqs;
  int64_t num_heads, head_dim, block_size, num_kv_heads, group, max_blocks;
  int64_t q_token_stride, out_token_stride, cache_block_stride, cache_token_stride;
  float scale;
  int64_t sliding_window;  // 0: none
};

// Scratch of one thread, reused across its tasks.
struct Scratch {
  std::vector<float> q, scores, acc, row_max, denom;
};

// Calls fn(t, row) for each token t (absolute position) in [t0, t1) of blocks [b0, b1),
// in order; row points at the token's first KV head in cache.
template <typename T, typename Fn>
inline void for_each_token(const DecodeArgs<T>& a, const T* cache, const int32_t* table, int64_t b0, int64_t b1,
                           int64_t t0, int64_t t1, Fn&& fn) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first = std::max(t0, b * a.block_size), last = std::min(t1, (b + 1) * a.block_size);
    const T* row = cache + table[b] * a.cache_block_stride + (first - b * a.block_size) * a.cache_token_stride;
    for (int64_t t = first; t < last; ++t, row += a.cache_token_stride) fn(t, row);
  }
}

// One (decode token, partition) task: the partition's blocks of the sequence, every head.
// Leaves the unnormalized sum of V (acc), the running max and the softmax denominator of
// each head in the scratch; returns false when the partition is empty.
template <typename T>
bool attend_partition(const DecodeArgs<T>& a, int64_t i, int64_t part, int64_t num_parts, Scratch& w) {
  const int64_t token = a.tokens[i], seq = a.seqs[i];
  const int64_t len = a.lens[seq];
  const int32_t* table = a.tables + seq * a.max_blocks;
  // Keys [first_key, len) are seen; the partitions split the blocks that hold them.
  const int64_t first_key = a.sliding_window > 0 ? std::max<int64_t>(0, len - a.sliding_window) : 0;
  const int64_t first_block = first_key / a.block_size;
  const int64_t num_blocks = (len + a.block_size - 1) / a.block_size - first_block;
  const int64_t per_part = (num_blocks + num_parts - 1) / num_parts;
  const int64_t b0 = first_block + part * per_part, b1 = std::min(first_block + num_blocks, b0 + per_part);
  if (b0 >= b1) return false;
  const int64_t t0 = std::max(first_key, b0 * a.block_size), t1 = std::min(len, b1 * a.block_size), n = t1 - t0;
  const int64_t heads = a.num_heads, d = a.head_dim;
  for (int64_t h = 0; h < heads; ++h) {
    const T* src = a.q + token * a.q_token_stride + h * d;
    for (int64_t x = 0; x < d; ++x) w.q[h * d + x] = widen(src[x]) * a.scale;
  }
  w.scores.resize(heads * n);
  std::fill(w.row_max.begin(), w.row_max.end(), -std::numeric_limits<float>::infinity());
  // Scores: each block is read front to back (tokens, then KV heads, then dims).
  for_each_token(a, a.k, table, b0, b1, t0, t1, [&](int64_t t, const T* row) {
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t h = kvh * a.group + g;
        const float score = dot(w.q.data() + h * d, row + kvh * d, d);
        w.scores[h * n + t - t0] = score;
        w.row_max[h] = std::max(w.row_max[h], score);
      }
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = w.scores.data() + h * n;
    const float m = w.row_max[h];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_nonpositive(s[t] - m);
      sum += s[t];
    }
    w.denom[h] = sum;
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for_each_token(a, a.v, table, b0, b1, t0, t1, [&](int64_t t, const T* row) {
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t h = kvh * a.group + g;
        axpy(w.scores[h * n + t - t0], row + kvh * d, w.acc.data() + h * d, d);
      }
    }
  });
  return true;
}

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& token_idx,
                           const at::Tensor& seq_idx, double scale, int64_t sliding_window) {
  const int64_t n = token_idx.size(0);
  if (n == 0) return;
  DecodeArgs<T> a{q.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                  block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), token_idx.data_ptr<int32_t>(),
                  seq_idx.data_ptr<int32_t>(), q.size(1), q.size(2), k_cache.size(1), k_cache.size(2),
                  q.size(1) / k_cache.size(2), block_tables.size(1), q.stride(0), out.stride(0),
                  k_cache.stride(0), k_cache.stride(1), static_cast<float>(scale), sliding_window};
  const int64_t heads = a.num_heads, d = a.head_dim;
  // Few sequences: split each one's blocks into partitions so every thread has work
  // (flash-decoding, Dao et al., 2023), merged below by their maxima and denominators.
  const int64_t threads = at::get_num_threads();
  const int64_t num_parts = n >= 2 * threads ? 1 : (2 * threads + n - 1) / n;
  std::vector<float> part_acc, part_max, part_denom;
  if (num_parts > 1) {
    part_acc.assign(n * num_parts * heads * d, 0.f);
    part_max.assign(n * num_parts * heads, -std::numeric_limits<float>::infinity());
    part_denom.assign(n * num_parts * heads, 0.f);
  }
  at::parallel_for(0, n * num_parts, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.q.resize(heads * d);
    w.acc.resize(heads * d);
    w.row_max.resize(heads);
    w.denom.resize(heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_parts, part = task % num_parts;
      if (!attend_partition(a, i, part, num_parts, w)) continue;
      if (num_parts == 1) {
        T* dst = a.out + a.tokens[i] * a.out_token_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = 1.f / w.denom[h];
          for (int64_t x = 0; x < d; ++x) dst[h * d + x] = static_cast<T>(w.acc[h * d + x] * inv);
        }
      } else {
        std::copy(w.acc.begin(), w.acc.end(), part_acc.begin() + task * heads * d);
        std::copy(w.row_max.begin(), w.row_max.end(), part_max.begin() + task * heads);
        std::copy(w.denom.begin(), w.denom.end(), part_denom.begin() + task * heads);
      }
    }
  });
  if (num_parts == 1) return;
  for (int64_t i = 0; i < n; ++i) {
    T* dst = a.out + a.tokens[i] * a.out_token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < num_parts; ++p) m = std::max(m, part_max[(i * num_parts + p) * heads + h]);
      float denom = 0.f;
      std::vector<float> sum(d, 0.f);
      for (int64_t p = 0; p < num_parts; ++p) {
        const int64_t task = i * num_parts + p;
        if (part_denom[task * heads + h] == 0.f) continue;  // empty partition
        const float weight = std::exp(part_max[task * heads + h] - m);
        denom += part_denom[task * heads + h] * weight;
        axpy(weight, part_acc.data() + (task * heads + h) * d, sum.data(), d);
      }
      for (int64_t x = 0; x < d; ++x) dst[h * d + x] = static_cast<T>(sum[x] / denom);
    }
  }
}

}  // namespace

// out, q: [num_tokens, num_heads, head_dim] (rows of q/out contiguous in heads and dims);
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
// token_idx, seq_idx: [n] int32, the decode tokens and their sequences;
// sliding_window: 0 for full attention, else w > 0 (keys len - w .. len - 1).
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor block_tables, at::Tensor seq_lens, at::Tensor token_idx,
                      at::Tensor seq_idx, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "q and out rows must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(), "q, out and caches must share a dtype");
  for (const auto* t : {&block_tables, &seq_lens, &token_idx, &seq_idx}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors must be contiguous int32");
  }
  TORCH_CHECK(token_idx.sizes() == seq_idx.sizes(), "token_idx and seq_idx must have one length");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be 0 (none) or positive, got ", sliding_window);
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx, scale,
                                 sliding_window);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, token_idx, seq_idx,
                                        scale, sliding_window);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
}
