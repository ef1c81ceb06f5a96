// packed_gemm.cpp (main at 9a2318d) as op gpx::packed_linear(..., mode): bit 0 drops the software prefetch
// of the next panel group, bit 1 reads W with the group's 3 panels interleaved per pair step (one sequential
// stream; layout_prefetch_ab.py packs it). Built by layout_prefetch_ab.py beside the product's op.
// y = x @ W^T + b in bf16 on a CPU with AVX512_BF16, W in a packed "pair-panel" layout.
//
// Why a second kernel beside gemv.cpp: gemv takes W as the checkpoint stores it
// ([out, in], rows contiguous along `in`), so each output is a dot product
// along `in` and every accumulator ends in a horizontal reduction. With
// SmolLM2's 576-wide rows that is 18 vdpbf16ps per accumulator and then a
// reduction as long as a third of them: at 32 decode rows it ran at ~60% of
// the dot-product peak. Here W is repacked once at load time so that one
// 64-byte vector holds, for 16 consecutive output columns, the two weights of
// one pair of input positions:
//
//     packed[p][kk][2 * j + e] = W[16 * p + j][2 * kk + e]     (p: panel, j < 16, e < 2)
//
// and vdpbf16ps(acc, W pair vector, broadcast of x[m][2kk], x[m][2kk+1])
// adds both products into output column j's lane: an outer product with no
// reduction at all (the layout oneDNN's brgemm uses for bf16). The panel of
// 16 columns is contiguous along `in`, so it streams like a row of gemv. The
// packing pads `out` to a multiple of 16 and `in` to an even count with zeros
// (runner/linear.py does it with a torch permute); x of odd width is copied
// to an even one here, so a padded pair never multiplies garbage (NaN * 0).
//
// Work split: each thread takes a contiguous range of panels (its part of W,
// streamed from DRAM once per chunk of up to kMc rows of x), and within it
// groups of NV panels against blocks of MR rows of x: MR * NV accumulators,
// NV vector loads of W and MR broadcasts per pair step. A panel group's slice
// of W (NV * in * 32 bytes, 55 KB at in = 576) is re-read from L2 by every
// row block after the first; the chunk of x (kMc rows) stays in L2 across the
// panel groups.
//
// Numerics as in gemv's dot-product kernel: bf16 products exact in fp32,
// fp32 accumulation (the instruction flushes denormals), bias added in fp32,
// one round to nearest even at the end.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "../../../../gpuservd/runner/csrc/simd.h"  // the repository's

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define GPUSERV_PACKED 1
#else
#define GPUSERV_PACKED 0
#endif

namespace {

constexpr int64_t kPanel = 16;   // output columns per panel (fp32 lanes of one zmm)
constexpr int64_t kMc = 64;      // rows of x per chunk (kept in L2 across the panel groups)
// Below this many weight bytes the call runs on the calling thread.
constexpr int64_t kParallelBytes = 256 << 10;

bool packed_available() {
#if GPUSERV_PACKED
  return gpuserv_simd::cpu_avx512bf16();
#else
  return false;
#endif
}

#if GPUSERV_PACKED
// MR rows of x against NV panels over all K2 pairs. x rows: int32 pairs at xp + m * ldx2.
// Output: bf16 at y, or (y == nullptr) fp32 at yf, both with row stride ldy.
template <int MR, int NV>
inline void micro(const int32_t* __restrict xp, int64_t ldx2, const __m512i* __restrict wp, int64_t K2,
                  const uint16_t* bias, uint16_t* __restrict y, float* __restrict yf, int64_t ldy, int64_t ncols,
                  const __m512i* pf, int64_t pf_lines, int64_t vs, int64_t ks) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  // pf: the next panel group's W, pf_lines 64-byte lines of it fetched into L2 over this call.
  const int64_t pf_per = (pf_lines + K2 - 1) / K2;  // lines per pair step (0 without pf)
  int64_t pf_done = 0;
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int64_t i = 0; i < pf_per && pf_done < pf_lines; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(pf + pf_done++), _MM_HINT_T1);
    __m512i w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(wp + v * vs + kk * ks);
    for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(xp[m * ldx2 + kk]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)w[v], (__m512bh)xb);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t left = ncols - v * kPanel;
    if (left <= 0) break;
    const __mmask16 mask = left >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + v * kPanel);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 r = _mm512_add_ps(acc[m][v], b);
      if (y) _mm256_mask_storeu_epi16(y + m * ldy + v * kPanel, mask, (__m256i)_mm512_cvtneps_pbh(r));
      else _mm512_mask_storeu_ps(yf + m * ldy + v * kPanel, mask, r);
    }
  }
}

