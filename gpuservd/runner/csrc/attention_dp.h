// The bf16 item of paged decode attention on a CPU with AVX512_BF16 (vdpbf16ps), and its pick by group
// size and head dim. Defines GPUSERV_ATTN_DP 1 where the build has those instructions, else 0.
#pragma once

#include "attention_item.h"

namespace gpuserv_attn {

using ItemFn_bf16_t = void (*)(const Item&, const at::BFloat16*, const at::BFloat16*, const Shape&, float*);

#if GPUSERV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define GPUSERV_ATTN_DP 1
// bf16 on a CPU with AVX512_BF16. Scores with vdpbf16ps straight from the bf16 query and K row (DZ / 2
// instructions per query head and token instead of DZ widening loads and 2 * DZ fp32 FMAs; the scale is
// applied to the fp32 score, so the products stay exact), then the softmax of the item's scores, then the
// weighted V sum in fp32 FMAs. DZ = D / 16 (4 for head_dim 64, 8 for 128).
//
// Measured on a 2-core Zen 4 (SmolLM2's shape, 8 x 480 and 48 x 64, one thread, KV out of L3): the item
// used to take about its arithmetic time plus the time of a pure read of its bytes, one after the other.
// Most of that was waiting on DRAM at item starts and behind short runs, which the thread's Prefetcher
// (attention_item.h) now hides; the rest was arithmetic that did not need to be there:
// - a score was summed by its own 16-lane reduction (~8 instructions per query head and token); now 16
//   tokens' dot products are reduced together (dp_scores16), ~3 instructions a score;
// - the softmax's max was a scalar loop (a serial vmaxss chain, ~10% of the item); now 16 lanes at a time;
// every sum keeps its order, so the outputs are bit for bit the previous item's (SmolLM2's bf16 logits
// against transformers' sit close to test_bf16_kernels' bound, and a changed rounding crossed it);
// - V was widened with a shift per 16 values; now one 64-byte load gives 32 values as even dims
//   (shifted) and odd dims (masked), summed in separate accumulators and interleaved once at the end.
// V is summed a 16-token group at a time for every head, so each V row is consumed from L1 once, in the
// order the Prefetcher streams it; the running sums live in it.acc between groups.
// Scores of one query head against 16 consecutive K rows (k: the first row's slice of this head, rows rs
// apart; rows past `count` read the last valid one and are not stored): out[r] = q . k_r * scale, r < count.
// Each row's 16-lane dot product is summed as _mm512_reduce_add_ps sums it, lane i with i + 8, then j
// with j + 4, then (0 + 2) + (1 + 3), so the scores are bit for bit those of a reduction per token; the
// 16 rows' reductions run together as a transposing tree (3 instructions a pair of vectors a level, 45
// for the 16 rows, instead of ~7 a row reduced alone and 4 rows transposed: the scores took more
// instructions than the rest of the item).
template <int DP>
inline __attribute__((always_inline)) void dp_scores16(const at::BFloat16* q, const at::BFloat16* k, int64_t rs,
                                                       int64_t count, __m512 scale, float* out) {
  __m512bh qv[DP];
  for (int c = 0; c < DP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 a[16];
  for (int r = 0; r < 16; ++r) {
    const at::BFloat16* kr = k + std::min<int64_t>(r, count - 1) * rs;
    a[r] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
    for (int c = 1; c < DP; ++c) a[r] = _mm512_dpbf16_ps(a[r], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
  }
  // Lanes i + (i + 8): b[i] = [rows 2i, 2i + 1], 8 lanes each.
  __m512 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lanes j + (j + 4): c[i] = [rows 4i .. 4i + 3], 4 lanes each.
  __m512 c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // (0 + 2), (1 + 3): 128-bit block j of d[i] = [rows 8i + j, 8i + 4 + j], 2 lanes each.
  __m512 d[2];
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]))));
  // (0 + 2) + (1 + 3): lane 4 j + e of s = row 4 e + j; back to row order.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __mmask16 keep = count >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  _mm512_mask_storeu_ps(out, keep, _mm512_mul_ps(_mm512_permutexvar_ps(order, s), scale));
}

// Floats a head's scores take in the item's scratch: n, as a multiple of 16 for the softmax's vectors.
inline int64_t dp_scores_stride(int64_t n) { return (n + 15) & ~int64_t(15); }

// The max of n scores, 16 at a time (a scalar loop was a serial vmaxss chain, ~10% of the item).
inline float max_row16(const float* s, int64_t n) {
  const int64_t nv = (n + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - 16 * (nv - 1))) - 1);
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i + 1 < nv; ++i) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + 16 * i));
  mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_loadu_ps(s + 16 * (nv - 1)));
  return _mm512_reduce_max_ps(mv);
}

