// y = x @ W^T + b for a few rows of x: the decode-time linear layer, for the CPU.
//
// At decode batch sizes (a handful of rows) a linear layer is a pass over its
// weight matrix: every weight is used once per row, so the step is bound by how
// fast W streams from DRAM, not by arithmetic. This kernel reads W once, in the
// layout the checkpoint stores it in (row-major [out, in], the same tensor
// oneDNN / F.linear take for prefill, so there is one copy of the weights), and
// keeps x in L1.
//
// Work split: the output rows are cut into one contiguous range per thread
// (at::parallel_for), so each core streams its own half of W. Within a range,
// rows go in blocks small enough to stay in L1/L2 while every group of up to
// 4 x rows passes over the block: W comes from DRAM once whatever the row
// count. The inner kernel keeps R output rows x TT x rows of 8-wide fp32
// accumulators in registers (R * TT + R + 1 <= 16 ymm registers), FMAs along
// `in`, then reduces each accumulator once, adds the tail columns (in % 8) and
// the bias.
//
// Numerics: fp32 accumulation in every dtype, bias added in fp32, one rounding
// to the output dtype at the end (as oneDNN and MKL do for bf16/fp16). The
// summation order differs from MKL's, so fp32 results agree with torch to
// rounding (relative ~1e-6), not bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "simd.h"

namespace {

// Bytes of W per block of output rows: the block is re-read from cache by each
// group of x rows after the first, so it must stay in L1/L2.
constexpr int64_t kBlockBytes = 16 << 10;
// Below this many weight bytes the call runs on the calling thread (waking the
// pool costs more than streaming a few hundred KB).
constexpr int64_t kParallelBytes = 256 << 10;
// How far ahead of the FMAs W is prefetched (about 16 rows of 576 fp32).
constexpr int64_t kPrefetchBytes = 32 << 10;

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

#if GPUSERV_AVX2
// R output rows (starting at w, row stride K) x TT rows of x (row stride ldx),
// writing y[t * ldy + r]. pf (or nullptr): the same columns kPrefetchBytes further
// on in W, prefetched into L2 one cache line per row as this pass reaches them.
// Rows are only a few KB, too short for the hardware prefetcher to keep R
// interleaved streams going: without it one core read 15 GB/s, with it 22
// (a single sequential stream: 25-27), on this project's 2-core EPYC.
template <int R, int TT, typename T>
inline void micro(const T* __restrict w, int64_t K, const T* __restrict x, int64_t ldx, const T* bias,
                  T* __restrict y, int64_t ldy, const T* pf) {
  using gpuserv_simd::load8;
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t k = 0; k < K8; k += 8) {
    if (pf && k % kLine == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T1);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = load8(x + t * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = bias ? f32(bias[r]) : 0.f;
    for (int t = 0; t < TT; ++t) {
      float s = gpuserv_simd::hsum(acc[r][t]);
      for (int64_t k = K8; k < K; ++k) s += f32(w[r * K + k]) * f32(x[t * ldx + k]);
      y[t * ldy + r] = static_cast<T>(s + b);
    }
  }
}

// Rows [r0, r1) of W against TT rows of x. The widest R that fits the registers
// for TT, then narrower ones for the leftover rows.
// (N: rows of the whole matrix, the prefetch limit.)
template <int TT, typename T>
void rows_tt(const T* w, int64_t K, int64_t N, const T* x, int64_t ldx, const T* bias, T* y, int64_t ldy,
             int64_t r0, int64_t r1) {
#if defined(__AVX512VL__)
  // 32 ymm registers (EVEX encoding): 4 rows x 4 x rows keeps 16 accumulators in flight.
  constexpr int RMAX = 4;
#else
  constexpr int RMAX = TT <= 2 ? 4 : 2;  // R = 3 at TT = 3-4 spilled registers: 2x slower
#endif
  const int64_t ahead = std::max<int64_t>(RMAX, kPrefetchBytes / (K * int64_t(sizeof(T))));
  int64_t r = r0;
  for (; r + RMAX <= r1; r += RMAX) {
    const T* pf = r + ahead + RMAX <= N ? w + (r + ahead) * K : nullptr;
    micro<RMAX, TT>(w + r * K, K, x, ldx, bias ? bias + r : nullptr, y + r, ldy, pf);
  }
  for (; r < r1; ++r) micro<1, TT>(w + r * K, K, x, ldx, bias ? bias + r : nullptr, y + r, ldy, static_cast<const T*>(nullptr));
}
#endif

template <typename T>
void rows_scalar(const T* w, int64_t K, const T* x, int64_t ldx, int64_t tt, const T* bias, T* y, int64_t ldy,
                 int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t = 0; t < tt; ++t) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += f32(w[r * K + k]) * f32(x[t * ldx + k]);
      y[t * ldy + r] = static_cast<T>(s + (bias ? f32(bias[r]) : 0.f));
    }
}

