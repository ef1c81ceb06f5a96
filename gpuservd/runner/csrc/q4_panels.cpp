// 4-bit column panels of an fp32 weight that is exactly a 4-bit grid (runner/q4_panels.py has the why
// and the layout): find each group's grid and check it value by value, and the matmul on them.
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

#include "packed_tiles.h"

namespace {

using gpuserv_panels::kPanel;
using gpuserv_panels::kQGroup;
using gpuserv_panels::kQGroupBytes;

inline uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Codes of the 32 values v on the grid (d, m), if it reproduces every one of them bit for bit.
inline bool fits(const float* v, float d, float m, uint8_t* q) {
  for (int i = 0; i < kQGroup; ++i) {
    const float c = d == 0.f ? 0.f : std::min(15.f, std::max(0.f, std::nearbyint((v[i] - m) / d)));
    if (bits(std::fma(c, d, m)) != bits(v[i])) return false;
    q[i] = static_cast<uint8_t>(c);
  }
  return true;
}

// The group's grid: its scale's and offset's fp16 bits and its codes; false when there is none.
bool group_grid(const float* v, uint16_t& d16, uint16_t& m16, uint8_t* q) {
  const auto [lo_it, hi_it] = std::minmax_element(v, v + kQGroup);
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
  if (K % kQGroup || N == 0) return at::empty({0}, wc.options().dtype(at::kByte));
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / kQGroup;
  at::Tensor out = at::empty({P, G, kQGroupBytes}, wc.options().dtype(at::kByte));
  const float* src = wc.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t q[kQGroup];
    for (int64_t p = p0; p < p1 && exact.load(std::memory_order_relaxed); ++p)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* blk = dst + (p * G + g) * kQGroupBytes;
        std::memset(blk, 0, kQGroupBytes);  // padded columns: 0 * 0 + 0
        auto* d16 = reinterpret_cast<uint16_t*>(blk);
        auto* m16 = reinterpret_cast<uint16_t*>(blk + 32);
        for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
          if (!group_grid(src + (p * kPanel + j) * K + g * kQGroup, d16[j], m16[j], q)) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
          for (int64_t kk = 0; kk < kQGroup; ++kk)
            blk[64 + 8 * kk + j % 8] |= static_cast<uint8_t>(j < 8 ? q[kk] : q[kk] << 4);
        }
      }
  });
  return exact.load() ? out : at::empty({0}, wc.options().dtype(at::kByte));
}

}  // namespace

// The matmul on 4-bit panels (packed_linear_f32 takes them; the tiles are packed_tiles.h's).
namespace gpuserv_panels {
namespace {

#if GPUSERV_AVX2
// A k step's 16 codes as fp32 (q0: columns 0-7, q1: 8-15). Byte j of a step holds column j (low nibble)
// and column j + 8 (high nibble). The step's 8 bytes go to every quadword (one broadcast load), one
// shuffle within each 128-bit half puts byte j alone in 32-bit lane j, and then column j is a mask away
// and column j + 8 a shift: with the two FMAs, 8 instructions a step where unpacking each half with its
// own zero-extension took 11, and the expansion is most of a narrow step's linear time.
struct Nibbles {
  const __m256i spread = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i low = _mm256_set1_epi32(0x0F);

  inline __attribute__((always_inline)) void codes(const uint8_t* step, __m256& q0, __m256& q1) const {
    int64_t bits;
    std::memcpy(&bits, step, 8);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi64x(bits), spread);
    q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
    q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};
#endif

// Panel `panel`'s k positions [k0, k0 + kc) (multiples of kQGroup) as fp32 panel steps in buf [kc][16].
// Not inlined: inlined into panels_q4, its constants stayed live in registers through the 6-row tiles,
// which need 15 of AVX2's 16, and a 48-row call ran at half speed.
__attribute__((noinline)) void expand_q4(const uint8_t* panel, int64_t k0, int64_t kc, float* buf) {
  for (int64_t g = k0 / kQGroup; g < (k0 + kc) / kQGroup; ++g) {
    const uint8_t* blk = panel + g * kQGroupBytes;
    float* out = buf + (g * kQGroup - k0) * kPanel;
#if GPUSERV_AVX2
    const auto half8 = [&](int at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at))); };
    const __m256 d0 = half8(0), d1 = half8(16), m0 = half8(32), m1 = half8(48);
    const Nibbles nib;
    for (int64_t kk = 0; kk < kQGroup; ++kk, out += kPanel) {
      __m256 q0, q1;
      nib.codes(blk + 64 + 8 * kk, q0, q1);
      _mm256_storeu_ps(out, _mm256_fmadd_ps(q0, d0, m0));
      _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(q1, d1, m1));
    }