// The item; JP: V tiles of 32 * JP dims (G * 2 * JP accumulators). scores: [H, dp_scores_stride(n)].
template <int G, int DZ, int JP>
void attend_item_dp(const Item& it, const at::BFloat16* k, const at::BFloat16* v, const Shape& sh, float* scores) {
  static_assert(DZ % 2 == 0 && (DZ / 2) % JP == 0, "D must be a multiple of 32 and of the tile");
  constexpr int DP = DZ / 2;  // 32 bf16 per dot-product step
  const int64_t n = it.t1 - it.t0, D = sh.D, KVH = sh.kv_heads, rs = sh.row_stride;
  const int64_t ns = dp_scores_stride(n);
  const int64_t row_bytes = rs * int64_t(sizeof(at::BFloat16));
  const auto* q = static_cast<const at::BFloat16*>(it.qraw);
  const int64_t qstride = it.qraw_head_stride;
  int64_t i0 = 0;
  const __m512 scale = _mm512_set1_ps(it.scale);
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    for (int64_t r0 = 0; r0 < count; r0 += 16) {
      for (int64_t hq = 0; hq < KVH * G; ++hq)
        dp_scores16<DP>(q + hq * qstride, k + (row + r0) * rs + (hq / G) * D, rs, std::min<int64_t>(16, count - r0),
                        scale, scores + hq * ns + i0 + r0);
    }
    i0 += count;
    if (it.pf) it.pf->consume(count * row_bytes);
  });
  for (int64_t hq = 0; hq < KVH * G; ++hq) {  // exp_sub_rows as before: the same numerators and sums
    it.m[hq] = max_row16(scores + hq * ns, n);
    it.l[hq] = exp_sub_rows(scores + hq * ns, n, it.m[hq]);
  }
  // it.acc holds each head's running sums with dims in even / odd order per 32 until the end.
  std::fill(it.acc, it.acc + KVH * G * D, 0.f);
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t i = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    for (int64_t r0 = 0; r0 < count; r0 += 16) {
      const int64_t r1 = std::min<int64_t>(count, r0 + 16);
      for (int64_t h = 0; h < KVH; ++h) {
        const float* p = scores + h * G * ns + i;
        for (int64_t c0 = 0; c0 < D; c0 += 32 * JP) {
          __m512 a[G][2 * JP];
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < 2 * JP; ++j) a[g][j] = _mm512_loadu_ps(it.acc + (h * G + g) * D + c0 + 16 * j);
          for (int64_t r = r0; r < r1; ++r) {
            const at::BFloat16* vr = v + (row + r) * rs + h * D + c0;
            __m512 vv[2 * JP];
            for (int j = 0; j < JP; ++j) {
              const __m512i x = _mm512_loadu_si512(vr + 32 * j);
              vv[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
              vv[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
            }
            for (int g = 0; g < G; ++g) {
              const __m512 pg = _mm512_set1_ps(p[g * ns + r]);
              for (int j = 0; j < 2 * JP; ++j) a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < 2 * JP; ++j) _mm512_storeu_ps(it.acc + (h * G + g) * D + c0 + 16 * j, a[g][j]);
        }
      }
      if (it.pf) it.pf->consume((r1 - r0) * row_bytes);
    }
    i += count;
  });
  // Even / odd halves back to dim order: dims 2i and 2i + 1 of each 32 from lane i of either half.
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t c = 0; c < KVH * G * D; c += 32) {
    const __m512 ev = _mm512_loadu_ps(it.acc + c), od = _mm512_loadu_ps(it.acc + c + 16);
    _mm512_storeu_ps(it.acc + c, _mm512_permutex2var_ps(ev, lo, od));
    _mm512_storeu_ps(it.acc + c + 16, _mm512_permutex2var_ps(ev, hi, od));
  }
}

// The dot-product variant for this group size and head dim (64 or 128), or nullptr.
ItemFn_bf16_t pick_dp(int64_t group, int64_t D) {
  if (!gpuserv_simd::cpu_avx512bf16()) return nullptr;
  if (D == 64) {
    switch (group) {
      case 1: return attend_item_dp<1, 4, 2>;
      case 2: return attend_item_dp<2, 4, 2>;
      case 3: return attend_item_dp<3, 4, 2>;
      case 4: return attend_item_dp<4, 4, 2>;
      case 5: return attend_item_dp<5, 4, 2>;
      case 6: return attend_item_dp<6, 4, 1>;
      case 7: return attend_item_dp<7, 4, 1>;
      case 8: return attend_item_dp<8, 4, 1>;
      default: return nullptr;
    }
  }
  if (D == 128) {
    switch (group) {
      case 1: return attend_item_dp<1, 8, 4>;
      case 2: return attend_item_dp<2, 8, 4>;
      case 3: return attend_item_dp<3, 8, 2>;
      case 4: return attend_item_dp<4, 8, 2>;
      case 5: return attend_item_dp<5, 8, 2>;
      case 6: return attend_item_dp<6, 8, 1>;
      case 7: return attend_item_dp<7, 8, 1>;
      case 8: return attend_item_dp<8, 8, 1>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#else
#define GPUSERV_ATTN_DP 0
#endif

}  // namespace gpuserv_attn
