// Decode attention over a paged KV cache, reading the blocks where they lie.
//
// One query token per sequence. The cache of one layer is
// k, v: [num_blocks, block_size, kv_heads, head_dim], and a sequence's
// tokens are found through its row of the block table. The torch path gathers
// those blocks into a contiguous tensor first (index_select), which at long
// context costs about as much as the attention itself; here each work item
// walks the blocks in place.
//
// Work items are (sequence, kv_head, partition of the context): the `group`
// query heads that share a KV head are computed together so each K/V row is
// read once, and long contexts are split into partitions (flash-decoding) so
// that a single sequence still keeps every thread busy. Each item keeps its
// own softmax max / sum / weighted V; a second pass combines the partitions.
// Accumulation is fp32 for every storage dtype (fp32, bf16, fp16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

#if GPUSERV_AVX2
using namespace gpuserv_simd;
#endif

constexpr int64_t kPartition = 256;  // context tokens per work item

inline float to_f32(float x) { return x; }
inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(at::Half x) { return static_cast<float>(x); }


// One work item: query heads [g0, g0 + group) of sequence b against context tokens [t0, t1).
// q: [group, D] fp32, already scaled. Writes m[group], l[group], acc[group, D].
template <typename T>
void attend_part(const float* q, const T* k, const T* v, const int32_t* table, int64_t block_size,
                 int64_t row_stride, int64_t t0, int64_t t1, int64_t group, int64_t D, float* scores,
                 float* m, float* l, float* acc) {
  const int64_t n = t1 - t0;
  // scores: [group, n]
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const T* kr = k + slot * row_stride;
#if GPUSERV_AVX2
    if (D % 8 == 0 && group <= 16) {
      __m256 s[16];
      for (int64_t g = 0; g < group; ++g) s[g] = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        __m256 kv = load8(kr + c);
        for (int64_t g = 0; g < group; ++g) s[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kv, s[g]);
      }
      for (int64_t g = 0; g < group; ++g) scores[g * n + (t - t0)] = hsum(s[g]);
      continue;
    }
#endif
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t c = 0; c < D; ++c) s += q[g * D + c] * to_f32(kr[c]);
      scores[g * n + (t - t0)] = s;
    }
  }
  // softmax numerators, per query head
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    float sum = 0.f;
    int64_t i = 0;
#if GPUSERV_AVX2
    __m256 vm = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
      _mm256_storeu_ps(sg + i, e);
      vs = _mm256_add_ps(vs, e);
    }
    sum = hsum(vs);
#endif
    for (; i < n; ++i) {
      sg[i] = std::exp(sg[i] - mx);
      sum += sg[i];
    }
    m[g] = mx;
    l[g] = sum;
  }
  // acc[g] = sum_t p[g, t] * v[t]
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const T* vr = v + slot * row_stride;
#if GPUSERV_AVX2
    if (D % 8 == 0) {
      for (int64_t c = 0; c < D; c += 8) {
        __m256 vv = load8(vr + c);
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + g * D + c;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[g * n + (t - t0)]), vv, _mm256_loadu_ps(a)));
        }
      }
      continue;
    }
#endif
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + (t - t0)];
      for (int64_t c = 0; c < D; ++c) acc[g * D + c] += p * to_f32(vr[c]);
    }
  }
}

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& ctx_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t group = H / KVH;
  const int64_t row_stride = KVH * D;  // elements between consecutive token rows of the cache
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  const int32_t* lp = ctx_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();

  // Work items: (b, kv_head, partition), flattened.
  std::vector<int64_t> first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t parts = std::max<int64_t>(1, (lp[b] + kPartition - 1) / kPartition);
    first_item[b + 1] = first_item[b] + parts * KVH;
  }
  const int64_t items = first_item[B];
  std::vector<float> part_m(items * group), part_l(items * group), part_acc(items * group * D);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(group * D), scores(group * kPartition);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), it) - first_item.begin() - 1;
      const int64_t local = it - first_item[b];
      const int64_t h = local % KVH, part = local / KVH;
      const int64_t len = lp[b];
      const int64_t t0 = part * kPartition, t1 = std::min(len, t0 + kPartition);
      for (int64_t g = 0; g < group; ++g) {
        const T* qr = qp + b * qs0 + (h * group + g) * qs1;
        for (int64_t c = 0; c < D; ++c) qbuf[g * D + c] = to_f32(qr[c]) * static_cast<float>(scale);
      }
      if (t1 <= t0) {  // empty context: contributes nothing
        for (int64_t g = 0; g < group; ++g) {
          part_m[it * group + g] = -std::numeric_limits<float>::infinity();
          part_l[it * group + g] = 0.f;
        }
        std::fill(&part_acc[it * group * D], &part_acc[(it + 1) * group * D], 0.f);
        continue;
      }
      attend_part<T>(qbuf.data(), kp + h * D, vp + h * D, tp + b * table_stride, block_size, row_stride, t0, t1,
                     group, D, scores.data(), &part_m[it * group], &part_l[it * group], &part_acc[it * group * D]);
    }
  });

  // Combine the partitions of each (b, kv_head): rescale by exp(m_p - max m).
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH, h = bh % KVH;
      const int64_t parts = (first_item[b + 1] - first_item[b]) / KVH;
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (b * H + h * group + g) * D;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_m[(first_item[b] + p * KVH + h) * group + g]);
        float denom = 0.f;
        std::fill(o, o + D, 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t it = first_item[b] + p * KVH + h;
          const float mp = part_m[it * group + g];
          if (mp == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(mp - mx);
          denom += w * part_l[it * group + g];
          const float* a = &part_acc[(it * group + g) * D];
          for (int64_t c = 0; c < D; ++c) o[c] += w * a[c];
        }
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
        for (int64_t c = 0; c < D; ++c) o[c] *= inv;
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache, v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) == q.size(0),
              "block_table must be int32 [B, max_blocks]");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kInt && ctx_lens.is_contiguous() && ctx_lens.numel() == q.size(0),
              "ctx_lens must be int32 [B]");
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on the CPU");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kFloat: paged_decode_impl<float>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    case at::kBFloat16: paged_decode_impl<at::BFloat16>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    case at::kHalf: paged_decode_impl<at::Half>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

int64_t simd_width() { return GPUSERV_AVX2 ? 8 : 1; }

}  // namespace

TORCH_LIBRARY(gpuserv, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_lens, float scale) -> Tensor");
  m.def("simd_width() -> int", &simd_width);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("paged_decode", &paged_decode); }
