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
// gather path once the cache was out of L3). Software prefetch of the next
// block made no measurable difference, so there is none. The `group` query heads that
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

#include "simd.h"

namespace {

#if GPUSERV_AVX2
using namespace gpuserv_simd;
#endif

constexpr int64_t kMaxPartition = 256;  // context tokens per work item, at most
constexpr int64_t kMinPartition = 32;
constexpr int64_t kChunk = 32;  // context tokens per step of the single-pass item (at most)

inline float to_f32(float x) { return x; }
inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(at::Half x) { return static_cast<float>(x); }

// Calls fn(row_index, count) for each run of consecutive context tokens [t0, t1) that share a block:
// row_index is the flat cache row (block * block_size + offset) of the run's first token.
template <typename Fn>
inline void for_each_run(const int32_t* table, int64_t block_size, int64_t t0, int64_t t1, Fn&& fn) {
  int64_t t = t0;
  while (t < t1) {
    const int64_t off = t % block_size;
    const int64_t count = std::min(block_size - off, t1 - t);
    fn(static_cast<int64_t>(table[t / block_size]) * block_size + off, count);
    t += count;
  }
}

struct Item {
  const float* q;  // [H, D] fp32, scaled
  const int32_t* table;  // the sequence's block table
  int64_t t0, t1;  // context tokens of this item
  float* m;  // [H] softmax max of this item's scores
  float* l;  // [H] sum of exp(score - m)
  float* acc;  // [H, D] sum of exp(score - m) * v
  const void* qraw = nullptr;  // the query as given ([H, D] in the cache dtype, heads qraw_head_stride apart)
  int64_t qraw_head_stride = 0;
  float scale = 1.f;
};

struct Shape {
  int64_t block_size, kv_heads, group, D, row_stride;  // row_stride = kv_heads * D
};

// s[i] = exp(s[i] - mx) over n scores; returns their sum.
inline float exp_sub_rows(float* s, int64_t n, float mx) {
  float sum = 0.f;
  int64_t i = 0;
#if GPUSERV_AVX2
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vs = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  sum = hsum(vs);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

// softmax numerators in place over scores [rows, n]; writes each row's max and sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
    m[r] = mx;
    l[r] = exp_sub_rows(sr, n, mx);
  }
}

// Any group size and head dim, plain loops. scores: [H, n] scratch.
template <typename T>
void attend_item_generic(const Item& it, const T* k, const T* v, const Shape& sh, float* scores) {
  const int64_t n = it.t1 - it.t0, G = sh.group, D = sh.D, H = sh.kv_heads * G;
  int64_t i = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    for (int64_t r = 0; r < count; ++r, ++i) {
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const T* kr = k + (row + r) * sh.row_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = it.q + (h * G + g) * D;
          float s = 0.f;
          for (int64_t c = 0; c < D; ++c) s += qg[c] * to_f32(kr[c]);
          scores[(h * G + g) * n + i] = s;
        }
      }
    }
  });
  softmax_rows(scores, H, n, it.m, it.l);
  std::fill(it.acc, it.acc + H * D, 0.f);
  i = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    for (int64_t r = 0; r < count; ++r, ++i) {
      for (int64_t h = 0; h < sh.kv_heads; ++h) {
        const T* vr = v + (row + r) * sh.row_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[(h * G + g) * n + i];
          float* a = it.acc + (h * G + g) * D;
          for (int64_t c = 0; c < D; ++c) a[c] += p * to_f32(vr[c]);
        }
      }
    }
  });
}

