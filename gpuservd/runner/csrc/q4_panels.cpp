// 4-bit column panels of an fp32 weight that is exactly a 4-bit grid (runner/q4_panels.py has the why
// and the layout): find each group's grid and check it value by value; the matmul on them is
// code_panels.h's with this file's format.
//
// A group is 32 input positions of one row. GGUF's Q4_1 stores an fp16 scale d and offset m and codes
// q in 0..15, and dequantises to d * q + m in fp32: q * d is exact in fp32 (11 + 4 significant bits), so
// every value is one rounding of q * d + m, which fmaf gives back. The offset is the group's least value
// (its code is 0). The scale is (greatest - least) / 15 rounded to fp16 (the greatest value's code is
// 15); where that misses, one or two fp16 steps either side, then the greatest code 14, 13, ... A group
// that no grid reproduces bit for bit, or an offset that is not an fp16 value, means the weight is not
// such a grid: the result is then an empty tensor and the caller keeps fp32 panels. Looping here costs
// ~20 ns a group (SmolLM2's 120 projections: ~0.1 s); the same in tensor ops took ~100 ns a value.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "code_panels.h"

namespace {

using gpuserv_panels::kPanel;
using gpuserv_panels::kQGroup;
using gpuserv_panels::kQGroupBytes;
using gpuserv_panels::float_bits;

// Codes of the 32 values v on the grid (d, m), if it reproduces every one of them bit for bit.
inline bool fits(const float* v, float d, float m, uint8_t* q) {
  for (int i = 0; i < kQGroup; ++i) {
    const float c = d == 0.f ? 0.f : std::min(15.f, std::max(0.f, std::nearbyint((v[i] - m) / d)));
    if (float_bits(std::fma(c, d, m)) != float_bits(v[i])) return false;
    q[i] = static_cast<uint8_t>(c);
  }
  return true;
}

// The group's grid: its scale's and offset's fp16 bits and its codes; false when there is none.
bool group_grid(const float* v, uint16_t& d16, uint16_t& m16, uint8_t* q) {
  const auto [lo_it, hi_it] = std::minmax_element(v, v + kQGroup);
  const float lo = *lo_it, span = *hi_it - lo;
  const c10::Half m(lo);
  if (float_bits(static_cast<float>(m)) != float_bits(lo)) return false;
  m16 = m.x;
  for (int top = 15; top >= 1; --top) {
    const uint16_t base = c10::Half(span / static_cast<float>(top)).x;
    for (int step : {0, 1, -1, 2, -2}) {
      const uint16_t cand = static_cast<uint16_t>(base + step);
      const float d = static_cast<float>(c10::Half(cand, c10::Half::from_bits()));
      if (!std::isfinite(d) || d < 0.f || (step && (cand & 0x8000) != (base & 0x8000))) continue;
      if (fits(v, d, lo, q)) {
        d16 = cand;
        return true;
      }
    }
  }
  return false;
}

// W [N, K] fp32 -> [ceil(N/16), K/32, 320] uint8, or an empty tensor when W is not exactly a 4-bit grid.
at::Tensor pack_panels_q4(const at::Tensor& w) {
  return gpuserv_panels::pack_codes(w, kQGroupBytes, "pack_panels_q4", [](const float* v, uint8_t* blk, int64_t j) {
    uint8_t q[kQGroup];
    if (!group_grid(v, reinterpret_cast<uint16_t*>(blk)[j], reinterpret_cast<uint16_t*>(blk + 32)[j], q))
      return false;
    for (int64_t kk = 0; kk < kQGroup; ++kk)
      blk[64 + 8 * kk + j % 8] |= static_cast<uint8_t>(j < 8 ? q[kk] : q[kk] << 4);
    return true;
  });
}

}  // namespace

// The 4-bit format of code_panels.h: per group, 16 fp16 scales, 16 fp16 offsets, then 32 k steps of 8 bytes.
namespace gpuserv_panels {
namespace {

struct Q4 {
  static constexpr int64_t kGroupBytes = kQGroupBytes;
  static constexpr int kParams = 4;  // scales of columns 0-7, 8-15, offsets of 0-7, 8-15
  // At 5-8 rows two passes each expanding the codes again were level with the buffered 6-row tiles or
  // slower (2 threads, SmolLM2's shapes); at 1-4 rows 1.16-1.9x faster.
  static constexpr int64_t kNarrowRowsMax = 4;
#if GPUSERV_AVX2
  // A k step's 16 codes as fp32 (q0: columns 0-7, q1: 8-15). Byte j of a step holds column j (low nibble)
  // and column j + 8 (high nibble). The step's 8 bytes go to every quadword (one broadcast load), one
  // shuffle within each 128-bit half puts byte j alone in 32-bit lane j, and then column j is a mask away
  // and column j + 8 a shift: with the two FMAs, 8 instructions a step where unpacking each half with its
  // own zero-extension took 11, and the expansion is most of a narrow step's linear time.
  const __m256i spread = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i low = _mm256_set1_epi32(0x0F);

  inline __attribute__((always_inline)) void weights(const uint8_t* blk, int64_t kk, const float (*p)[8], __m256& w0,
                                                     __m256& w1) const {
    int64_t bits;
    std::memcpy(&bits, blk + 64 + 8 * kk, 8);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi64x(bits), spread);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), _mm256_load_ps(p[0]), _mm256_load_ps(p[2]));
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_load_ps(p[1]), _mm256_load_ps(p[3]));
  }
#endif
  static float value(const uint8_t* blk, int64_t kk, int j) {
    const auto half = [&](int at) {
      return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(blk)[at], c10::Half::from_bits()));
    };
    const uint8_t b = blk[64 + 8 * kk + j % 8];
    return std::fma(static_cast<float>(j < 8 ? b & 15 : b >> 4), half(j), half(16 + j));
  }
};

}  // namespace

void run_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max,
            bool narrow) {
  run_codes<Q4>(x, packed, N, bias, y, mr_max, narrow);
}

}  // namespace gpuserv_panels

TORCH_LIBRARY_FRAGMENT(gpuserv, m) { m.def("pack_panels_q4(Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("pack_panels_q4", &pack_panels_q4); }