// One block of output rows [r0, r1) against all T rows of x, 4 x rows at a time.
template <typename T>
void block(const T* w, int64_t K, const T* x, int64_t ldx, int64_t T_rows, const T* bias, T* y, int64_t N,
           int64_t r0, int64_t r1) {
  for (int64_t t0 = 0; t0 < T_rows; t0 += 4) {
    const int64_t tt = std::min<int64_t>(4, T_rows - t0);
    const T* xt = x + t0 * ldx;
    T* yt = y + t0 * N;
#if GPUSERV_AVX2
    switch (tt) {
      case 1: rows_tt<1>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 2: rows_tt<2>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 3: rows_tt<3>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      default: rows_tt<4>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
    }
#else
    rows_scalar(w, K, xt, ldx, tt, bias, yt, N, r0, r1);
#endif
  }
}

// y [T, N] = x [T, K] @ w[N, K]^T (+ bias [N]).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "gemv: weight must be a contiguous [out, in]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.stride(1) == 1,
              "gemv: x must be [T, in] with unit column stride; got ", x.sizes(), " for weight ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "gemv: x and weight dtypes differ");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == w.size(0) &&
                    bias->scalar_type() == w.scalar_type(),
                "gemv: bias must be a contiguous [out] of the weight's dtype");
  const int64_t T_rows = x.size(0), N = w.size(0), K = w.size(1);
  auto y = at::empty({T_rows, N}, x.options());
  if (T_rows == 0 || N == 0) return y;
  const int64_t ldx = x.stride(0);
  const int64_t row_bytes = std::max<int64_t>(1, K * w.element_size());
  // Rows per block: a multiple of 4 (every RMAX divides it) within kBlockBytes.
  const int64_t rows_blk = std::max<int64_t>(4, (kBlockBytes / row_bytes) & ~int64_t(3));
  const int64_t nblk = (N + rows_blk - 1) / rows_blk;
  const int64_t grain = N * row_bytes < kParallelBytes ? nblk : 1;

#define GPUSERV_GEMV_RUN(scalar_t)                                                                   \
  {                                                                                                  \
    const scalar_t* wp = w.data_ptr<scalar_t>();                                                     \
    const scalar_t* xp = x.data_ptr<scalar_t>();                                                     \
    const scalar_t* bp = has_bias ? bias->data_ptr<scalar_t>() : nullptr;                            \
    scalar_t* yp = y.data_ptr<scalar_t>();                                                           \
    at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {                                   \
      for (int64_t b = b0; b < b1; ++b) {                                                            \
        const int64_t r0 = b * rows_blk, r1 = std::min(N, r0 + rows_blk);                             \
        block<scalar_t>(wp, K, xp, ldx, T_rows, bp, yp, N, r0, r1);                                  \
      }                                                                                              \
    });                                                                                              \
  }
  switch (x.scalar_type()) {
    case at::kFloat: GPUSERV_GEMV_RUN(float); break;
    case at::kBFloat16: GPUSERV_GEMV_RUN(at::BFloat16); break;
    case at::kHalf: GPUSERV_GEMV_RUN(at::Half); break;
    default: TORCH_CHECK(false, "gemv: unsupported dtype ", x.scalar_type());
  }
#undef GPUSERV_GEMV_RUN
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) { m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) { m.impl("gemv", &gemv); }
