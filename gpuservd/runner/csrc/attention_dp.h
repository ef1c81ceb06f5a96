// The bf16 item of paged decode attention on a CPU with AVX512_BF16 (vdpbf16ps), and its pick by group
// size and head dim. Defines GPUSERV_ATTN_DP 1 where the build has those instructions, else 0.
#pragma once

#include "attention_item.h"

namespace gpuserv_attn {

using ItemFn_bf16_t = void (*)(const Item&, const at::BFloat16*, const at::BFloat16*, const Shape&, float*);

#if GPUSERV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define GPUSERV_ATTN_DP 1
// bf16 on a CPU with AVX512_BF16: scores with vdpbf16ps straight from the bf16 query and K row
// (DZ / 2 instructions per query head and token instead of DZ widening loads and 2 * DZ fp32 FMAs,
// then one reduction; the scale is applied to the fp32 score, so the products stay exact), and
// the weighted V sum with 512-bit FMAs on V widened 16 lanes at a time, J registers per pass.
// DZ = D / 16 (4 for head_dim 64, 8 for 128); G * J accumulators.
inline __m512 widen16(const at::BFloat16* p) { return gpuserv_simd::load16(p); }

template <int G, int DZ, int J>
void attend_item_dp(const Item& it, const at::BFloat16* k, const at::BFloat16* v, const Shape& sh, float* scores) {
  static_assert(DZ % 2 == 0 && DZ % J == 0, "D must be a multiple of 32 and of the tile");
  constexpr int DP = DZ / 2;  // 32 bf16 per dot-product step
  const int64_t n = it.t1 - it.t0, D = sh.D, KVH = sh.kv_heads;
  const auto* q = static_cast<const at::BFloat16*>(it.qraw);
  // K is prefetched kAheadTokens ahead of the scoring (one block ahead left the DRAM pipe half empty:
  // a run of 16 tokens is scored in less time than its 6 KB take to arrive), V run by run for the
  // second pass.
  constexpr int64_t kAheadTokens = 48;
  auto prefetch_tokens = [&](const at::BFloat16* base, int64_t from, int64_t to) {
    for_each_run(it.table, sh.block_size, from, to,
                 [&](int64_t row, int64_t count) { prefetch_rows(base, row, count, sh.row_stride); });
  };
  int64_t k_ahead = std::min(it.t1, it.t0 + kAheadTokens);
  prefetch_tokens(k, it.t0, k_ahead);
  int64_t i0 = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    const int64_t want = std::min(it.t1, it.t0 + i0 + count + kAheadTokens);
    if (want > k_ahead) {
      prefetch_tokens(k, k_ahead, want);
      k_ahead = want;
    }
    prefetch_rows(v, row, count, sh.row_stride);
    for (int64_t h = 0; h < KVH; ++h) {
      __m512bh qv[G][DP];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DP; ++c)
          qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * G + g) * it.qraw_head_stride + 32 * c);
      float* sc = scores + h * G * n + i0;
      for (int64_t r = 0; r < count; ++r) {
        const at::BFloat16* kr = k + (row + r) * sh.row_stride + h * D;
        __m512bh kz[DP];
        for (int c = 0; c < DP; ++c) kz[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kz[0]);
          for (int c = 1; c < DP; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kz[c]);
          sc[g * n + r] = _mm512_reduce_add_ps(a) * it.scale;
        }
      }
    }
    i0 += count;
  });
  softmax_rows(scores, KVH * G, n, it.m, it.l);
  for (int64_t h = 0; h < KVH; ++h) {
    const float* p = scores + h * G * n;
    for (int64_t c0 = 0; c0 < D; c0 += 16 * J) {
      __m512 a[G][J];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j) a[g][j] = _mm512_setzero_ps();
      int64_t i = 0;
      for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
        for (int64_t r = 0; r < count; ++r, ++i) {
          const at::BFloat16* vr = v + (row + r) * sh.row_stride + h * D + c0;
          __m512 vv[J];
          for (int j = 0; j < J; ++j) vv[j] = widen16(vr + 16 * j);
          for (int g = 0; g < G; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * n + i]);
            for (int j = 0; j < J; ++j) a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
          }
        }
      });
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j) _mm512_storeu_ps(it.acc + (h * G + g) * D + c0 + 16 * j, a[g][j]);
    }
  }
}

// The dot-product variant for this group size and head dim (64 or 128), or nullptr.
ItemFn_bf16_t pick_dp(int64_t group, int64_t D) {
  if (!gpuserv_simd::cpu_avx512bf16()) return nullptr;
  if (D == 64) {
    switch (group) {
      case 1: return attend_item_dp<1, 4, 4>;
      case 2: return attend_item_dp<2, 4, 4>;
      case 3: return attend_item_dp<3, 4, 4>;
      case 4: return attend_item_dp<4, 4, 4>;
      case 5: return attend_item_dp<5, 4, 4>;
      case 6: return attend_item_dp<6, 4, 2>;
      case 7: return attend_item_dp<7, 4, 2>;
      case 8: return attend_item_dp<8, 4, 2>;
      default: return nullptr;
    }
  }
  if (D == 128) {
    switch (group) {
      case 1: return attend_item_dp<1, 8, 8>;
      case 2: return attend_item_dp<2, 8, 8>;
      case 3: return attend_item_dp<3, 8, 4>;
      case 4: return attend_item_dp<4, 8, 4>;
      case 5: return attend_item_dp<5, 8, 4>;
      case 6: return attend_item_dp<6, 8, 2>;
      case 7: return attend_item_dp<7, 8, 2>;
      case 8: return attend_item_dp<8, 8, 2>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#else
#define GPUSERV_ATTN_DP 0
#endif

}  // namespace gpuserv_attn
