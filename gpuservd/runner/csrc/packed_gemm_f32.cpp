// y = x @ W^T + b in fp32 on the CPU, W repacked once into column panels.
//
// Why beside gemv.cpp: gemv takes W as the checkpoint stores it ([out, in]),
// so every output is a dot product along `in` that ends in a horizontal
// reduction, and a register block of R output rows x T rows of x needs R + T
// loads per R * T FMAs; at 16-64 decode rows it ran at ~60% of one core's FMA
// peak. Here W is repacked at load time so that 16 consecutive output columns
// of one input position are one 64-byte line:
//
//     packed[p][k][j] = W[16 * p + j][k]          (p: panel, j < 16; out padded with zero rows)
//
// and the inner step is an outer product: two vector loads of the panel, one
// broadcast of x[m][k] per row m, two FMAs per row into 16 fp32 lanes that are
// the outputs themselves (no reduction). A tile of MR rows x 16 columns keeps
// 2 * MR accumulators in registers: MR = 6 on AVX2 (12 accumulators + 2 panel
// vectors + 1 broadcast of 16 ymm registers), MR = 12 where the build has
// AVX-512VL (EVEX encoding: 32 ymm registers, 24 accumulators), which halves
// the panel loads per FMA. The row counts of a call are cut into blocks of
// nearly equal height (32 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2), so no block
// runs with too few independent accumulators to cover the FMA latency.
//
// Work split: each thread takes a contiguous range of panels (at::parallel_for),
// so it streams its share of W from DRAM as one sequential run, and prefetches
// the next lines of it into L2 while it computes on the current ones. Within a
// range: chunks of up to kMc rows of x (kept in L2), panel by panel, and when
// a chunk has more than one row block, blocks of kKc input positions (a 16 KB
// slice of the panel stays in L1 while every row block passes over it; the
// accumulators go to y between K blocks). Either way W is read front to back.
//
// Numerics: fp32 products and fp32 accumulation along k in order within a K
// block; the bias is added once at the end. The summation order differs from
// MKL's, so results agree with torch to rounding (relative ~1e-6).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "simd.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
#if defined(__AVX512VL__)
constexpr int kMr = 12;         // rows of x per register tile with 32 vector registers
#else
constexpr int kMr = 6;
#endif
constexpr int kMrCap = 12;      // tile heights compiled (tile_rows may ask for up to this)
constexpr int64_t kMc = 96;     // rows of x per chunk (96 x 256 x 4 B of x = 96 KB stay in L2)
constexpr int64_t kKc = 256;    // input positions per K block (256 x 64 B = 16 KB of a panel stay in L1)
constexpr int64_t kParallelBytes = 256 << 10;  // smaller weights run on the calling thread

struct Out {
  float* y;            // the tile's first output (row m0, column 16 p)
  int64_t ldy;
  const float* bias;   // the panel's bias, or nullptr
  int ncols;           // valid columns of this panel (16 except the last panel)
  bool first, last;    // first K block: start from zero; last: add the bias
};

#if GPUSERV_AVX2
inline __m256i lane_mask(int n) {  // lanes [0, n) set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One k step of the tile: a[m] += x[m * ldx] * w[0..15] for the MR rows (the panel's 16 columns in two
// registers, each x element broadcast once).
template <int MR>
inline __attribute__((always_inline)) void rank1(const float* x, int64_t ldx, const float* w, __m256* a0,
                                                 __m256* a1) {
  const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    const __m256 xb = _mm256_broadcast_ss(x + m * ldx);
    a0[m] = _mm256_fmadd_ps(w0, xb, a0[m]);
    a1[m] = _mm256_fmadd_ps(w1, xb, a1[m]);
  }
}

