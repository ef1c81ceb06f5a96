// The work item of paged decode attention (paged_attention.cpp) and the item kinds every dtype shares:
// the generic loops (any group size and head dim) and the two-pass register-blocked item of bf16 / fp16.
// fp32 has its own one-pass item (attention_f32.h); bf16 on AVX512_BF16 a dot-product one (attention_dp.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace gpuserv_attn {

#if GPUSERV_AVX2
using namespace gpuserv_simd;
#endif

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

struct Prefetcher;

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
  Prefetcher* pf = nullptr;  // the thread's prefetch stream (item kinds that use one)
  // The next item of the same thread (its table and tokens; table nullptr: none): the fp32 item fetches
  // its first rows while it copies its own last ones.
  const int32_t* next_table = nullptr;
  int64_t next_t0 = 0, next_t1 = 0;
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
// The K and V bytes a thread's items read, in the order an item consumes them (each item's K runs, then its
// V runs), prefetched into L2 a fixed number of bytes ahead of what has been consumed, across item edges.
// Why: the blocks of a context lie anywhere in the pool, so the hardware prefetchers see short runs
// (6 KB at SmolLM2's shape in bf16) and an item that started cold waited on DRAM for its first rows; a
// pure read of the same bytes in the same order ran ~2x faster with the next 32 KB prefetched into L2
// (prefetcht1) than without, and prefetcht0 (L1) was no faster than none (it is limited by the L1's few
// miss buffers). The stream does not stop at an item's end, so the next item's first rows are on the
// way while this one sums its V.
struct Prefetcher {
  struct Span {
    const int32_t* table;
    int64_t t0, t1;
  };
  static constexpr int64_t kAheadBytes = 32 << 10;
  const Span* spans = nullptr;
  int64_t nspans = 0;
  const char *k = nullptr, *v = nullptr;
  int64_t row_bytes = 0, block_size = 0;
  // Position of the next prefetch: span, phase (0 K, 1 V), the next run's first token, the current run.
  int64_t si = 0, t = 0;
  int phase = 0;
  const char *at = nullptr, *end = nullptr;
  int64_t issued = 0, consumed = 0;

  void start() {
    si = 0;
    phase = 0;
    t = nspans ? spans[0].t0 : 0;
    at = end = nullptr;
    pump();
  }
  // The next run of the stream into [at, end); false at its end.
  bool next_run() {
    while (si < nspans) {
      const Span& s = spans[si];
      if (t < s.t1) {
        const int64_t off = t % block_size;
        const int64_t count = std::min(block_size - off, s.t1 - t);
        at = (phase ? v : k) + (static_cast<int64_t>(s.table[t / block_size]) * block_size + off) * row_bytes;
        end = at + count * row_bytes;
        t += count;
        return true;
      }
      if (phase == 0) {
        phase = 1;
      } else {
        phase = 0;
        if (++si < nspans) t = spans[si].t0;
        continue;
      }
      t = s.t0;
    }
    return false;
  }
  void pump() {
    const int64_t want = consumed + kAheadBytes;
    while (issued < want) {
      if (at >= end && !next_run()) {
        issued = std::numeric_limits<int64_t>::max() / 2;
        return;
      }
      const int64_t n = std::min<int64_t>(end - at, want - issued);
      for (int64_t off = 0; off < n; off += 64) _mm_prefetch(at + off, _MM_HINT_T1);
      at += n;
      issued += n;
    }
  }
  // The item has read `bytes` more of the stream.
  void consume(int64_t bytes) {
    consumed += bytes;
    pump();
  }
};

// Prefetches `count` consecutive cache rows (a run within one block: contiguous bytes) into L2.
template <typename T>
inline void prefetch_rows(const T* base, int64_t row, int64_t count, int64_t row_stride) {
  const char* p = reinterpret_cast<const char*>(base + row * row_stride);
  const int64_t bytes = count * row_stride * int64_t(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// The G query heads of one KV head (q [G][D]) against one K row: out[g * stride] = q[g] . kr
// (two 8-lane accumulators per head, summed once at the end).
template <typename T, int G>
inline __attribute__((always_inline)) void group_scores(const float* q, const T* kr, int64_t D, float* out,
                                                        int64_t stride) {
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

// bf16 / fp16 items: all of the item's scores first, then V swept once per head and tile, with the group
// size G and a V tile of TILE floats fixed at compile time so that the G dot products of a K row and the
// G x TILE output accumulators live in registers (with a runtime G they went through the stack, and every
// FMA waited on a store: 3-4x slower). Needs D % 16 == 0 and D % TILE == 0. (fp32's one-pass item rounds
// differently where a head's running sums are rescaled; in bf16 that moved SmolLM2's logits off
// transformers' by more than test_bf16_kernels allows, so these keep the two-pass order their outputs were
// checked in.)
template <typename T, int G, int TILE>
void attend_item_two_pass(const Item& it, const T* k, const T* v, const Shape& sh, float* scores) {
  const int64_t n = it.t1 - it.t0, D = sh.D, KVH = sh.kv_heads;
  // While a run's K is scored, the next run's K and this run's V are prefetched into L2.
  // The runs' blocks lie anywhere in the pool and each head reads only its 64-128 bytes of a token's
  // row, which the hardware prefetchers did not follow: with the cache out of L3 a 32-sequence batch
  // at context 80 took 4x as long as with it in cache.
  int64_t i0 = 0;
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count) {
    if (i0 == 0) prefetch_rows(k, row, count, sh.row_stride);
    const int64_t t_next = it.t0 + i0 + count;
    if (t_next < it.t1) {
      const int64_t off = t_next % sh.block_size;
      prefetch_rows(k, static_cast<int64_t>(it.table[t_next / sh.block_size]) * sh.block_size + off,
                    std::min(sh.block_size - off, it.t1 - t_next), sh.row_stride);
    }
    prefetch_rows(v, row, count, sh.row_stride);
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
#endif

}  // namespace gpuserv_attn
