// Decode attention over a paged KV cache, reading the blocks where they lie.
//
// One query token per sequence. The cache of one layer is
// k, v: [num_blocks, block_size, kv_heads, head_dim], and a sequence's
// tokens are found through its row of the block table. The torch path gathers
// those blocks into a contiguous tensor first (index_select), which at long
// context costs about as much as the attention itself; here each work item
// walks the blocks in place.
//
// Work items are (sequence, partition of its context), all heads: a token's
// K/V row (every KV head) is then read whole by one core, which the hardware
// prefetchers stream well; splitting items by KV head instead made each core
// fetch the lines of the heads it did not use (measured: no faster than the
// gather path once the cache was out of L3). How an item reads its rows is the
// item kind's (attention_f32.h: fp32 copies each step's rows in one sequential
// pass; attention_dp.h: bf16 with AVX512_BF16 reads through a prefetch stream
// over all of its thread's items, attention_item.h's Prefetcher; the AVX2
// bf16 / fp16 item prefetches the next run). The `group` query heads that
// share a KV head are computed together so each row is read once, and long
// contexts are split into partitions (flash-decoding) so one sequence still
// keeps every thread busy. Each item keeps its own softmax max / sum /
// weighted V per head; a second pass combines the partitions. Accumulation is
// fp32 for every storage dtype (fp32, bf16, fp16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_dp.h"
#include "attention_f32.h"
#include "attention_item.h"

namespace {

using namespace gpuserv_attn;

constexpr int64_t kMaxPartition = 256;  // context tokens per work item, at most
constexpr int64_t kMinPartition = 32;

template <typename T>
using ItemFn = void (*)(const Item&, const T*, const T*, const Shape&, float*);

#if GPUSERV_AVX2
// The fp32 item with V slices as wide as D allows (32, 16 or 8 floats).
template <int G>
ItemFn<float> f32_item(int64_t D) {
  return D % 32 == 0 ? attend_item_f32<G, 32> : D % 16 == 0 ? attend_item_f32<G, 16> : attend_item_f32<G, 8>;
}

// The register-blocked two-pass item of bf16 / fp16 (G * TILE / 8 accumulators within 12 of the 16 ymm
// registers), or nullptr.
template <typename T>
ItemFn<T> two_pass_item(int64_t group, int64_t D) {
  if (D % 16 != 0) return nullptr;
  const bool t32 = D % 32 == 0;
  switch (group) {
    case 1: return t32 ? attend_item_two_pass<T, 1, 32> : attend_item_two_pass<T, 1, 16>;
    case 2: return t32 ? attend_item_two_pass<T, 2, 32> : attend_item_two_pass<T, 2, 16>;
    case 3: return t32 ? attend_item_two_pass<T, 3, 32> : attend_item_two_pass<T, 3, 16>;
    case 4: return attend_item_two_pass<T, 4, 16>;
    case 5: return attend_item_two_pass<T, 5, 16>;
    case 6: return attend_item_two_pass<T, 6, 16>;
    case 7: return attend_item_two_pass<T, 7, 8>;
    case 8: return attend_item_two_pass<T, 8, 8>;
    default: return nullptr;
  }
}
#endif

// The compiled item for this dtype, group size (1-8) and head dim, else the generic loops.
template <typename T>
ItemFn<T> pick_item_fn(int64_t group, int64_t D) {
#if GPUSERV_ATTN_DP
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (const auto fn = pick_dp(group, D)) return fn;
  }
#endif
#if GPUSERV_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (D % 8 == 0) {
      switch (group) {
        case 1: return f32_item<1>(D);
        case 2: return f32_item<2>(D);
        case 3: return f32_item<3>(D);
        case 4: return f32_item<4>(D);
        case 5: return f32_item<5>(D);
        case 6: return f32_item<6>(D);
        case 7: return f32_item<7>(D);
        case 8: return f32_item<8>(D);
        default: break;
      }
    }
  } else if (const auto fn = two_pass_item<T>(group, D)) {
    return fn;
  }
#endif
  return attend_item_generic<T>;
}

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& ctx_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2);
  const Shape sh{k_cache.size(1), KVH, H / KVH, D, KVH * D};
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  const int32_t* lp = ctx_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();  // out has q's dtype

  // Partition length: the largest (<= kMaxPartition) that still gives every thread a few items.
  int64_t part_len = kMaxPartition;
  const int64_t want_items = 4 * at::get_num_threads();
  auto count_items = [&](int64_t len) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) n += std::max<int64_t>(1, (lp[b] + len - 1) / len);
    return n;
  };
  while (part_len > kMinPartition && count_items(part_len) < want_items) part_len /= 2;

  // Work items: (b, partition), flattened; first_item[b] is b's first.
  std::vector<int64_t> first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first_item[b + 1] = first_item[b] + std::max<int64_t>(1, (lp[b] + part_len - 1) / part_len);
  const int64_t items = first_item[B];
  const ItemFn<T> attend_item = pick_item_fn<T>(sh.group, D);
  // The fp32, scaled query of the AVX2 / generic items (the bf16 dot-product item reads q as given).
  bool need_qs = true;
#if GPUSERV_ATTN_DP
  if constexpr (std::is_same_v<T, at::BFloat16>) need_qs = attend_item != pick_dp(sh.group, D);
