// The fp32 item of paged decode attention (AVX2): one pass over the item's context, kStep tokens a step
// (online softmax). Each step first copies its K and V rows into a per-thread buffer in one sequential
// pass, K and V lines in turn, and then computes from the buffer.
//
// Why the copy: with the cache out of L3, the time of this kernel was set by the order of its reads, not
// by its arithmetic. Reading a step's rows head slice by head slice (each score loop and each V tile
// strides over the rows) ran at about the speed of the kernel itself even with no arithmetic at all, while
// the same bytes read as two sequential streams (a block's K and V rows in step) took ~0.55x as long:
// the hardware prefetchers follow those. Software prefetch of every line ahead (the previous design)
// did not close the gap and slowed the sequential pass when added to it. A step's rows are contiguous
// within a block, so the copy is a few straight runs; from the buffer (L1/L2) the arithmetic runs at full
// speed. The copy itself also prefetches the next step's rows into L2, one K and one V line for each line
// it copies (StepLines: at the copy's own pace, never a burst), so that step's copy reads L2 instead of
// waiting on DRAM while nothing else is fetched: on the Zen 4 box with the AVX2 kernels (8 x 480, 30
// layers' caches in turn, 1 thread, CPU time, alternated three times) 546 / 577 / 572 -> 521 / 515 / 492 us
// a layer call; one step ahead as fast as two.
//
// The arithmetic, per context token, is small (G query heads x D dims x 2 dot products a KV head):
// - scores: each K row is loaded once for the G query heads of its KV head, 4 rows at a time; the 4 x G
//   dot products are reduced into 4 scores a head by three hadds and one add (a separate horizontal sum
//   per score was ~6 instructions a score);
// - softmax: a head's scores of a step are a few vectors; max, exp and sum are vector ops, and the running
//   sums are rescaled once a step;
// - V: a TILE-wide slice of each V row is loaded once for the G heads (G x TILE / 8 accumulators).
#pragma once

#include "attention_item.h"
#include <cstring>
#ifndef COPYV
#define COPYV 0
#endif
#ifndef NOCOPY
#define NOCOPY 0
#endif
#ifndef NOSCORES
#define NOSCORES 0
#endif
#ifndef NOV
#define NOV 0
#endif
#ifndef NOSOFT
#define NOSOFT 0
#endif

namespace gpuserv_attn {

constexpr int64_t kStep = 32;  // context tokens per step of the fp32 item (the scores scratch is [H, kStep])

// Floats of per-thread scratch the fp32 item needs besides its scores: the step's K and V rows.
inline int64_t f32_buffer_floats(int64_t row_stride) { return 2 * kStep * row_stride; }

#if GPUSERV_AVX2
constexpr int kHeadBlock = 3;  // query heads a register block: 4 x 3 score and 3 x 4 V accumulators

// S query heads (q [S][D]) against 4 K rows: out[g * stride + r] = q[g] . kr[r]. The 4 x S dot products run
// along the head dim in 8-lane accumulators; hadd(hadd(a0, a1), hadd(a2, a3)) then holds each row's sum in
// lanes r and r + 4.
template <int S>
inline __attribute__((always_inline)) void scores4(const float* q, int64_t D, const float* const* kr, float* out,
                                                   int64_t stride) {
  __m256 a[S][4];
  for (int g = 0; g < S; ++g)
    for (int r = 0; r < 4; ++r) a[g][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 qv[S];
    for (int g = 0; g < S; ++g) qv[g] = _mm256_loadu_ps(q + g * D + c);
    for (int r = 0; r < 4; ++r) {
      const __m256 kv = _mm256_loadu_ps(kr[r] + c);
      for (int g = 0; g < S; ++g) a[g][r] = _mm256_fmadd_ps(qv[g], kv, a[g][r]);
    }
  }
  for (int g = 0; g < S; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    _mm_storeu_ps(out + g * stride, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// scores4 for the G query heads of a KV head, kHeadBlock at a time.
template <int G, int S0 = 0>
inline __attribute__((always_inline)) void scores4_heads(const float* q, int64_t D, const float* const* kr,
                                                         float* out, int64_t stride) {
  if constexpr (S0 < G) {
    constexpr int S = G - S0 < kHeadBlock ? G - S0 : kHeadBlock;
    scores4<S>(q + S0 * D, D, kr, out + S0 * stride, stride);
    scores4_heads<G, S0 + S>(q, D, kr, out, stride);
  }
}

// A step's scores [H][kStep] (the first n of each head valid) become exp(score - m), m each head's running
// max after this step; alpha[h] = exp(old m - new m) is what the head's running sums are rescaled by.
// The lanes past n are set to -inf first: their exp (clamped: ~1e-38) is not visible in a sum that holds
// exp(0) = 1, and no V row is weighted by them. Not inlined: inlined into the item, it left the score and
// V loops ~1.3x slower (register allocation of the whole item).
__attribute__((noinline)) inline void step_softmax(float* scores, int64_t H, int64_t n, float* m, float* l,
                                                   float* alpha) {
  const int64_t nv = (n + 7) / 8;
  for (int64_t hq = 0; hq < H; ++hq) {
    float* s = scores + hq * kStep;
    for (int64_t r = n; r < nv * 8; ++r) s[r] = -std::numeric_limits<float>::infinity();
    __m256 mv = _mm256_loadu_ps(s);
    for (int64_t i = 1; i < nv; ++i) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + 8 * i));
    const float mx = std::max(m[hq], hmax(mv));
    alpha[hq] = mx == m[hq] ? 1.f : std::exp(m[hq] - mx);  // 0 on the first step (m = -inf)
    m[hq] = mx;
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * i), vm));
      _mm256_storeu_ps(s + 8 * i, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[hq] = l[hq] * alpha[hq] + hsum(sum);
  }
}

