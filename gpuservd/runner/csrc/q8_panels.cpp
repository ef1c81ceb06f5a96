// 8-bit column panels of an fp32 weight that is exactly an 8-bit grid (runner/q8_panels.py has the why
// and the layout): find each group's scale and check every value; the matmul on them is code_panels.h's
// with this file's format.
//
// A group is 32 input positions of one row. GGUF's Q8_0 stores an fp16 scale d and codes q in -127..127
// (d = the group's greatest magnitude / 127, rounded to fp16) and dequantises to q * d in fp32, which is
// exact (8 + 11 significant bits): multiplying the code by the scale gives every value back bit for bit.
// The scale tried first is the greatest magnitude / 127 rounded to fp16, then one and two fp16 steps
// either side. A group that no scale reproduces bit for bit means the weight is not such a grid: the
// result is then an empty tensor and the caller keeps other panels.
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
using gpuserv_panels::kQ8GroupBytes;
using gpuserv_panels::kQGroup;
using gpuserv_panels::float_bits;

// The group's scale (fp16 bits) and codes, if one reproduces all 32 values v bit for bit.
bool group_scale(const float* v, uint16_t& d16, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < kQGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!std::isfinite(amax)) return false;
  if (amax == 0.f) {  // zeros dequantise to +0 (d = 0)
    for (int i = 0; i < kQGroup; ++i)
      if (float_bits(v[i]) != 0) return false;
    d16 = 0;
    std::memset(q, 0, kQGroup);
    return true;
  }
  const uint16_t base = c10::Half(amax / 127.f).x;
  for (int step : {0, 1, -1, 2, -2}) {
    const uint16_t cand = static_cast<uint16_t>(base + step);
    const float d = static_cast<float>(c10::Half(cand, c10::Half::from_bits()));
    if (!std::isfinite(d) || !(d > 0.f) || (cand & 0x8000)) continue;
    bool ok = true;
    for (int i = 0; i < kQGroup && ok; ++i) {
      const float c = std::nearbyint(v[i] / d);
      ok = c >= -128.f && c <= 127.f && float_bits(c * d) == float_bits(v[i]);
      q[i] = static_cast<int8_t>(c);
    }
    if (ok) {
      d16 = cand;
      return true;
    }
  }
  return false;
}

// W [N, K] fp32 -> [ceil(N/16), K/32, 544] uint8, or an empty tensor when W is not exactly an 8-bit grid.
at::Tensor pack_panels_q8(const at::Tensor& w) {
  return gpuserv_panels::pack_codes(w, kQ8GroupBytes, "pack_panels_q8", [](const float* v, uint8_t* blk, int64_t j) {
    int8_t q[kQGroup];
    if (!group_scale(v, reinterpret_cast<uint16_t*>(blk)[j], q)) return false;
    for (int64_t kk = 0; kk < kQGroup; ++kk) blk[32 + kPanel * kk + j] = static_cast<uint8_t>(q[kk]);
    return true;
  });
}

}  // namespace

// The 8-bit format of code_panels.h: per group, 16 fp16 scales, then 32 k steps of 16 signed bytes.
namespace gpuserv_panels {
namespace {

struct Q8 {
  static constexpr int64_t kGroupBytes = kQ8GroupBytes;
  static constexpr int kParams = 2;  // scales of columns 0-7, 8-15
  // Level with the buffered 6-row tiles or faster up to 8 rows (2 threads, SmolLM2's LM head: 1.2-1.4x at 8,
  // 1.35-2.1x at 1-4), where the buffered tiles of the head also ran slower than fp32 panels four times
  // its size.
  static constexpr int64_t kNarrowRowsMax = 8;
#if GPUSERV_AVX2
  // Each half of a step's 16 codes sign-extended to 8 lanes straight from memory, converted, and multiplied
  // by its scale (exact, as the dequantisation's own product). One 16-byte load and a byte shift for the
  // high half instead ran 1.3-1.5x slower at 1-4 rows (a standalone loop over 64 panels in L2, 1 thread):
  // the extensions from a register compete with the conversions for the same pipes.
  static inline __attribute__((always_inline)) void weights(const uint8_t* blk, int64_t kk, const float (*p)[8],
                                                            __m256& w0, __m256& w1) {
    const uint8_t* step = blk + 32 + kPanel * kk;
    const auto codes8 = [](const uint8_t* at) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
    };
    w0 = _mm256_mul_ps(codes8(step), _mm256_load_ps(p[0]));
    w1 = _mm256_mul_ps(codes8(step + 8), _mm256_load_ps(p[1]));
  }
#endif
  static float value(const uint8_t* blk, int64_t kk, int j) {
    const float d = static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(blk)[j], c10::Half::from_bits()));
    return static_cast<float>(static_cast<int8_t>(blk[32 + kPanel * kk + j])) * d;
  }
};

}  // namespace

void run_q8(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max,
            bool narrow) {
  run_codes<Q8>(x, packed, N, bias, y, mr_max, narrow);
}

}  // namespace gpuserv_panels

TORCH_LIBRARY_FRAGMENT(gpuserv, m) { m.def("pack_panels_q8(Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("pack_panels_q8", &pack_panels_q8); }
