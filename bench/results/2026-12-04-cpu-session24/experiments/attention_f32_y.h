// Variants of the fp32 decode-attention item that read the cache rows in place (session 24 experiment).
#pragma once
#include "attention_f32.h"

namespace gpuserv_attn {

template <int S, int TILE>
inline __attribute__((always_inline)) void weighted_v_rows(const float* p, const float* alpha, const float* const* vrow,
                                                           int64_t off, int64_t n, float* acc, int64_t D) {
  constexpr int J = TILE / 8;
  __m256 a[S][J];
  for (int g = 0; g < S; ++g) {
    const __m256 sg = _mm256_set1_ps(alpha[g]);
    for (int j = 0; j < J; ++j) a[g][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * j), sg);
  }
  for (int64_t r = 0; r < n; ++r) {
    const float* vr = vrow[r] + off;
    for (int j = 0; j < J; ++j) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * j);
      for (int g = 0; g < S; ++g) a[g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * kStep + r), vv, a[g][j]);
    }
  }
  for (int g = 0; g < S; ++g)
    for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc + g * D + 8 * j, a[g][j]);
}

template <int G, int TILE, int S0 = 0>
inline __attribute__((always_inline)) void weighted_v_rows_heads(const float* p, const float* alpha,
                                                                 const float* const* vrow, int64_t off, int64_t n,
                                                                 float* acc, int64_t D) {
  if constexpr (S0 < G) {
    constexpr int S = G - S0 < kHeadBlock ? G - S0 : kHeadBlock;
    weighted_v_rows<S, TILE>(p + S0 * kStep, alpha + S0, vrow, off, n, acc + S0 * D, D);
    weighted_v_rows_heads<G, TILE, S0 + S>(p, alpha, vrow, off, n, acc, D);
  }
}

// PF: 0 no software prefetch; 1 the next step's K and V lines, one pair per line of K the score loop
// reads; 2 the same into L1 (T0).
template <int G, int TILE, int PF>
void attend_item_f32_inplace(const Item& it, const float* k, const float* v, const Shape& sh, float* scratch) {
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, rs = sh.row_stride;
  float* scores = scratch;
  float* alpha = scores + H * kStep;
  const float* krow[kStep];
  const float* vrow[kStep];
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  const int64_t lines_per_row = rs * int64_t(sizeof(float)) / 64;
  for (int64_t t = it.t0; t < it.t1; t += kStep) {
    const int64_t n = std::min(kStep, it.t1 - t);
    StepLines ahead = t + kStep < it.t1
        ? StepLines(it.table, k, v, sh, t + kStep, std::min(it.t1, t + 2 * kStep))
        : StepLines(it.next_table, k, v, sh, it.next_t0, std::min(it.next_t1, it.next_t0 + kStep));
    int64_t i = 0;
    for_each_run(it.table, sh.block_size, t, t + n, [&](int64_t row, int64_t count) {
      for (int64_t r = 0; r < count; ++r, ++i) krow[i] = k + (row + r) * rs, vrow[i] = v + (row + r) * rs;
    });
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      if (PF) for (int64_t x = 0; x < 4 * lines_per_row; ++x) ahead.next();
      for (int64_t h = 0; h < KVH; ++h) {
        const float* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = krow[std::min<int64_t>(r0 + r, n - 1)] + h * D;
        scores4_heads<G>(it.q + h * G * D, D, kr, scores + h * G * kStep + r0, kStep);
      }
    }
    step_softmax(scores, H, n, it.m, it.l, alpha);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t c0 = 0; c0 < D; c0 += TILE)
        weighted_v_rows_heads<G, TILE>(scores + h * G * kStep, alpha + h * G, vrow, h * D + c0, n,
                                       it.acc + h * G * D + c0, D);
  }
}


// K read in place (scores row-major over the step), V copied into the buffer first in one sequential pass
// that also prefetches the next step's K and V lines (MODE 0), or K and V both in place with the next
// step's lines prefetched a few per K row and a few per V row (MODE 1: PK pairs per K row group, PV per
// weighted_v call).
template <int G, int TILE, int MODE, int PK, int PV>
void attend_item_f32_mix(const Item& it, const float* k, const float* v, const Shape& sh, float* scratch) {
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, rs = sh.row_stride;
  float* scores = scratch;
  float* alpha = scores + H * kStep;
  float* bv = scratch + H * (kStep + 1);
  const float* krow[kStep];
  const float* vrow[kStep];
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  for (int64_t t = it.t0; t < it.t1; t += kStep) {
    const int64_t n = std::min(kStep, it.t1 - t);
    StepLines ahead = t + kStep < it.t1
        ? StepLines(it.table, k, v, sh, t + kStep, std::min(it.t1, t + 2 * kStep))
        : StepLines(it.next_table, k, v, sh, it.next_t0, std::min(it.next_t1, it.next_t0 + kStep));
    int64_t i = 0;
    float* b = bv;
    for_each_run(it.table, sh.block_size, t, t + n, [&](int64_t row, int64_t count) {
      for (int64_t r = 0; r < count; ++r, ++i) krow[i] = k + (row + r) * rs, vrow[i] = MODE == 0 ? bv + i * rs : v + (row + r) * rs;
      if (MODE == 0) {
        const float* vr = v + row * rs;
        const int64_t nn = count * rs;
        for (int64_t c = 0; c < nn; c += 8) {
          if (c % 8 == 0) ahead.next();
          _mm256_storeu_ps(b + c, _mm256_loadu_ps(vr + c));
        }
        b += nn;
      }
    });
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      for (int x = 0; x < PK; ++x) ahead.next();
      for (int64_t h = 0; h < KVH; ++h) {
        const float* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = krow[std::min<int64_t>(r0 + r, n - 1)] + h * D;
        scores4_heads<G>(it.q + h * G * D, D, kr, scores + h * G * kStep + r0, kStep);
      }
    }
    step_softmax(scores, H, n, it.m, it.l, alpha);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t c0 = 0; c0 < D; c0 += TILE) {
        for (int x = 0; x < PV; ++x) ahead.next();
        weighted_v_rows_heads<G, TILE>(scores + h * G * kStep, alpha + h * G, vrow, h * D + c0, n,
                                       it.acc + h * G * D + c0, D);
      }
  }
}


