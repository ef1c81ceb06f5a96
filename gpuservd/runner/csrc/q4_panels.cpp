// 4-bit column panels of an fp32 weight that is exactly a 4-bit grid (runner/q4_panels.py has the why
// and the layout; packed_gemm_f32.cpp runs them): find each group's grid and check it value by value.
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

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = 64 + kGroup * 8;

inline uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Codes of the 32 values v on the grid (d, m), if it reproduces every one of them bit for bit.
inline bool fits(const float* v, float d, float m, uint8_t* q) {
  for (int i = 0; i < kGroup; ++i) {
    const float c = d == 0.f ? 0.f : std::min(15.f, std::max(0.f, std::nearbyint((v[i] - m) / d)));
    if (bits(std::fma(c, d, m)) != bits(v[i])) return false;
    q[i] = static_cast<uint8_t>(c);
  }
  return true;
}

// The group's grid: its scale's and offset's fp16 bits and its codes; false when there is none.
bool group_grid(const float* v, uint16_t& d16, uint16_t& m16, uint8_t* q) {
  const auto [lo_it, hi_it] = std::minmax_element(v, v + kGroup);
  const float lo = *lo_it, span = *hi_it - lo;
  const c10::Half m(lo);
  if (bits(static_cast<float>(m)) != bits(lo)) return false;
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
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "pack_panels_q4: an fp32 CPU matrix only");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  if (K % kGroup || N == 0) return at::empty({0}, wc.options().dtype(at::kByte));
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / kGroup;
  at::Tensor out = at::empty({P, G, kGroupBytes}, wc.options().dtype(at::kByte));
  const float* src = wc.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t q[kGroup];
    for (int64_t p = p0; p < p1 && exact.load(std::memory_order_relaxed); ++p)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* blk = dst + (p * G + g) * kGroupBytes;
        std::memset(blk, 0, kGroupBytes);  // padded columns: 0 * 0 + 0
        auto* d16 = reinterpret_cast<uint16_t*>(blk);
        auto* m16 = reinterpret_cast<uint16_t*>(blk + 32);
        for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
          if (!group_grid(src + (p * kPanel + j) * K + g * kGroup, d16[j], m16[j], q)) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
          for (int64_t kk = 0; kk < kGroup; ++kk)
            blk[64 + 8 * kk + j % 8] |= static_cast<uint8_t>(j < 8 ? q[kk] : q[kk] << 4);
        }
      }
  });
  return exact.load() ? out : at::empty({0}, wc.options().dtype(at::kByte));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) { m.def("pack_panels_q4(Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("pack_panels_q4", &pack_panels_q4); }
