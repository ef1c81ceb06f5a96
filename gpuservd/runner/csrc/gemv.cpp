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
//
// bf16 on a CPU with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids): the
// inner kernel is `micro_dp` instead, which multiplies bf16 pairs straight
// from memory with vdpbf16ps (32 multiply-adds per instruction into 16 fp32
// lanes) instead of widening each bf16 to fp32 and issuing fp32 FMAs: twice
// the arithmetic per instruction and no conversion work, which is what the
// 32-row decode batches are bound by (the fp32 kernel already runs near the
// fp32 FMA peak there). Products of two bf16 are exact in fp32; the pair sum
// and the accumulation round to fp32 (the instruction flushes denormals), so
// results agree with fp32-accumulating torch to bf16 rounding of the output.
// It is compiled only when the build flags carry -mavx512bf16 (cpu_kernels.py
// adds it where /proc/cpuinfo lists avx512_bf16) and used only when the CPU
// running the library reports it too (__builtin_cpu_supports); otherwise bf16
// takes the widening kernel. `gemv_widen` forces the widening kernel (the A/B
// reference in tests and scripts/bench_dtype.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "simd.h"

#if GPUSERV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define GPUSERV_BF16_DP 1
#else
#define GPUSERV_BF16_DP 0
#endif

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

#if GPUSERV_BF16_DP
// Sums of four 16-lane accumulators -> [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(gpuserv_simd::fold16(a), gpuserv_simd::fold16(b));
  const __m256 cd = _mm256_hadd_ps(gpuserv_simd::fold16(c), gpuserv_simd::fold16(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d] of the low and of the high 128 bits
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline __m512bh load_bh(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const at::BFloat16* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// micro() for bf16 with vdpbf16ps: R output rows x TT rows of x, 32 columns (one cache line of
// each W row) per step; the K % 32 tail is a masked load (zeros add nothing).
// R * TT + R + 1 <= 32 zmm registers.
template <int R, int TT>
inline void micro_dp(const at::BFloat16* __restrict w, int64_t K, const at::BFloat16* __restrict x, int64_t ldx,
                     const at::BFloat16* bias, at::BFloat16* __restrict y, int64_t ldy, const at::BFloat16* pf) {
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t k = 0; k < K32; k += 32) {
    if (pf)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bh(w + r * K + k);
    for (int t = 0; t < TT; ++t) {
      const __m512bh xv = load_bh(x + t * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  if (K32 < K) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t(1) << (K - K32)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bh(w + r * K + K32, m);
    for (int t = 0; t < TT; ++t) {
      const __m512bh xv = load_bh(x + t * ldx + K32, m);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  for (int t = 0; t < TT; ++t) {
    if constexpr (R % 4 == 0) {
      for (int r0 = 0; r0 < R; r0 += 4) {
        float s[4];
        _mm_storeu_ps(s, hsum4(acc[r0][t], acc[r0 + 1][t], acc[r0 + 2][t], acc[r0 + 3][t]));
        for (int r = 0; r < 4; ++r)
          y[t * ldy + r0 + r] = static_cast<at::BFloat16>(s[r] + (bias ? f32(bias[r0 + r]) : 0.f));
      }
    } else {
      for (int r = 0; r < R; ++r)
        y[t * ldy + r] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[r][t]) + (bias ? f32(bias[r]) : 0.f));
    }
  }
}

// 4 W rows x up to 6 x rows per micro_dp: 24 accumulators, 10 loads per 24 dot products. Over 30
// layers of SmolLM2 weights at 32 rows (2 threads) 6 x rows ran ~9% faster than 4; 8 W rows does
// not divide the 12-row blocks of 576-wide bf16 rows.
constexpr int kDpRows = 4, kDpGroup = 6;
template <int TT>
void rows_tt_dp(const at::BFloat16* w, int64_t K, int64_t N, const at::BFloat16* x, int64_t ldx,
                const at::BFloat16* bias, at::BFloat16* y, int64_t ldy, int64_t r0, int64_t r1) {
  constexpr int RMAX = kDpRows;
  const int64_t ahead = std::max<int64_t>(RMAX, kPrefetchBytes / (K * int64_t(sizeof(at::BFloat16))));
  int64_t r = r0;
  for (; r + RMAX <= r1; r += RMAX) {
    const at::BFloat16* pf = r + ahead + RMAX <= N ? w + (r + ahead) * K : nullptr;
    micro_dp<RMAX, TT>(w + r * K, K, x, ldx, bias ? bias + r : nullptr, y + r, ldy, pf);
  }
  for (; r < r1; ++r)
    micro_dp<1, TT>(w + r * K, K, x, ldx, bias ? bias + r : nullptr, y + r, ldy, static_cast<const at::BFloat16*>(nullptr));
}

void block_dp(const at::BFloat16* w, int64_t K, const at::BFloat16* x, int64_t ldx, int64_t T_rows,
              const at::BFloat16* bias, at::BFloat16* y, int64_t N, int64_t r0, int64_t r1) {
  for (int64_t t0 = 0; t0 < T_rows; t0 += kDpGroup) {
    const int64_t tt = std::min<int64_t>(kDpGroup, T_rows - t0);
    const at::BFloat16* xt = x + t0 * ldx;
    at::BFloat16* yt = y + t0 * N;
    switch (tt) {
      case 1: rows_tt_dp<1>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 2: rows_tt_dp<2>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 3: rows_tt_dp<3>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 4: rows_tt_dp<4>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      case 5: rows_tt_dp<5>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
      default: rows_tt_dp<kDpGroup>(w, K, N, xt, ldx, bias, yt, N, r0, r1); break;
    }
  }
}
#endif

// Whether this library has the bf16 dot-product kernel and the CPU running it can execute it.
bool bf16_dp_available() {
#if GPUSERV_BF16_DP
  return gpuserv_simd::cpu_avx512bf16();
#else
  return false;
#endif
}

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

// y [T, N] = x [T, K] @ w[N, K]^T (+ bias [N]). allow_dp: bf16 may take the dot-product kernel.
at::Tensor gemv_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool allow_dp) {
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
    case at::kBFloat16:
#if GPUSERV_BF16_DP
      if (allow_dp && bf16_dp_available()) {
        const auto* wp = reinterpret_cast<const at::BFloat16*>(w.data_ptr());
        const auto* xp = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
        const auto* bp = has_bias ? reinterpret_cast<const at::BFloat16*>(bias->data_ptr()) : nullptr;
        auto* yp = reinterpret_cast<at::BFloat16*>(y.data_ptr());
        at::parallel_for(0, nblk, grain, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t r0 = b * rows_blk, r1 = std::min(N, r0 + rows_blk);
            block_dp(wp, K, xp, ldx, T_rows, bp, yp, N, r0, r1);
          }
        });
        break;
      }
#endif
      GPUSERV_GEMV_RUN(at::BFloat16);
      break;
    case at::kHalf: GPUSERV_GEMV_RUN(at::Half); break;
    default: TORCH_CHECK(false, "gemv: unsupported dtype ", x.scalar_type());
  }
#undef GPUSERV_GEMV_RUN
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return gemv_impl(x, w, bias, true);
}

at::Tensor gemv_widen(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return gemv_impl(x, w, bias, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_widen(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("bf16_dp_available() -> bool", &bf16_dp_available);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_widen", &gemv_widen);
}