#else
    const auto half = [&](int at) { return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(blk)[at], c10::Half::from_bits())); };
    for (int64_t kk = 0; kk < kQGroup; ++kk, out += kPanel)
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t b = blk[64 + 8 * kk + j % 8];
        out[j] = std::fma(static_cast<float>(j < 8 ? b & 15 : b >> 4), half(j), half(16 + j));
      }
#endif
  }
}

#if GPUSERV_AVX2
// MR (1 or 2) rows of x against NP 4-bit panels at once, all of K, the codes expanded in registers. At
// 1-2 rows the tile of one panel is a chain of 2-4 FMAs a k step on 4 cycles of latency, and expanding
// into a buffer first adds a store and a load of every value: ~0.8 cycles a weight on the Zen 3 where
// the codes' DRAM read needs ~0.15. Several panels side by side keep the FMA pipes fed and the values
// never leave the registers. Each column's sum runs along k in the same order and the same w = q * d + m
// feeds it, so y is bit for bit the buffered path's.
template <int MR, int NP>
void narrow_q4(const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, const Out* outs) {
  // The loops over rows and panels are unrolled so that the accumulators stay in registers: indexed at
  // run time, GCC stored all of them every k step.
  __m256 a0[MR][NP], a1[MR][NP];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) a0[m][j] = a1[m][j] = _mm256_setzero_ps();
  const Nibbles nib;
  alignas(32) float dm[NP][4][8];  // per panel: scales of columns 0-7, 8-15, offsets of 0-7, 8-15
  for (int64_t g = 0; g < K / kQGroup; ++g) {
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < 4; ++h)
        _mm256_store_ps(dm[j][h], _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(panels[j] + g * kQGroupBytes + 16 * h))));
    for (int64_t kk = 0; kk < kQGroup; ++kk) {
      const int64_t k = g * kQGroup + kk;
      __m256 xb[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        __m256 q0, q1;
        nib.codes(panels[j] + g * kQGroupBytes + 64 + 8 * kk, q0, q1);
        const __m256 w0 = _mm256_fmadd_ps(q0, _mm256_load_ps(dm[j][0]), _mm256_load_ps(dm[j][2]));
        const __m256 w1 = _mm256_fmadd_ps(q1, _mm256_load_ps(dm[j][1]), _mm256_load_ps(dm[j][3]));
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          a0[m][j] = _mm256_fmadd_ps(w0, xb[m], a0[m][j]);
          a1[m][j] = _mm256_fmadd_ps(w1, xb[m], a1[m][j]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const Out& o = outs[j];
    alignas(32) float row[kPanel], b[kPanel] = {};  // the bias (or +0, as the buffered tile adds) at the end
    if (o.bias) std::memcpy(b, o.bias, sizeof(float) * o.ncols);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      _mm256_store_ps(row, _mm256_add_ps(a0[m][j], _mm256_load_ps(b)));
      _mm256_store_ps(row + 8, _mm256_add_ps(a1[m][j], _mm256_load_ps(b + 8)));
      std::memcpy(o.y + m * o.ldy, row, sizeof(float) * o.ncols);
    }
  }
}

// Panels side by side: eight accumulators at one row (four panels) and at two rows (two panels).
template <int MR>
constexpr int kNarrowPanels = MR == 1 ? 4 : 2;

