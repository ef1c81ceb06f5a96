// The matmul on column panels of quantisation codes (q4_panels.cpp: 4-bit codes with a scale and an offset,
// q8_panels.cpp: 8-bit codes with a scale), over the fp32 tiles of packed_tiles.h. Each weight is expanded
// back to the exact fp32 value it stands for before the same FMAs, in the same order, as on fp32 panels,
// so the results are bit for bit those of fp32 panels of the dense weight. pack_codes is the loop both
// formats' grid searches run in at load.
//
// A format Fmt says how its panels are laid out and expanded:
//   kGroupBytes            bytes of one panel's group of kQGroup k positions;
//   kParams                fp16 vectors of per-group parameters (8 columns each) at the start of a group
//                          (load_params widens them);
//   kNarrowRowsMax         rows of x up to which the codes are expanded in registers (narrow_rows), in
//                          passes of at most four rows; past it, into a buffer once for the fp32 tiles;
//   weights(blk, kk, p, w0, w1)   k step kk of the group as fp32, columns 0-7 and 8-15;
//   value(blk, kk, j)      the same for one column, in scalar code (a build without AVX2).
#pragma once

#include <ATen/ops/empty.h>

#include "packed_tiles.h"

namespace gpuserv_panels {

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// W [N, K] fp32 -> code panels [ceil(N/16), K/32, group_bytes] uint8, or an empty tensor when a group has
// no grid. fill(v, blk, j) writes column j of the group block blk (zeroed first: padded columns stay
// 0) from the 32 values v of that row, or returns false. The first group without a grid stops every thread.
template <typename Fill>
at::Tensor pack_codes(const at::Tensor& w, int64_t group_bytes, const char* name, Fill&& fill) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2, name,
              ": an fp32 CPU matrix only");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  if (K % kQGroup || N == 0) return at::empty({0}, wc.options().dtype(at::kByte));
  const int64_t P = (N + kPanel - 1) / kPanel, G = K / kQGroup;
  at::Tensor out = at::empty({P, G, group_bytes}, wc.options().dtype(at::kByte));
  const float* src = wc.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1 && exact.load(std::memory_order_relaxed); ++p)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* blk = dst + (p * G + g) * group_bytes;
        std::memset(blk, 0, group_bytes);
        for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
          if (!fill(src + (p * kPanel + j) * K + g * kQGroup, blk, j)) {
            exact.store(false, std::memory_order_relaxed);
            return;
          }
      }
  });
  return exact.load() ? out : at::empty({0}, wc.options().dtype(at::kByte));
}

#if GPUSERV_AVX2
// A group's N parameter vectors (fp16, 8 columns each, at the block's start) widened to p[N][8].
template <int N>
inline __attribute__((always_inline)) void load_params(const uint8_t* blk, float (*p)[8]) {
  for (int h = 0; h < N; ++h)
    _mm256_store_ps(p[h], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h))));
}
#endif

// Panel `panel`'s k positions [k0, k0 + kc) (multiples of kQGroup) as fp32 panel steps in buf [kc][16].
// Not inlined: inlined into panels_codes, its constants stayed live in registers through the 6-row tiles,
// which need 15 of AVX2's 16, and a 48-row call ran at half speed.
template <typename Fmt>
__attribute__((noinline)) void expand_codes(const uint8_t* panel, int64_t k0, int64_t kc, float* buf) {
  const Fmt fmt;
  for (int64_t g = k0 / kQGroup; g < (k0 + kc) / kQGroup; ++g) {
    const uint8_t* blk = panel + g * Fmt::kGroupBytes;
    float* out = buf + (g * kQGroup - k0) * kPanel;
#if GPUSERV_AVX2
    alignas(32) float p[Fmt::kParams][8];
    load_params<Fmt::kParams>(blk, p);
    for (int64_t kk = 0; kk < kQGroup; ++kk, out += kPanel) {
      __m256 w0, w1;
      fmt.weights(blk, kk, p, w0, w1);
      _mm256_storeu_ps(out, w0);
      _mm256_storeu_ps(out + 8, w1);
    }
#else
    for (int64_t kk = 0; kk < kQGroup; ++kk, out += kPanel)
      for (int j = 0; j < kPanel; ++j) out[j] = fmt.value(blk, kk, j);
#endif
  }
}