// S query heads' weighted V over a step, one TILE-wide slice: acc[g] = acc[g] * alpha[g] + sum_r p[g][r] * v[r]
// (vh: the slice in the step's first buffered V row; rows rs floats apart).
template <int S, int TILE>
inline __attribute__((always_inline)) void weighted_v(const float* p, const float* alpha, const float* vh, int64_t n,
                                                      int64_t rs, float* acc, int64_t D) {
  constexpr int J = TILE / 8;
  __m256 a[S][J];
  for (int g = 0; g < S; ++g) {
    const __m256 sg = _mm256_set1_ps(alpha[g]);
    for (int j = 0; j < J; ++j) a[g][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * j), sg);
  }
  for (int64_t r = 0; r < n; ++r) {
    const float* vr = vh + r * rs;
    for (int j = 0; j < J; ++j) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * j);
      for (int g = 0; g < S; ++g) a[g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * kStep + r), vv, a[g][j]);
    }
  }
  for (int g = 0; g < S; ++g)
    for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc + g * D + 8 * j, a[g][j]);
}

// weighted_v for the G query heads of a KV head, kHeadBlock at a time.
template <int G, int TILE, int S0 = 0>
inline __attribute__((always_inline)) void weighted_v_heads(const float* p, const float* alpha, const float* vh,
                                                            int64_t n, int64_t rs, float* acc, int64_t D) {
  if constexpr (S0 < G) {
    constexpr int S = G - S0 < kHeadBlock ? G - S0 : kHeadBlock;
    weighted_v<S, TILE>(p + S0 * kStep, alpha + S0, vh, n, rs, acc + S0 * D, D);
    weighted_v_heads<G, TILE, S0 + S>(p, alpha, vh, n, rs, acc, D);
  }
}

// The K and V lines of a step's rows, handed out one pair at a time in the order copy_step_rows reads them.
struct StepLines {
  static constexpr int kMaxRuns = 8;
  const char* k[kMaxRuns];
  const char* v[kMaxRuns];
  int64_t bytes[kMaxRuns];
  int runs = 0, r = 0;
  int64_t off = 0;
  StepLines(const int32_t* table, const float* kc, const float* vc, const Shape& sh, int64_t t0, int64_t t1) {
    if (!table || t0 >= t1) return;
    for_each_run(table, sh.block_size, t0, t1, [&](int64_t row, int64_t count) {
      if (runs == kMaxRuns) return;
      k[runs] = reinterpret_cast<const char*>(kc + row * sh.row_stride);
      v[runs] = reinterpret_cast<const char*>(vc + row * sh.row_stride);
      bytes[runs++] = count * sh.row_stride * int64_t(sizeof(float));
    });
  }
  // Prefetches the next K line and V line into L2 (nothing once all are out).
  inline void next() {
    if (r == runs) return;
    _mm_prefetch(k[r] + off, _MM_HINT_T1);
    _mm_prefetch(v[r] + off, _MM_HINT_T1);
    if ((off += 64) >= bytes[r]) off = 0, ++r;
  }
};