// narrow_q4 on the first np (1 .. NP) of `panels`.
template <int MR, int NP = kNarrowPanels<MR>>
void narrow_some(int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, const Out* outs) {
  if constexpr (NP > 1) {
    if (np < NP) return narrow_some<MR, NP - 1>(np, x, ldx, panels, K, outs);
  }
  narrow_q4<MR, NP>(x, ldx, panels, K, outs);
}

// Rows [0, MR) of x against panels [p0, p1), kNarrowPanels<MR> at a time.
template <int MR>
void narrow_panels_q4(const Call<float>& c, const uint8_t* q, int64_t p0, int64_t p1) {
  constexpr int kWidth = kNarrowPanels<MR>;
  const int64_t panel_bytes = c.K / kQGroup * kQGroupBytes;
  for (int64_t p = p0; p < p1; p += kWidth) {
    const uint8_t* panels[kWidth];
    Out outs[kWidth];
    const int np = static_cast<int>(std::min<int64_t>(kWidth, p1 - p));
    for (int j = 0; j < np; ++j) {
      panels[j] = q + (p + j) * panel_bytes;
      outs[j] = Out{c.y + (p + j) * kPanel, c.N, c.bias ? c.bias + (p + j) * kPanel : nullptr,
                    static_cast<int>(std::min(kPanel, c.N - (p + j) * kPanel)), true, true};
    }
    narrow_some<MR>(np, c.x, c.ldx, panels, c.K, outs);
  }
}
#endif

// Panels [p0, p1) of 4-bit panels against all rows of x: each K block expanded once, then the fp32 tiles
// of every row block over it (the accumulators pass through y between K blocks, exactly).
void panels_q4(const Call<float>& c, const uint8_t* q, int64_t p0, int64_t p1) {
  alignas(64) float buf[kKc * kPanel];
  const int64_t panel_bytes = c.K / kQGroup * kQGroupBytes;
  for (int64_t mc0 = 0; mc0 < c.M; mc0 += kMc) {
    const int64_t rows = std::min(kMc, c.M - mc0);
    const int64_t nb = (rows + c.mr_max - 1) / c.mr_max;
    const int64_t base = rows / nb, extra = rows % nb;
    for (int64_t p = p0; p < p1; ++p) {
      Out o{nullptr, c.N, c.bias ? c.bias + p * kPanel : nullptr,
            static_cast<int>(std::min(kPanel, c.N - p * kPanel)), true, false};
      for (int64_t k0 = 0; k0 < c.K; k0 += kKc) {
        const int64_t kc = std::min(kKc, c.K - k0);
        expand_q4(q + p * panel_bytes, k0, kc, buf);
        o.first = k0 == 0;
        o.last = k0 + kc == c.K;
        int64_t m = mc0;
        for (int64_t b = 0; b < nb; ++b) {
          const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
          o.y = c.y + m * c.N + p * kPanel;
          tile(mr, c.x + m * c.ldx + k0, c.ldx, static_cast<const float*>(buf), kc, o, Pf{nullptr, 0, 1});
          m += mr;
        }
      }
    }
  }
}

}  // namespace

void run_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const Call<float> c{x.data_ptr<float>(), x.stride(0), M, K, nullptr, P, N, bias, y.data_ptr<float>(), mr_max};
  const auto* q = packed.data_ptr<uint8_t>();
  split(P, K * kPanel * static_cast<int64_t>(sizeof(float)), [&](int64_t p0, int64_t p1, int64_t) {
#if GPUSERV_AVX2
    if (M == 1) return narrow_panels_q4<1>(c, q, p0, p1);
    if (M == 2) return narrow_panels_q4<2>(c, q, p0, p1);
#endif
    panels_q4(c, q, p0, p1);
  });
}

}  // namespace gpuserv_panels

TORCH_LIBRARY_FRAGMENT(gpuserv, m) { m.def("pack_panels_q4(Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("pack_panels_q4", &pack_panels_q4); }
