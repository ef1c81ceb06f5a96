// AVX2 helpers shared by the kernels: widening loads of fp32 / bf16 / fp16, bf16 stores and a vector exp.
// GPUSERV_AVX2 is 0 where the build flags lack AVX2/FMA/F16C; callers then take scalar loops.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GPUSERV_AVX2 1
#else
#define GPUSERV_AVX2 0
#endif

namespace gpuserv_simd {

// Whether the CPU running this library executes AVX512_BF16 instructions (asked once). A library
// built with -mavx512bf16 elsewhere must still check before taking a vdpbf16ps path.
inline bool cpu_avx512bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
}

#if GPUSERV_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp32 -> bf16, 8 lanes, as c10::BFloat16(float) rounds: to nearest even, NaN -> 0x7FC0.
inline __m128i to_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_8(v)); }
// v rounded to bf16 and widened back (the value a bf16 store then load would give).
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_8(v)), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
// exp(x) (Cephes-style: 2^n * polynomial), relative error ~1e-7; x is clamped to [-87.3, 88.3].
// The polynomial's coefficients, highest power first (exp8 and exp16 share them).
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// 16-lane forms where the build has AVX512F/BW/BF16 (callers check cpu_avx512bf16() at run time too).
#if GPUSERV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define GPUSERV_AVX512BF16 1
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// fp32 -> bf16 to nearest even in one instruction (vcvtneps2bf16; it reads denormal inputs as zero,
// which the bf16 products of a layer never are).
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round_bf16_16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
// A 16-lane vector's two halves added, as 8 lanes (extractf32x8 would need AVX512DQ).
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// exp8's polynomial on 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  const __m512 x2 = _mm512_mul_ps(x, x);
  y = _mm512_fmadd_ps(y, x2, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
#else
#define GPUSERV_AVX512BF16 0
#endif

}  // namespace gpuserv_simd