#if GPUSERV_AVX2
// MR (1-4) rows of x against NP code panels at once, all of K, the codes expanded in registers. At
// 1-2 rows the tile of one panel is a chain of 2-4 FMAs a k step on 4 cycles of latency, and expanding
// into a buffer first adds a store and a load of every value: ~0.8 cycles a weight on the Zen 3 where
// the 4-bit codes' DRAM read needs ~0.15. Several panels side by side keep the FMA pipes fed and the
// values never leave the registers. Each column's sum runs along k in the same order over the same
// expanded w, so y is bit for bit the buffered path's.
template <typename Fmt, int MR, int NP>
void narrow_codes(const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, const Out* outs) {
  // The loops over rows and panels are unrolled so that the accumulators stay in registers: indexed at
  // run time, GCC stored all of them every k step.
  __m256 a0[MR][NP], a1[MR][NP];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) a0[m][j] = a1[m][j] = _mm256_setzero_ps();
  const Fmt fmt;
  alignas(32) float p[NP][Fmt::kParams][8];
  for (int64_t g = 0; g < K / kQGroup; ++g) {
    for (int j = 0; j < NP; ++j) load_params<Fmt::kParams>(panels[j] + g * Fmt::kGroupBytes, p[j]);
    for (int64_t kk = 0; kk < kQGroup; ++kk) {
      const int64_t k = g * kQGroup + kk;
      __m256 xb[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        __m256 w0, w1;
        fmt.weights(panels[j] + g * Fmt::kGroupBytes, kk, p[j], w0, w1);
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

// Panels side by side: eight accumulators at one row (four panels) and at two rows (two panels); three
// and four rows take one panel (six and eight).
template <int MR>
constexpr int kNarrowPanels = MR == 1 ? 4 : MR == 2 ? 2 : 1;
constexpr int kNarrowWidest = 4;  // panels of the widest narrow call
constexpr int kNarrowRows = 4;    // rows of a narrow call at most (a register tile of 4 x 16 columns)

// narrow_codes on the first np (1 .. NP) of `panels`.
template <typename Fmt, int MR, int NP = kNarrowPanels<MR>>
void narrow_some(int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t K, const Out* outs) {
  if constexpr (NP > 1) {
    if (np < NP) return narrow_some<Fmt, MR, NP - 1>(np, x, ldx, panels, K, outs);
  }
  narrow_codes<Fmt, MR, NP>(x, ldx, panels, K, outs);
}

// Rows [m0, m0 + MR) of x against panels [p0, p1), kNarrowPanels<MR> at a time.
template <typename Fmt, int MR>
void narrow_panels(const Call<float>& c, const uint8_t* q, int64_t m0, int64_t p0, int64_t p1) {
  constexpr int kWidth = kNarrowPanels<MR>;
  const int64_t panel_bytes = c.K / kQGroup * Fmt::kGroupBytes;
  for (int64_t p = p0; p < p1; p += kWidth) {
    const uint8_t* panels[kWidth];
    Out outs[kWidth];
    const int np = static_cast<int>(std::min<int64_t>(kWidth, p1 - p));
    for (int j = 0; j < np; ++j) {
      panels[j] = q + (p + j) * panel_bytes;
      outs[j] = Out{c.y + m0 * c.N + (p + j) * kPanel, c.N, c.bias ? c.bias + (p + j) * kPanel : nullptr,
                    static_cast<int>(std::min(kPanel, c.N - (p + j) * kPanel)), true, true};
    }
    narrow_some<Fmt, MR>(np, c.x + m0 * c.ldx, c.ldx, panels, c.K, outs);
  }
}

// All rows of x (at most Fmt::kNarrowRowsMax) against panels [p0, p1), the codes expanded in
// registers: the rows in passes of at most four, nearly equal (7: 4 + 3), over kNarrowWidest panels at a
// time, so a pass after the first reads the same panels' codes again from L1. The buffered path at 1-4
// rows ran at a fifth to a half of the FMA peak (every value through a store and a load, and tiles with
// too few accumulators to cover the FMA latency): this one was 1.16-2.1x faster there (2 threads, SmolLM2's
// shapes, from DRAM and from L3).
template <typename Fmt>
void narrow_rows(const Call<float>& c, const uint8_t* q, int64_t p0, int64_t p1) {
  const int64_t passes = (c.M + kNarrowRows - 1) / kNarrowRows, base = c.M / passes, extra = c.M % passes;
  for (int64_t p = p0; p < p1; p += kNarrowWidest) {
    const int64_t pe = std::min(p1, p + kNarrowWidest);
    int64_t m = 0;
    for (int64_t b = 0; b < passes; ++b) {
      const int64_t mr = base + (b < extra ? 1 : 0);
      switch (mr) {
        case 1: narrow_panels<Fmt, 1>(c, q, m, p, pe); break;
        case 2: narrow_panels<Fmt, 2>(c, q, m, p, pe); break;
        case 3: narrow_panels<Fmt, 3>(c, q, m, p, pe); break;
        default: narrow_panels<Fmt, 4>(c, q, m, p, pe); break;
      }
      m += mr;
    }
  }
}
#endif

// Panels [p0, p1) of code panels against all rows of x: each K block expanded once, then the fp32 tiles
// of every row block over it (the accumulators pass through y between K blocks, exactly).
template <typename Fmt>
void panels_codes(const Call<float>& c, const uint8_t* q, int64_t p0, int64_t p1) {
  alignas(64) float buf[kKc * kPanel];
  const int64_t panel_bytes = c.K / kQGroup * Fmt::kGroupBytes;
  for (int64_t mc0 = 0; mc0 < c.M; mc0 += kMc) {
    const int64_t rows = std::min(kMc, c.M - mc0);
    const int64_t nb = (rows + c.mr_max - 1) / c.mr_max;
    const int64_t base = rows / nb, extra = rows % nb;
    for (int64_t p = p0; p < p1; ++p) {
      Out o{nullptr, c.N, c.bias ? c.bias + p * kPanel : nullptr,
            static_cast<int>(std::min(kPanel, c.N - p * kPanel)), true, false};
      for (int64_t k0 = 0; k0 < c.K; k0 += kKc) {
        const int64_t kc = std::min(kKc, c.K - k0);
        expand_codes<Fmt>(q + p * panel_bytes, k0, kc, buf);
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

// y [M, N] = x @ W^T (+ bias) with W in Fmt's panels [P, K / kQGroup, Fmt::kGroupBytes]. narrow: up to
// Fmt::kNarrowRowsMax rows take narrow_rows (false: the buffered tiles of height mr_max at every row count,
// as a test of a given tile height asks).
template <typename Fmt>
void run_codes(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y,
               int mr_max, bool narrow) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const Call<float> c{x.data_ptr<float>(), x.stride(0), M, K, nullptr, P, N, bias, y.data_ptr<float>(), mr_max};
  const auto* q = packed.data_ptr<uint8_t>();
  split(P, K * kPanel * static_cast<int64_t>(sizeof(float)), [&](int64_t p0, int64_t p1, int64_t) {
#if GPUSERV_AVX2
    if (narrow && M <= Fmt::kNarrowRowsMax) return narrow_rows<Fmt>(c, q, p0, p1);
#endif
    panels_codes<Fmt>(c, q, p0, p1);
  });
}

}  // namespace gpuserv_panels