// MR rows of x (row stride ldx, from column k0) against one panel slice w [kc][16].
// pf: pf_lines 64-byte lines to prefetch into L2, one per k step from the first.
template <int MR>
inline void micro(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kc, const Out& o,
                  const char* pf, int64_t pf_lines) {
  __m256 a0[MR], a1[MR];
  const __m256i m0 = lane_mask(o.ncols), m1 = lane_mask(o.ncols - 8);
  const bool full = o.ncols == kPanel;
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    if (o.first) {
      a0[m] = _mm256_setzero_ps();
      a1[m] = _mm256_setzero_ps();
    } else if (full) {
      a0[m] = _mm256_loadu_ps(o.y + m * o.ldy);
      a1[m] = _mm256_loadu_ps(o.y + m * o.ldy + 8);
    } else {
      a0[m] = _mm256_maskload_ps(o.y + m * o.ldy, m0);
      a1[m] = _mm256_maskload_ps(o.y + m * o.ldy + 8, m1);
    }
  }
  const int64_t npf = std::min(pf_lines, kc);
  int64_t k = 0;
  for (; k < npf; ++k) {
    _mm_prefetch(pf + k * 64, _MM_HINT_T1);
    rank1<MR>(x + k, ldx, w + k * kPanel, a0, a1);
  }
  for (; k < kc; ++k) {
    rank1<MR>(x + k, ldx, w + k * kPanel, a0, a1);
  }
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (o.last && o.bias) {
    b0 = full ? _mm256_loadu_ps(o.bias) : _mm256_maskload_ps(o.bias, m0);
    b1 = full ? _mm256_loadu_ps(o.bias + 8) : _mm256_maskload_ps(o.bias + 8, m1);
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    const __m256 r0 = _mm256_add_ps(a0[m], b0), r1 = _mm256_add_ps(a1[m], b1);
    if (full) {
      _mm256_storeu_ps(o.y + m * o.ldy, r0);
      _mm256_storeu_ps(o.y + m * o.ldy + 8, r1);
    } else {
      _mm256_maskstore_ps(o.y + m * o.ldy, m0, r0);
      _mm256_maskstore_ps(o.y + m * o.ldy + 8, m1, r1);
    }
  }
}
#endif

// The same tile in scalar code (a build without AVX2/FMA).
inline void micro_scalar(int mr, const float* x, int64_t ldx, const float* w, int64_t kc, const Out& o) {
  for (int m = 0; m < mr; ++m)
    for (int j = 0; j < o.ncols; ++j) {
      float s = o.first ? 0.f : o.y[m * o.ldy + j];
      for (int64_t k = 0; k < kc; ++k) s += w[k * kPanel + j] * x[m * ldx + k];
      o.y[m * o.ldy + j] = s + (o.last && o.bias ? o.bias[j] : 0.f);
    }
}

void tile(int mr, const float* x, int64_t ldx, const float* w, int64_t kc, const Out& o, const char* pf,
          int64_t pf_lines) {
#if GPUSERV_AVX2
  switch (mr) {
    case 1: micro<1>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 2: micro<2>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 3: micro<3>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 4: micro<4>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 5: micro<5>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 6: micro<6>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 7: micro<7>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 8: micro<8>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 9: micro<9>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 10: micro<10>(x, ldx, w, kc, o, pf, pf_lines); break;
    case 11: micro<11>(x, ldx, w, kc, o, pf, pf_lines); break;
    default: micro<kMrCap>(x, ldx, w, kc, o, pf, pf_lines); break;
  }
#else
  (void)pf;
  (void)pf_lines;
  micro_scalar(mr, x, ldx, w, kc, o);
#endif
}

// Whether this library has the vector kernel. Without AVX2/FMA (another architecture, or an old
// x86) the scalar tile still computes correct results, but oneDNN / F.linear on the dense weight are
// far faster there, so Linear keeps that layout.
bool packed_f32_available() { return GPUSERV_AVX2 != 0; }

struct Call {
  const float* x;
  int64_t ldx, M, K;
  const float* w;  // [P][K][16]
  int64_t P, N;
  const float* bias;
  float* y;        // [M, N]
  int mr_max;
};