template <int NV>
void rows_nv(int64_t rows, const int32_t* xp, int64_t ldx2, const __m512i* wp, int64_t K2, const uint16_t* bias,
             uint16_t* y, float* yf, int64_t ldy, int64_t ncols, const __m512i* pf, int64_t pf_lines, int64_t vs, int64_t ks) {
  // Blocks of 8 rows (24 accumulators at NV = 3); the tail by its exact size. The next group's
  // W (pf_lines lines) is prefetched in equal shares by the row blocks.
  const int64_t blocks = (rows + 7) / 8;
  const int64_t share = pf ? (pf_lines + blocks - 1) / blocks : 0;
  int64_t m = 0, b = 0;
  auto next_pf = [&]() -> const __m512i* { return pf ? pf + std::min(pf_lines, b * share) : nullptr; };
  auto lines = [&]() { return pf ? std::max<int64_t>(0, std::min(share, pf_lines - b * share)) : 0; };
  auto row = [&](int64_t i) { return y ? y + i * ldy : nullptr; };
  auto rowf = [&](int64_t i) { return y ? nullptr : yf + i * ldy; };
  for (; m + 8 <= rows; m += 8, ++b)
    micro<8, NV>(xp + m * ldx2, ldx2, wp, K2, bias, row(m), rowf(m), ldy, ncols, next_pf(), lines(), vs, ks);
  const int64_t t = rows - m;
  xp += m * ldx2;
  uint16_t* yt = row(m);
  float* yft = rowf(m);
  const __m512i* p = next_pf();
  const int64_t n = lines();
  switch (t) {
    case 0: break;
    case 1: micro<1, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    case 2: micro<2, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    case 3: micro<3, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    case 4: micro<4, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    case 5: micro<5, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    case 6: micro<6, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
    default: micro<7, NV>(xp, ldx2, wp, K2, bias, yt, yft, ldy, ncols, p, n, vs, ks); break;
  }
}

// Panels [p0, p1) against all rows of x, in chunks of kMc rows.
void panels(int64_t p0, int64_t p1, int64_t M, const int32_t* xp, int64_t ldx2, const __m512i* w, int64_t K2,
            const uint16_t* bias, uint16_t* y, float* yf, int64_t N, int mode) {
  constexpr int64_t NV = 3;
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t rows = std::min(kMc, M - m0);
    const int32_t* xc = xp + m0 * ldx2;
    uint16_t* yc = y ? y + m0 * N : nullptr;
    float* yfc = y ? nullptr : yf + m0 * N;
    for (int64_t p = p0; p < p1; p += NV) {
      const int64_t nv = std::min(NV, p1 - p);
      const int64_t ncols = std::min(N - p * kPanel, nv * kPanel);
      const __m512i* wp = w + p * K2;
      const uint16_t* bp = bias ? bias + p * kPanel : nullptr;
      uint16_t* yp = yc ? yc + p * kPanel : nullptr;
      float* yfp = yc ? nullptr : yfc + p * kPanel;
      // Prefetch the next group of this range (only on the chunk's first pass, when W comes from DRAM).
      const int64_t next = std::min(NV, p1 - (p + NV));
      const __m512i* pf = (m0 == 0 && next > 0 && (mode & 1) == 0) ? w + (p + NV) * K2 : nullptr;
      const int64_t vs = (mode & 2) ? 1 : K2, ks = (mode & 2) ? nv : 1;
      const int64_t pf_lines = pf ? next * K2 : 0;
      if (nv == 3) rows_nv<3>(rows, xc, ldx2, wp, K2, bp, yp, yfp, N, ncols, pf, pf_lines, vs, ks);
      else if (nv == 2) rows_nv<2>(rows, xc, ldx2, wp, K2, bp, yp, yfp, N, ncols, pf, pf_lines, vs, ks);
      else rows_nv<1>(rows, xc, ldx2, wp, K2, bp, yp, yfp, N, ncols, pf, pf_lines, vs, ks);
    }
  }
}
#endif