#if GPUSERV_AVX2
// Prefetches `count` consecutive cache rows (a run within one block: contiguous bytes) into L2.
template <typename T>
inline void prefetch_rows(const T* base, int64_t row, int64_t count, int64_t row_stride) {
  const char* p = reinterpret_cast<const char*>(base + row * row_stride);
  const int64_t bytes = count * row_stride * int64_t(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// Prefetches a chunk's K and V rows (contiguous: `bytes` from k and from v) into L2 over `steps` calls of
// step(), K first, a few lines a call; finish() issues what is left. (A chunk's ~400 lines requested at
// once left the miss buffers full and stalled the loads of the work in between.)
struct ChunkPrefetch {
  const char *k, *v;
  int64_t lines, per_step, next = 0;
  ChunkPrefetch(const char* k_, const char* v_, int64_t bytes, int64_t steps)
      : k(k_), v(v_), lines((bytes + 63) / 64), per_step(steps > 0 ? (2 * lines + steps - 1) / steps : 2 * lines) {}
  inline void step() {
    for (int64_t e = std::min(next + per_step, 2 * lines); next < e; ++next)
      _mm_prefetch((next < lines ? k + next * 64 : v + (next - lines) * 64), _MM_HINT_T1);
  }
  inline void finish() {
    per_step = 2 * lines;
    step();
  }
};

// The G query heads of one KV head (q [G][D]) against one K row: out[g * stride] = q[g] . kr, both item
// kinds' score loop (two 8-lane accumulators per head, summed once at the end).
template <typename T, int G>
inline __attribute__((always_inline)) void group_scores(const float* q, const T* kr, int64_t D, float* out,
                                                        int64_t stride) {
  using gpuserv_simd::load8;
  __m256 s0[G], s1[G];
  for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m256 k0 = load8(kr + c), k1 = load8(kr + c + 8);
    for (int g = 0; g < G; ++g) {
      s0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), k0, s0[g]);
      s1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c + 8), k1, s1[g]);
    }
  }
  for (int g = 0; g < G; ++g) out[g * stride] = hsum(_mm256_add_ps(s0[g], s1[g]));
}

// bf16 / fp16 items: all of the item's scores first, then V swept once per head and tile. (The one-pass
// item below, used for fp32, rounds differently where a head's running sums are rescaled; in bf16 that
// moved SmolLM2's logits off transformers' by more than test_bf16_kernels allows, so these keep the
// two-pass order their outputs were checked in.)
template <typename T, int G, int TILE>
void attend_item_two_pass(const Item& it, const T* k, const T* v, const Shape& sh, float* scores) {
  const int64_t n = it.t1 - it.t0, D = sh.D, KVH = sh.kv_heads;
  // While a run's K is scored, the next run's K and this run's V are prefetched into L2.
  // The runs' blocks lie anywhere in the pool and each head reads only its 64-128 bytes of a token's
  // row, which the hardware prefetchers did not follow: with the cache out of L3 a 32-sequence batch
  // at context 80 took 4x as long as with it in cache.
  constexpr bool kPrefetch = true;
  int64_t i0 = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    if constexpr (kPrefetch) {
      if (i0 == 0) prefetch_rows(k, row, count, sh.row_stride);
      const int64_t t_next = it.t0 + i0 + count;
      if (t_next < it.t1) {
        const int64_t off = t_next % sh.block_size;
        prefetch_rows(k, static_cast<int64_t>(it.table[t_next / sh.block_size]) * sh.block_size + off,
                      std::min(sh.block_size - off, it.t1 - t_next), sh.row_stride);
      }
      prefetch_rows(v, row, count, sh.row_stride);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const float* q = it.q + h * G * D;
      float* sc = scores + h * G * n + i0;
      for (int64_t r = 0; r < count; ++r) {
        group_scores<T, G>(q, k + (row + r) * sh.row_stride + h * D, D, sc + r, n);
      }
    }
    i0 += count;
  });
  softmax_rows(scores, KVH * G, n, it.m, it.l);
  constexpr int J = TILE / 8;
  for (int64_t h = 0; h < KVH; ++h) {
    const float* p = scores + h * G * n;
    for (int64_t c0 = 0; c0 < D; c0 += TILE) {
      __m256 a[G][J];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j) a[g][j] = _mm256_setzero_ps();
      int64_t i = 0;
      for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
        for (int64_t r = 0; r < count; ++r, ++i) {
          const T* vr = v + (row + r) * sh.row_stride + h * D + c0;
          for (int j = 0; j < J; ++j) {
            const __m256 vv = load8(vr + 8 * j);
            for (int g = 0; g < G; ++g) a[g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * n + i), vv, a[g][j]);
          }
        }
      });
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j) _mm256_storeu_ps(it.acc + (h * G + g) * D + c0 + 8 * j, a[g][j]);
    }
  }
}