// K and V in place. While the scores read K row r, the K row DK tokens ahead (into the next item past
// this one's end) and the V row of r are prefetched (HINT), so the V pass reads lines fetched during the
// scores and the K stream runs ahead at the scores' pace.
template <int G, int TILE, int DK, int HINT>
void attend_item_f32_ahead(const Item& it, const float* k, const float* v, const Shape& sh, float* scratch) {
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, rs = sh.row_stride, BS = sh.block_size;
  float* scores = scratch;
  float* alpha = scores + H * kStep;
  const float* krow[kStep];
  const float* vrow[kStep];
  const int64_t row_bytes = rs * int64_t(sizeof(float));
  auto row_of = [&](int64_t t) -> int64_t {  // flat cache row of token t of this item, or of the next; -1: none
    if (t < it.t1) return int64_t(it.table[t / BS]) * BS + t % BS;
    if (!it.next_table) return -1;
    t = it.next_t0 + (t - it.t1);
    if (t >= it.next_t1) return -1;
    return int64_t(it.next_table[t / BS]) * BS + t % BS;
  };
  auto pf = [&](const float* p) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(c + o, HINT == 0 ? _MM_HINT_T0 : HINT == 1 ? _MM_HINT_T1 : _MM_HINT_NTA);
  };
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  if (it.t0 == 0 || true)  // the first rows of the item (the previous item prefetched them when there was one)
    for (int64_t t = it.t0; t < std::min(it.t1, it.t0 + DK); ++t) { const int64_t r = row_of(t); if (r >= 0) pf(k + r * rs); }
  for (int64_t t = it.t0; t < it.t1; t += kStep) {
    const int64_t n = std::min(kStep, it.t1 - t);
    int64_t i = 0;
    for_each_run(it.table, BS, t, t + n, [&](int64_t row, int64_t count) {
      for (int64_t r = 0; r < count; ++r, ++i) krow[i] = k + (row + r) * rs, vrow[i] = v + (row + r) * rs;
    });
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      for (int64_t r = r0; r < std::min(n, r0 + 4); ++r) {
        const int64_t ra = row_of(t + r + DK);
        if (ra >= 0) pf(k + ra * rs);
        pf(vrow[r]);
      }
      for (int64_t h = 0; h < KVH; ++h) {
        const float* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = krow[std::min<int64_t>(r0 + r, n - 1)] + h * D;
        scores4_heads<G>(it.q + h * G * D, D, kr, scores + h * G * kStep + r0, kStep);
      }
    }
    step_softmax(scores, H, n, it.m, it.l, alpha);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t c0 = 0; c0 < D; c0 += TILE)
        weighted_v_rows_heads<G, TILE>(scores + h * G * kStep, alpha + h * G, vrow, h * D + c0, n,
                                       it.acc + h * G * D + c0, D);
  }
}


// main's item with the next step's prefetches issued during the step's arithmetic instead of during its
// copy: PK pairs (one K, one V line) per score block (4 rows x one KV head), PV per weighted_v call, the
// rest at the step's end.
template <int G, int TILE, int PK, int PV>
void attend_item_f32_overlap(const Item& it, const float* k, const float* v, const Shape& sh, float* scratch) {
  const int64_t D = sh.D, KVH = sh.kv_heads, H = KVH * G, rs = sh.row_stride;
  float* scores = scratch;
  float* alpha = scores + H * kStep;
  float* bk = scratch + H * (kStep + 1);
  float* bv = bk + kStep * rs;
  std::fill(it.m, it.m + H, -std::numeric_limits<float>::infinity());
  std::fill(it.l, it.l + H, 0.f);
  std::fill(it.acc, it.acc + H * D, 0.f);
  StepLines none(nullptr, k, v, sh, 0, 0);
  for (int64_t t = it.t0; t < it.t1; t += kStep) {
    const int64_t n = std::min(kStep, it.t1 - t);
    StepLines ahead = t + kStep < it.t1
        ? StepLines(it.table, k, v, sh, t + kStep, std::min(it.t1, t + 2 * kStep))
        : StepLines(it.next_table, k, v, sh, it.next_t0, std::min(it.next_t1, it.next_t0 + kStep));
    copy_step_rows(it, k, v, sh, t, t + n, bk, bv, none);
    for (int64_t h = 0; h < KVH; ++h) {
      float* sc = scores + h * G * kStep;
      for (int64_t r0 = 0; r0 < n; r0 += 4) {
        for (int x = 0; x < PK; ++x) ahead.next();
        const float* kr[4];
        for (int r = 0; r < 4; ++r) kr[r] = bk + std::min<int64_t>(r0 + r, n - 1) * rs + h * D;
        scores4_heads<G>(it.q + h * G * D, D, kr, sc + r0, kStep);
      }
    }
    step_softmax(scores, H, n, it.m, it.l, alpha);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t c0 = 0; c0 < D; c0 += TILE) {
        for (int x = 0; x < PV; ++x) ahead.next();
        weighted_v_heads<G, TILE>(scores + h * G * kStep, alpha + h * G, bv + h * D + c0, n, rs,
                                  it.acc + h * G * D + c0, D);
      }
    while (ahead.r < ahead.runs) ahead.next();
  }
}

}  // namespace gpuserv_attn