// Copies the K and V rows of context tokens [t0, t1) to bk, bv (rows rs floats apart), a block's run of
// rows at a time, K and V 8 floats in turn: two sequential streams. ahead: the next step's lines,
// prefetched one K and one V line for each line copied.
inline void copy_step_rows(const Item& it, const float* k, const float* v, const Shape& sh, int64_t t0, int64_t t1,
                           float* bk, float* bv, StepLines& ahead) {
  const int64_t rs = sh.row_stride;
  for_each_run(it.table, sh.block_size, t0, t1, [&](int64_t row, int64_t count) {
    const float* kr = k + row * rs;
    const float* vr = v + row * rs;
    const int64_t n = count * rs;  // a multiple of 8 (D % 8 == 0)
#if COPYV == 0
    for (int64_t c = 0; c < n; c += 8) {
      if (c % 16 == 0) ahead.next();
      _mm256_storeu_ps(bk + c, _mm256_loadu_ps(kr + c));
      _mm256_storeu_ps(bv + c, _mm256_loadu_ps(vr + c));
    }
#elif COPYV == 1
    for (int64_t c = 0; c < n; c += 8) {
      _mm256_storeu_ps(bk + c, _mm256_loadu_ps(kr + c));
      _mm256_storeu_ps(bv + c, _mm256_loadu_ps(vr + c));
    }
#elif COPYV == 2
    std::memcpy(bk, kr, n * sizeof(float));
    std::memcpy(bv, vr, n * sizeof(float));
#else
    for (int64_t c = 0; c < n; c += 16) {
      ahead.next();
      const __m256 k0 = _mm256_loadu_ps(kr + c), k1 = _mm256_loadu_ps(kr + c + 8);
      const __m256 v0 = _mm256_loadu_ps(vr + c), v1 = _mm256_loadu_ps(vr + c + 8);
      _mm256_storeu_ps(bk + c, k0); _mm256_storeu_ps(bk + c + 8, k1);
      _mm256_storeu_ps(bv + c, v0); _mm256_storeu_ps(bv + c + 8, v1);
    }
#endif
    bk += n;
    bv += n;
  });
}

// The item: G query heads a KV head and V slices of TILE floats fixed at compile time (D % TILE == 0,
// D % 8 == 0). scratch: [H, kStep + 1] scores, then f32_buffer_floats(row_stride) for the step's rows.
template <int G, int TILE>
void attend_item_f32(const Item& it, const float* k, const float* v, const Shape& sh, float* scratch) {
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, rs = sh.row_stride;
  float* scores = scratch;
  float* alpha = scores + H * kStep;
  float* bk = scratch + H * (kStep + 1);
  float* bv = bk + kStep * rs;
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  for (int64_t t = it.t0; t < it.t1; t += kStep) {
    const int64_t n = std::min(kStep, it.t1 - t);
    // The next step's rows, or past the item's last step the next item's first ones: at short contexts
    // (a burst's 48 sequences at 64 tokens: two steps an item) every other step began cold otherwise.
    StepLines ahead = t + kStep < it.t1
        ? StepLines(it.table, k, v, sh, t + kStep, std::min(it.t1, t + 2 * kStep))
        : StepLines(it.next_table, k, v, sh, it.next_t0, std::min(it.next_t1, it.next_t0 + kStep));
    if (!NOCOPY) copy_step_rows(it, k, v, sh, t, t + n, bk, bv, ahead);
    else { bk = const_cast<float*>(k) + (int64_t(it.table[t / sh.block_size]) * sh.block_size + t % sh.block_size) * rs; bv = const_cast<float*>(v) + (bk - k); }
    if (!NOSCORES) for (int64_t h = 0; h < KVH; ++h) {
      float* sc = scores + h * G * kStep;
      for (int64_t r0 = 0; r0 < n; r0 += 4) {
        const float* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = bk + std::min<int64_t>(r0 + r, n - 1) * rs + h * D;  // past n: unused
        scores4_heads<G>(it.q + h * G * D, D, kr, sc + r0, kStep);
      }
    }
    if (!NOSOFT) step_softmax(scores, H, n, it.m, it.l, alpha);
    if (!NOV) for (int64_t h = 0; h < KVH; ++h)
      for (int64_t c0 = 0; c0 < D; c0 += TILE)
        weighted_v_heads<G, TILE>(scores + h * G * kStep, alpha + h * G, bv + h * D + c0, n, rs,
                                  it.acc + h * G * D + c0, D);
  }
}
#endif

}  // namespace gpuserv_attn
