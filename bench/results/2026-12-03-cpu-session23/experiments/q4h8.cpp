#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <chrono>
#include <vector>
#include <random>
constexpr int kG = 32, kGB = 64 + 32 * 8;
template <int V>
struct Q4 {
  const __m256i spread = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i low = _mm256_set1_epi32(0x0F);
  inline __attribute__((always_inline)) void w(const uint8_t* blk, int kk, const float (*p)[8], __m256& w0, __m256& w1) const {
    const uint8_t* s = blk + 64 + 8 * kk;
    __m256i b;
    if constexpr (V == 0) {
      int64_t bits; std::memcpy(&bits, s, 8);
      b = _mm256_shuffle_epi8(_mm256_set1_epi64x(bits), spread);
    } else {
      b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s));
    }
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), _mm256_load_ps(p[0]), _mm256_load_ps(p[2]));
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_load_ps(p[1]), _mm256_load_ps(p[3]));
  }
};
template <int V, int MR, int NP>
__attribute__((noinline)) void narrow(const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, float* y) {
  __m256 a0[MR][NP], a1[MR][NP];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) a0[m][j] = a1[m][j] = _mm256_setzero_ps();
  const Q4<V> fmt;
  alignas(32) float p[NP][4][8];
  for (int64_t g = 0; g < K / kG; ++g) {
    for (int j = 0; j < NP; ++j) for (int h = 0; h < 4; ++h) _mm256_store_ps(p[j][h], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(panels[j] + g * kGB + 16 * h))));
    for (int64_t kk = 0; kk < kG; ++kk) {
      const int64_t k = g * kG + kk;
      __m256 xb[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        __m256 w0, w1;
        fmt.w(panels[j] + g * kGB, kk, p[j], w0, w1);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          a0[m][j] = _mm256_fmadd_ps(w0, xb[m], a0[m][j]);
          a1[m][j] = _mm256_fmadd_ps(w1, xb[m], a1[m][j]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) { _mm256_storeu_ps(y + m * 64 + 16 * j, a0[m][j]); _mm256_storeu_ps(y + m * 64 + 16 * j + 8, a1[m][j]); }
}
template <int V, int MR, int NP>
double bench(const std::vector<uint8_t>& W, int P, int K, const float* x) {
  const int64_t pb = K / kG * kGB;
  float y[8 * 64];
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p + NP <= P; p += NP) {
      const uint8_t* ps[NP];
      for (int j = 0; j < NP; ++j) ps[j] = W.data() + (p + j) * pb;
      narrow<V, MR, NP>(x, K, ps, K, y);
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
  }
  return 2.0 * MR * P * 16 * K / best / 1e9;
}

template <int HALF>
__attribute__((noinline)) void rows8(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, float* y) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int m = 0; m < 8; ++m) a[m] = _mm256_setzero_ps();
  const __m256i spread = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < K / kG; ++g) {
    const uint8_t* blk = panel + g * kGB;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * HALF)));
    const __m256 mm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * HALF)));
    for (int64_t kk = 0; kk < kG; ++kk) {
      const int64_t k = g * kG + kk;
      int64_t bits; std::memcpy(&bits, blk + 64 + 8 * kk, 8);
      const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi64x(bits), spread);
      const __m256i c = HALF ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, low);
      const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), d, mm);
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) a[m] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * ldx + k), a[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < 8; ++m) _mm256_storeu_ps(y + m * 64 + 8 * HALF, a[m]);
}
double bench8(const std::vector<uint8_t>& W, int P, int K, const float* x) {
  const int64_t pb = K / kG * kGB;
  float y[8 * 64];
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p < P; ++p) { rows8<0>(x, K, W.data() + p * pb, K, y); rows8<1>(x, K, W.data() + p * pb, K, y); }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
  }
  return 2.0 * 8 * P * 16 * K / best / 1e9;
}
template <int V, int MR>
double bench_passes(const std::vector<uint8_t>& W, int P, int K, const float* x) {  // 8 rows in passes of MR
  const int64_t pb = K / kG * kGB;
  float y[8 * 64];
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p < P; ++p) {
      const uint8_t* ps[1] = {W.data() + p * pb};
      for (int m0 = 0; m0 < 8; m0 += MR) narrow<V, MR, 1>(x + m0 * K, K, ps, K, y);
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
  }
  return 2.0 * 8 * P * 16 * K / best / 1e9;
}
int main() {
  const int P = 64, K = 576;
  std::vector<uint8_t> W(P * (K / kG) * kGB);
  std::mt19937 r(1);
  for (auto& b : W) b = r();
  for (int p = 0; p < P * (K / kG); ++p) for (int j = 0; j < 32; ++j) { uint16_t h = 0x2000 + (r() & 0xFF); memcpy(&W[p * kGB + 2 * j], &h, 2); }
  std::vector<float> x(8 * K);
  for (auto& v : x) v = (r() % 1000) / 1000.f;
#define RUN(MR, NP) printf("MR=%d NP=%d: v0 %.0f v1 %.0f GFLOP/s\n", MR, NP, bench<0, MR, NP>(W, P, K, x.data()), bench<1, MR, NP>(W, P, K, x.data()));
  RUN(4, 1)
  for (int r = 0; r < 3; ++r) printf("8 rows: half-panel x8 %.0f, passes 4+4 %.0f GFLOP/s\n", bench8(W, P, K, x.data()), bench_passes<0, 4>(W, P, K, x.data()));
}