#endif
  std::vector<float> qs(need_qs ? B * H * D : 0), part_m(items * H), part_l(items * H), part_acc(items * H * D);
  if (need_qs)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < D; ++c) qs[(b * H + h) * D + c] = to_f32(qp[b * qs0 + h * qs1 + c]) * static_cast<float>(scale);

  // Items go to threads in contiguous ranges of about equal context tokens (an even split by item
  // count gave the thread holding the long sequences' partitions ~30% more work in a mixed batch).
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> split(nthreads + 1, items);
  {
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) total += std::max<int64_t>(1, lp[b]);
    split[0] = 0;
    int64_t acc = 0, t = 1, it = 0;
    for (int64_t b = 0; b < B && t < nthreads; ++b)
      for (int64_t p = first_item[b]; p < first_item[b + 1] && t < nthreads; ++p, ++it) {
        const int64_t t0 = (p - first_item[b]) * part_len;
        acc += std::max<int64_t>(1, std::min<int64_t>(lp[b], t0 + part_len) - t0);
        while (t < nthreads && acc * nthreads >= total * t) split[t++] = it + 1;
      }
  }
  auto item_seq = [&](int64_t it) {
    return std::upper_bound(first_item.begin(), first_item.end(), it) - first_item.begin() - 1;
  };
  at::parallel_for(0, nthreads, 1, [&](int64_t th0, int64_t th1) {
    // Scores of an item ([H, part_len + 32]; the fp32 item's [H, kStep + 1]) and the fp32 item's row buffer.
    std::vector<float> scores(H * (std::max(part_len, kStep) + 32) + f32_buffer_floats(sh.row_stride));
#if GPUSERV_AVX2
    // The bf16 dot-product item reads its rows through a prefetch stream over all of this thread's items.
    std::vector<Prefetcher::Span> spans;
    Prefetcher pf;
    if (!need_qs) {
      for (int64_t it = split[th0]; it < split[th1]; ++it) {
        const int64_t b = item_seq(it);
        const int64_t t0 = (it - first_item[b]) * part_len;
        spans.push_back({tp + b * table_stride, t0, std::min<int64_t>(lp[b], t0 + part_len)});
      }
      pf.spans = spans.data();
      pf.nspans = static_cast<int64_t>(spans.size());
      pf.k = reinterpret_cast<const char*>(kp);
      pf.v = reinterpret_cast<const char*>(vp);
      pf.row_bytes = sh.row_stride * static_cast<int64_t>(sizeof(T));
      pf.block_size = sh.block_size;
      pf.start();
    }
    Prefetcher* const pfp = need_qs ? nullptr : &pf;
#else
    Prefetcher* const pfp = nullptr;
#endif
    for (int64_t it = split[th0]; it < split[th1]; ++it) {
      const int64_t b = item_seq(it);
      const int64_t t0 = (it - first_item[b]) * part_len, t1 = std::min<int64_t>(lp[b], t0 + part_len);
      Item item{need_qs ? &qs[b * H * D] : nullptr, tp + b * table_stride, t0, t1, &part_m[it * H], &part_l[it * H], &part_acc[it * H * D],
                qp + b * qs0, qs1, static_cast<float>(scale), pfp};
      if (it + 1 < split[th1]) {
        const int64_t nb = item_seq(it + 1);
        item.next_table = tp + nb * table_stride;
        item.next_t0 = (it + 1 - first_item[nb]) * part_len;
        item.next_t1 = std::min<int64_t>(lp[nb], item.next_t0 + part_len);
      }
      if (t1 <= t0) {  // empty context: contributes nothing
        std::fill(item.m, item.m + H, -std::numeric_limits<float>::infinity());
        std::fill(item.l, item.l + H, 0.f);
        std::fill(item.acc, item.acc + H * D, 0.f);
        continue;
      }
      attend_item(item, kp, vp, sh, scores.data());
    }
  });

  // Combine the partitions of each (b, head): rescale by exp(m_p - max m).
  // bf16 / fp16 sum in an fp32 row and round once into out (no fp32 output and .to() per layer).
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* o;
      if constexpr (std::is_same_v<T, float>) o = op + bh * D; else o = row.data();
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t it = first_item[b]; it < first_item[b + 1]; ++it) mx = std::max(mx, part_m[it * H + h]);
      float denom = 0.f;
      std::fill(o, o + D, 0.f);
      for (int64_t it = first_item[b]; it < first_item[b + 1]; ++it) {
        const float mp = part_m[it * H + h];
        if (mp == -std::numeric_limits<float>::infinity()) continue;
        const float w = std::exp(mp - mx);
        denom += w * part_l[it * H + h];
        const float* a = &part_acc[(it * H + h) * D];
        for (int64_t c = 0; c < D; ++c) o[c] += w * a[c];
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t c = 0; c < D; ++c) o[c] *= inv;
      } else {
        for (int64_t c = 0; c < D; ++c) op[bh * D + c] = static_cast<T>(o[c] * inv);
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
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat: paged_decode_impl<float>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    case at::kBFloat16: paged_decode_impl<at::BFloat16>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    case at::kHalf: paged_decode_impl<at::Half>(q, k_cache, v_cache, block_table, ctx_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

int64_t simd_width() { return GPUSERV_AVX2 ? 8 : 1; }

}  // namespace

TORCH_LIBRARY(gpuserv, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_lens, float scale) -> Tensor");
  m.def("simd_width() -> int", &simd_width);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("paged_decode", &paged_decode); }