// y [M, N] = x [M, K] @ W^T (+ bias [N]); packed = W in the pair-panel layout, [ceil(N/16), ceil(K/2), 32].
// fp32_out: y in fp32, the accumulators unrounded (the LM head: logits without a bf16 rounding,
// which turned near-ties between tokens into exact ties).
// into: where to write y (packed_linear_out: a buffer reused step after step), else a new tensor.
at::Tensor packed_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias, bool fp32_out, const at::Tensor* into, int mode = 0) {
  TORCH_CHECK(packed_available(), "packed_linear: this CPU or build has no AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "packed_linear: bf16 x and weight only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 32 && packed.is_contiguous(),
              "packed_linear: weight must be a contiguous pair-panel tensor [P, K/2, 32], got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x must be [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == K2 && N > 0 && (N + kPanel - 1) / kPanel == P,
              "packed_linear: x is [", M, ", ", K, "] but the weight packs [", N, ", ", 2 * K2, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N &&
                    bias->scalar_type() == at::kBFloat16,
                "packed_linear: bias must be a contiguous bf16 [", N, "]");
  const auto y_type = fp32_out ? at::kFloat : at::kBFloat16;
  if (into)
    TORCH_CHECK(into->device().is_cpu() && into->scalar_type() == y_type && into->is_contiguous() &&
                    into->sizes() == at::IntArrayRef({M, N}),
                "packed_linear_out: out must be a contiguous ", y_type, " [", M, ", ", N, "]");
  auto y = into ? *into : at::empty({M, N}, x.options().dtype(y_type));
  if (M == 0) return y;
#if GPUSERV_PACKED
  // x's rows as int32 pairs: an odd width (or an odd row stride) is copied to an even one, zero padded.
  at::Tensor xe = x;
  if (K % 2 || x.stride(0) % 2) {
    xe = at::zeros({M, 2 * K2}, x.options());
    xe.narrow(1, 0, K).copy_(x);
  }
  const int32_t* xp = reinterpret_cast<const int32_t*>(xe.data_ptr());
  const int64_t ldx2 = xe.stride(0) / 2;
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr());
  const uint16_t* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  uint16_t* yp = fp32_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr());
  float* yfp = fp32_out ? y.data_ptr<float>() : nullptr;
  const int64_t wbytes = P * K2 * 64;
  // Whole groups of 3 panels per thread, so only the last range has a short group.
  const int64_t groups = (P + 2) / 3;
  at::parallel_for(0, groups, wbytes < kParallelBytes ? groups : 1, [&](int64_t g0, int64_t g1) {
    panels(g0 * 3, std::min(P, g1 * 3), M, xp, ldx2, wp, K2, bp, yp, yfp, N, mode);
  });
#endif
  return y;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool fp32_out, int64_t mode) {
  return packed_linear_into(x, packed, N, bias, fp32_out, nullptr, (int)mode);
}

void packed_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias, bool fp32_out, const at::Tensor& out) {
  packed_linear_into(x, packed, N, bias, fp32_out, &out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpx, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out, int mode) -> Tensor");
  m.def("packed_linear_out(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out, Tensor(a!) out) -> ()");
  m.def("packed_available() -> bool", &packed_available);
}

TORCH_LIBRARY_IMPL(gpx, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_out", &packed_linear_out);
}