// Panels [p0, p1) against all rows of x. Panel by panel, and within a panel K block by K block,
// so W is read front to back (one sequential stream per thread) and each K block's slice is
// prefetched while the one before it is computed.
void panels(const Call& c, int64_t p0, int64_t p1) {
  const float* w_end = c.w + p1 * c.K * kPanel;
  for (int64_t mc0 = 0; mc0 < c.M; mc0 += kMc) {
    const int64_t rows = std::min(kMc, c.M - mc0);
    const int64_t nb = (rows + c.mr_max - 1) / c.mr_max;  // row blocks of nearly equal height
    const int64_t base = rows / nb, extra = rows % nb;
    const int64_t kc_step = nb == 1 ? c.K : kKc;
    for (int64_t p = p0; p < p1; ++p) {
      Out o{nullptr, c.N, c.bias ? c.bias + p * kPanel : nullptr,
            static_cast<int>(std::min(kPanel, c.N - p * kPanel)), true, false};
      for (int64_t k0 = 0; k0 < c.K; k0 += kc_step) {
        const int64_t kc = std::min(kc_step, c.K - k0);
        const float* wp = c.w + (p * c.K + k0) * kPanel;
        // The next kc lines of W after this slice (on every chunk: past the first, a W larger
        // than the caches comes from DRAM again), shared out over the row blocks.
        const float* next = wp + kc * kPanel;
        int64_t pf_left = std::min<int64_t>(kc, (w_end - next) / kPanel);
        const char* pf = pf_left > 0 ? reinterpret_cast<const char*>(next) : nullptr;
        const int64_t share = (std::max<int64_t>(pf_left, 0) + nb - 1) / nb;
        o.first = k0 == 0;
        o.last = k0 + kc == c.K;
        int64_t m = mc0;
        for (int64_t b = 0; b < nb; ++b) {
          const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
          o.y = c.y + m * c.N + p * kPanel;
          const int64_t lines = pf ? std::min(share, pf_left) : 0;
          tile(mr, c.x + m * c.ldx + k0, c.ldx, wp, kc, o, pf, lines);
          if (pf) pf += lines * 64;
          pf_left -= lines;
          m += mr;
        }
      }
    }
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]); packed = W in column panels [ceil(N/16), K, 16].
// tile_rows: the register tile's height (0: this build's own; 1-12 for tests of every tile).
at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear_f32: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear_f32: fp32 x and weight only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear_f32: weight must be a contiguous panel tensor [P, K, 16], got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear_f32: x must be [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && N > 0 && (N + kPanel - 1) / kPanel == P,
              "packed_linear_f32: x is [", M, ", ", K, "] but the weight packs [", N, ", ", packed.size(1), "]");
  TORCH_CHECK(tile_rows >= 0 && tile_rows <= kMrCap, "packed_linear_f32: tile_rows must be 0-", kMrCap);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "packed_linear_f32: bias must be a contiguous fp32 [", N, "]");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || K == 0) return K == 0 && M ? (has_bias ? bias->expand({M, N}).clone() : y.zero_()) : y;
  const Call c{x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), P, N,
               has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
               tile_rows ? static_cast<int>(tile_rows) : kMr};
  const int64_t wbytes = P * K * kPanel * 4;
  at::parallel_for(0, P, wbytes < kParallelBytes ? P : 1, [&](int64_t p0, int64_t p1) { panels(c, p0, p1); });
  return y;
}

#if GPUSERV_AVX2
// In place: rows r[0..8) of 8 floats become their columns.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// W [N, K] fp32 -> column panels [ceil(N/16), K, 16], zero padded: once per weight at load. It
// transposes 8 x 8 blocks in registers and writes each panel front to back: 1.7x torch's permuted
// copy on a 3072 x 576 weight (1 thread); on large weights both are bound by the first-touch page
// faults of the new tensor.
at::Tensor pack_panels_f32(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "pack_panels_f32: W must be an fp32 [out, in] CPU tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kPanel - 1) / kPanel;
  auto out = at::empty({P, K, kPanel}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, K * kPanel * 4));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t rows = std::min(kPanel, N - p * kPanel);
      const float* wr = src + p * kPanel * K;
      float* panel = dst + p * K * kPanel;
      int64_t k = 0;
#if GPUSERV_AVX2
      if (rows == kPanel)
        for (; k + 8 <= K; k += 8)
          for (int h = 0; h < 2; ++h) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(wr + (8 * h + i) * K + k);
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kPanel + 8 * h, r[i]);
          }
#endif
      for (; k < K; ++k)
        for (int64_t j = 0; j < kPanel; ++j) panel[k * kPanel + j] = j < rows ? wr[j * K + k] : 0.f;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("packed_linear_f32(Tensor x, Tensor packed, int n, Tensor? bias, int tile_rows=0) -> Tensor");
  m.def("pack_panels_f32(Tensor w) -> Tensor");
  m.def("packed_f32_available() -> bool", &packed_f32_available);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) {
  m.impl("packed_linear_f32", &packed_linear_f32);
  m.impl("pack_panels_f32", &pack_panels_f32);
}