// The item with the group size G and a V tile of TILE floats fixed at compile time, so that the
// G dot products of a K row and the G x TILE output accumulators live in registers (with a
// runtime G they went through the stack, and every FMA waited on a store: 3-4x slower).
// Needs D % 16 == 0 and D % TILE == 0.
//
// One pass over the context, kChunk tokens at a time (online softmax): a chunk's K rows are scored,
// each head's running max, sum and weighted V are rescaled where its max grew, and the chunk's V rows
// are added while they are in L1. Each K and V row then comes from DRAM once and in block order, and
// the next chunk's rows are prefetched while this one is computed. (Two passes, all scores first and
// then V swept once per head and tile, read V in strided sweeps that the hardware prefetchers did
// not keep up with: 8 GB/s of KV at 8 sequences x 500 tokens on 2 cores, against ~2x that here.)
// scores: [H, kChunk + 1] scratch.
template <typename T, int G, int TILE>
void attend_item_fixed(const Item& it, const T* k, const T* v, const Shape& sh, float* scores) {
  if constexpr (!std::is_same_v<T, float>) {
    attend_item_two_pass<T, G, TILE>(it, k, v, sh, scores);
    return;
  }
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, bs = sh.block_size;
  constexpr int J = TILE / 8;
  float* alpha = scores + H * kChunk;  // [H] this chunk's rescale of each head's running sums
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  // The chunk from token t: its first cache row and token count (within one block).
  auto chunk_at = [&](int64_t t, int64_t& row, int64_t& n) {
    const int64_t off = t % bs;
    n = std::min({bs - off, it.t1 - t, kChunk});
    row = static_cast<int64_t>(it.table[t / bs]) * bs + off;
  };
  // Three chunks in view: this one (row, n), the next (row1, n1) and the one after (row2, n2). The
  // chunk after next is prefetched into L2 while this one is computed, a few lines per inner step of
  // its work (ChunkPrefetch), so the requests are spread out and arrive ~2 chunks before their use.
  int64_t row, n, row1 = 0, n1 = 0, row2 = 0, n2 = 0;
  chunk_at(it.t0, row, n);
  if (it.t0 + n < it.t1) chunk_at(it.t0 + n, row1, n1);
  if (n1 && it.t0 + n + n1 < it.t1) chunk_at(it.t0 + n + n1, row2, n2);
  prefetch_rows(k, row, n, sh.row_stride);
  prefetch_rows(v, row, n, sh.row_stride);
  prefetch_rows(k, row1, n1, sh.row_stride);
  prefetch_rows(v, row1, n1, sh.row_stride);
  const int64_t row_bytes = sh.row_stride * int64_t(sizeof(T));
  for (int64_t t = it.t0; t < it.t1;) {
    ChunkPrefetch pf(reinterpret_cast<const char*>(k + row2 * sh.row_stride),
                     reinterpret_cast<const char*>(v + row2 * sh.row_stride), n2 * row_bytes,
                     KVH * n * (1 + D / TILE));
    for (int64_t h = 0; h < KVH; ++h) {
      const float* q = it.q + h * G * D;
      float* sc = scores + h * G * kChunk;
      for (int64_t r = 0; r < n; ++r) {
        pf.step();
        group_scores<T, G>(q, k + (row + r) * sh.row_stride + h * D, D, sc + r, kChunk);
      }
    }
    for (int64_t hq = 0; hq < H; ++hq) {
      float* sr = scores + hq * kChunk;
      float mx = it.m[hq];
      for (int64_t r = 0; r < n; ++r) mx = std::max(mx, sr[r]);
      alpha[hq] = mx == it.m[hq] ? 1.f : std::exp(it.m[hq] - mx);  // 0 on the first chunk (m = -inf)
      it.m[hq] = mx;
      it.l[hq] = it.l[hq] * alpha[hq] + exp_sub_rows(sr, n, mx);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const float* p = scores + h * G * kChunk;
      for (int64_t c0 = 0; c0 < D; c0 += TILE) {
        __m256 a[G][J];
        for (int g = 0; g < G; ++g) {
          float* ag = it.acc + (h * G + g) * D + c0;
          const __m256 sg = _mm256_set1_ps(alpha[h * G + g]);
          for (int j = 0; j < J; ++j) a[g][j] = _mm256_mul_ps(_mm256_loadu_ps(ag + 8 * j), sg);
        }
        for (int64_t r = 0; r < n; ++r) {
          pf.step();
          const T* vr = v + (row + r) * sh.row_stride + h * D + c0;
          for (int j = 0; j < J; ++j) {
            const __m256 vv = load8(vr + 8 * j);
            for (int g = 0; g < G; ++g)
              a[g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * kChunk + r), vv, a[g][j]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < J; ++j) _mm256_storeu_ps(it.acc + (h * G + g) * D + c0 + 8 * j, a[g][j]);
      }
    }
    pf.finish();
    t += n;
    row = row1, n = n1, row1 = row2, n1 = n2, n2 = 0;
    const int64_t t2 = t + n + n1;
    if (n1 && t2 < it.t1) chunk_at(t2, row2, n2);
  }
}
#endif

template <typename T>
using ItemFn = void (*)(const Item&, const T*, const T*, const Shape&, float*);
using ItemFn_bf16_t = ItemFn<at::BFloat16>;

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

// The register-blocked variant for this group size and head dim, else the generic loops.
// G * TILE / 8 accumulators stay within 12 of the 16 ymm registers.
template <typename T>
ItemFn<T> pick_item_fn(int64_t group, int64_t D) {
#if GPUSERV_ATTN_DP
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (const auto fn = pick_dp(group, D)) return fn;
  }
#endif
#if GPUSERV_AVX2
  if (D % 16 == 0) {
    const bool t32 = D % 32 == 0;
    switch (group) {
      case 1: return t32 ? attend_item_fixed<T, 1, 32> : attend_item_fixed<T, 1, 16>;
      case 2: return t32 ? attend_item_fixed<T, 2, 32> : attend_item_fixed<T, 2, 16>;
      case 3: return t32 ? attend_item_fixed<T, 3, 32> : attend_item_fixed<T, 3, 16>;
      case 4: return attend_item_fixed<T, 4, 16>;
      case 5: return attend_item_fixed<T, 5, 16>;
      case 6: return attend_item_fixed<T, 6, 16>;
      case 7: return attend_item_fixed<T, 7, 8>;
      case 8: return attend_item_fixed<T, 8, 8>;
      default: break;
    }
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
  at::parallel_for(0, nthreads, 1, [&](int64_t th0, int64_t th1) {
    std::vector<float> scores(H * (std::max(part_len, kChunk) + 1));
    for (int64_t it = split[th0]; it < split[th1]; ++it) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), it) - first_item.begin() - 1;
      const int64_t t0 = (it - first_item[b]) * part_len, t1 = std::min<int64_t>(lp[b], t0 + part_len);
      const Item item{need_qs ? &qs[b * H * D] : nullptr, tp + b * table_stride, t0, t1, &part_m[it * H], &part_l[it * H], &part_acc[it * H * D],
                      qp + b * qs0, qs1, static_cast<float>(scale)};
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
