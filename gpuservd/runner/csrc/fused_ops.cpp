// Small fused ops of the decoder layer, for the CPU.
//
// At decode batch sizes each of these is a handful of elementwise torch ops on
// a few hundred numbers, where dispatch and allocation cost more than the math
// (RMSNorm alone was ~10 us through torch, ~20 us for rope). One op per step of
// the layer keeps the per-layer overhead near one dispatch each.
//
// Numerics follow transformers' Llama in every dtype: math in fp32, rounded to
// the storage dtype where transformers rounds (after each elementwise op in
// bf16/fp16; a no-op for fp32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

// Keeps the compiler from contracting a rounded product and the sum it feeds into one FMA (as torch's
// separate mul and add ops round): an empty asm that the values pass through in their registers.
#if defined(__x86_64__) || defined(__i386__)
#define GPUSERV_ROUNDED(...) __asm__("" : __VA_ARGS__)
#else
#define GPUSERV_ROUNDED(...) ((void)0)
#endif

// Rows per parallel task: tiny decode batches run inline on the calling thread.
constexpr int64_t kGrainElems = 1 << 14;
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// One row: y = RMSNorm(x) * w.
template <typename T>
void rms_row(const T* xr, const T* w, T* yr, int64_t D, double eps) {
  float ss = 0.f;
  for (int64_t c = 0; c < D; ++c) {
    const float v = static_cast<float>(xr[c]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t c = 0; c < D; ++c)
    yr[c] = static_cast<T>(static_cast<float>(w[c]) * rnd<T>(static_cast<float>(xr[c]) * inv));
}

// One row of the residual add: h += d, rounded to T element by element (as torch's add).
template <typename T>
void add_row(T* h, const T* d, int64_t D) {
  for (int64_t c = 0; c < D; ++c) h[c] = static_cast<T>(static_cast<float>(h[c]) + static_cast<float>(d[c]));
}

#if GPUSERV_AVX2
// fp32 rows, 8 lanes at a time with four sums: the scalar loop's one running sum is a chain of dependent
// adds (~3 cycles an element: ~12 us of CPU for an 8 x 576 decode batch, twice a layer); this is ~10x less.
// The sum of squares is added in another order than the scalar loop's; the products are the same.
template <>
void rms_row<float>(const float* xr, const float* w, float* yr, int64_t D, double eps) {
  using namespace gpuserv_simd;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) {
    const __m256 v0 = _mm256_loadu_ps(xr + c), v1 = _mm256_loadu_ps(xr + c + 8);
    const __m256 v2 = _mm256_loadu_ps(xr + c + 16), v3 = _mm256_loadu_ps(xr + c + 24);
    a0 = _mm256_fmadd_ps(v0, v0, a0), a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2), a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  for (; c + 8 <= D; c += 8) {
    const __m256 v = _mm256_loadu_ps(xr + c);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float ss = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; c < D; ++c) ss += xr[c] * xr[c];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  const __m256 vinv = _mm256_set1_ps(inv);
  for (c = 0; c + 8 <= D; c += 8)
    _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv)));
  for (; c < D; ++c) yr[c] = w[c] * (xr[c] * inv);
}

// How much of a bf16 row of D values the 16-lane loops take: whole 16s where the CPU has AVX512_BF16
// (its vcvtneps2bf16 rounds 16 lanes to nearest even in one instruction where the 8-lane to_bf16_8 takes
// a dozen; it reads denormal inputs as zero, which a layer's activations never are), else none. bf16
// rms_norm of 296 x 576 took 110 us of one core in 8 lanes, the fp32 rows 25 us.
inline int64_t wide_bf16(int64_t D) {
#if GPUSERV_AVX512BF16
  return gpuserv_simd::cpu_avx512bf16() ? D / 16 * 16 : 0;
#else
  (void)D;
  return 0;
#endif
}

void norm_bf16(const at::BFloat16* xr, const at::BFloat16* w, at::BFloat16* yr, int64_t D, float inv, int64_t wide);

// bf16 rows, 8 lanes at a time (the scalar loops above cost ~1 ms of a 32-sequence bf16 decode step);
// the sum of squares is added in another order than the scalar loop's, the roundings are the same.
template <>
void rms_row<at::BFloat16>(const at::BFloat16* xr, const at::BFloat16* w, at::BFloat16* yr, int64_t D, double eps) {
  using namespace gpuserv_simd;
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  const int64_t wide = wide_bf16(D);
#if GPUSERV_AVX512BF16
  __m512 acc16 = _mm512_setzero_ps();
  for (; c < wide; c += 16) {
    const __m512 v = load16(xr + c);
    acc16 = _mm512_fmadd_ps(v, v, acc16);
  }
  acc = fold16(acc16);
#endif
  for (; c + 8 <= D; c += 8) {
    const __m256 v = load8(xr + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t k = c; k < D; ++k) ss += static_cast<float>(xr[k]) * static_cast<float>(xr[k]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  norm_bf16(xr, w, yr, D, inv, wide);
}

// y = w * round(x * inv) over a bf16 row (rms_row's second pass): 16 lanes with the one-instruction
// rounding up to `wide`, then 8 lanes and the tail.
void norm_bf16(const at::BFloat16* xr, const at::BFloat16* w, at::BFloat16* yr, int64_t D, float inv, int64_t wide) {
  using namespace gpuserv_simd;
  int64_t c = 0;
#if GPUSERV_AVX512BF16
  const __m512 vinv16 = _mm512_set1_ps(inv);
  for (; c < wide; c += 16)
    store16(yr + c, _mm512_mul_ps(load16(w + c), round_bf16_16(_mm512_mul_ps(load16(xr + c), vinv16))));
#endif
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; c + 8 <= D; c += 8)
    store8(yr + c, _mm256_mul_ps(load8(w + c), round_bf16(_mm256_mul_ps(load8(xr + c), vinv))));
  for (; c < D; ++c)
    yr[c] = static_cast<at::BFloat16>(static_cast<float>(w[c]) * rnd<at::BFloat16>(static_cast<float>(xr[c]) * inv));
}

#endif

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, double eps) {
  at::parallel_for(0, rows, grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row<T>(x + r * D, w, y + r * D, D, eps);
  });
}

// h += d, then y = RMSNorm(h) * w, row by row: each row's add and norm in one pass while the row is in
// L1, spread over the team as rms_rows, rather than an add over the whole batch on the calling thread
// ahead of the norm's parallel rows.
template <typename T>
void add_rms_row(T* h, const T* d, const T* w, T* y, int64_t D, double eps) {
  add_row<T>(h, d, D);
  rms_row<T>(h, w, y, D, eps);
}

#if GPUSERV_AVX2
// bf16: the add in vectors, its rounded sums squared as they are stored (one pass fewer over the row than
// add_row + rms_row); the same roundings as the scalar loops, the sum of squares in rms_row's order.
template <>
void add_rms_row<at::BFloat16>(at::BFloat16* h, const at::BFloat16* d, const at::BFloat16* w, at::BFloat16* y,
                               int64_t D, double eps) {
  using namespace gpuserv_simd;
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  const int64_t wide = wide_bf16(D);
#if GPUSERV_AVX512BF16
  __m512 acc16 = _mm512_setzero_ps();
  for (; c < wide; c += 16) {
    const __m512 v = round_bf16_16(_mm512_add_ps(load16(h + c), load16(d + c)));
    store16(h + c, v);
    acc16 = _mm512_fmadd_ps(v, v, acc16);
  }
  acc = fold16(acc16);
#endif
  for (; c + 8 <= D; c += 8) {
    const __m256 v = round_bf16(_mm256_add_ps(load8(h + c), load8(d + c)));
    store8(h + c, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t k = c; k < D; ++k) {
    h[k] = static_cast<at::BFloat16>(static_cast<float>(h[k]) + static_cast<float>(d[k]));
    ss += static_cast<float>(h[k]) * static_cast<float>(h[k]);
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  norm_bf16(h, w, y, D, inv, wide);
}
#endif

template <typename T>
void add_rms_rows(T* h, const T* d, const T* w, T* y, int64_t rows, int64_t D, double eps) {
  at::parallel_for(0, rows, grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) add_rms_row<T>(h + r * D, d + r * D, w, y + r * D, D, eps);
  });
}

#define GPUSERV_DISPATCH(dtype, NAME, ...)                                       \
  switch (dtype) {                                                               \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }             \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }   \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }           \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);             \
  }

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name, ": x must be a contiguous CPU [T, D]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              name, ": weight must be [D] of x's dtype");
}

// y = RMSNorm(x) * w for x [T, D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto y = at::empty_like(x);
  GPUSERV_DISPATCH(x.scalar_type(), "rms_norm",
                   rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                      x.size(0), x.size(1), eps));
  return y;
}

// h += delta (in place: h is the residual stream), then y = RMSNorm(h) * w.
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_rows(h, w, "add_rms_norm_");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.is_contiguous() && delta.scalar_type() == h.scalar_type(),
              "add_rms_norm_: delta must match h");
  auto y = at::empty_like(h);
  GPUSERV_DISPATCH(h.scalar_type(), "add_rms_norm_",
                   add_rms_rows<scalar_t>(h.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                          y.data_ptr<scalar_t>(), h.size(0), h.size(1), eps));
  return y;
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float x = static_cast<float>(gate[c]);
    const float s = rnd<T>(x / (1.f + std::exp(-x)));
    out[c] = static_cast<T>(s * static_cast<float>(up[c]));
  }
}

#if GPUSERV_AVX2
template <>
void silu_mul_row<float>(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(gate + c);
    const __m256 e = gpuserv_simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + c)));
  }
  for (; c < n; ++c) out[c] = gate[c] / (1.f + std::exp(-gate[c])) * up[c];
}

// bf16: the same rounding as the scalar loop (silu rounded to bf16, then the product), 8 lanes at a
// time; exp8 instead of std::exp can move a result by one bf16 ulp where the fp32 value lies on a
// rounding boundary. Scalar, this was ~10% of a 32-sequence bf16 decode step.
template <>
void silu_mul_row<at::BFloat16>(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t n) {
  using namespace gpuserv_simd;
  int64_t c = 0;
#if GPUSERV_AVX512BF16
  // 16 lanes with the one-instruction bf16 rounding where the CPU has AVX512_BF16: the 8-lane loop
  // below ran at ~1 Gelem/s on 2 cores, ~6% of a 256-token bf16 prefill step.
  if (cpu_avx512bf16()) {
    const __m512 one16 = _mm512_set1_ps(1.f);
    for (; c + 16 <= n; c += 16) {
      const __m512 x = load16(gate + c);
      const __m512 s = round_bf16_16(_mm512_div_ps(x, _mm512_add_ps(one16, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      store16(out + c, _mm512_mul_ps(s, load16(up + c)));
    }
  }
#endif
  const __m256 one = _mm256_set1_ps(1.f);
  for (; c + 8 <= n; c += 8) {
    const __m256 x = load8(gate + c);
    const __m256 s = round_bf16(_mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
    store8(out + c, _mm256_mul_ps(s, load8(up + c)));
  }
  for (; c < n; ++c) {
    const float x = static_cast<float>(gate[c]);
    out[c] = static_cast<at::BFloat16>(rnd<at::BFloat16>(x / (1.f + std::exp(-x))) * static_cast<float>(up[c]));
  }
}
#endif

// gate_up [T, 2I] (gate then up, as the fused projection lays them out) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0 && gu.device().is_cpu(),
              "silu_mul: gate_up must be a contiguous CPU [T, 2I]");
  const int64_t rows = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({rows, I}, gu.options());
  GPUSERV_DISPATCH(gu.scalar_type(), "silu_mul", {
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(g + r * 2 * I, g + r * 2 * I + I, o + r * I, I);
    });
  });
  return out;
}

// One fp32 head rotated 8 lanes at a time (the scalar loop below was ~4 us of a 48-row rope_store_kv per
// layer's q+k heads); the same products and sum as the scalar loop (x * cos and the rotated half times
// sin, each rounded, then added; no FMA), so the result is the same bit for bit. Returns false where it
// does not apply (other dtypes, half not a multiple of 8): the scalar loop does the head.
template <typename T>
inline bool rope_head_fast(T*, const T*, const T*, int64_t) { return false; }

#if GPUSERV_AVX2
template <>
inline bool rope_head_fast<float>(float* xh, const float* ct, const float* st, int64_t half) {
  if (half % 8 != 0) return false;
  for (int64_t c = 0; c < half; c += 8) {
    const __m256 x1 = _mm256_loadu_ps(xh + c), x2 = _mm256_loadu_ps(xh + c + half);
    __m256 a1 = _mm256_mul_ps(x1, _mm256_loadu_ps(ct + c)), b1 = _mm256_mul_ps(x2, _mm256_loadu_ps(st + c));
    __m256 a2 = _mm256_mul_ps(x2, _mm256_loadu_ps(ct + c + half)), b2 = _mm256_mul_ps(x1, _mm256_loadu_ps(st + c + half));
    GPUSERV_ROUNDED("+x"(a1), "+x"(b1), "+x"(a2), "+x"(b2));
    const __m256 lo = _mm256_sub_ps(a1, b1), hi = _mm256_add_ps(a2, b2);
    _mm256_storeu_ps(xh + c, lo);
    _mm256_storeu_ps(xh + c + half, hi);
  }
  return true;
}

// bf16: the scalar loop's roundings 8 lanes at a time (each product rounded to bf16, their sum rounded
// on the store), so the result is the same bit for bit. SmolLM2's 48-row rope_store_kv took 124 us of
// one core with the scalar loop, 25 us with this (~3 ms of CPU a 48-row bf16 decode step, ~3% of it).
template <>
inline bool rope_head_fast<at::BFloat16>(at::BFloat16* xh, const at::BFloat16* ct, const at::BFloat16* st,
                                         int64_t half) {
  using namespace gpuserv_simd;
  if (half % 8 != 0) return false;
  for (int64_t c = 0; c < half; c += 8) {
    const __m256 x1 = load8(xh + c), x2 = load8(xh + c + half);
    const __m256 a1 = round_bf16(_mm256_mul_ps(x1, load8(ct + c))), b1 = round_bf16(_mm256_mul_ps(x2, load8(st + c)));
    const __m256 a2 = round_bf16(_mm256_mul_ps(x2, load8(ct + c + half)));
    const __m256 b2 = round_bf16(_mm256_mul_ps(x1, load8(st + c + half)));
    // a1 - b1: the scalar loop adds the product of the negated half, which is -b1 exactly
    store8(xh + c, _mm256_sub_ps(a1, b1));
    store8(xh + c + half, _mm256_add_ps(a2, b2));
  }
  return true;
}
#endif

// qkv [T, H + 2 KVH, D]: rotate the q and k heads in place (rotate-half rope with cos/sin [T, D]),
// then store k and v of token t at flat cache slot slots[t] of k_cache / v_cache [N, bs, KVH, D]
// (slot -1: nowhere).
void rope_store_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.device().is_cpu(), "rope_store_kv: qkv must be contiguous");
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2;
  const int64_t rot = num_heads + num_kv_heads;
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * num_kv_heads && D % 2 == 0, "rope_store_kv: qkv heads mismatch");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: cos/sin must be contiguous [T, D] of qkv's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: caches must be contiguous [N, bs, KVH, D] of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "rope_store_kv: slots must be int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Slot -1: a padding row of a fixed-shape batch, rotated but stored nowhere.
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= -1 && sp[t] < num_slots, "rope_store_kv: slot out of range");
  GPUSERV_DISPATCH(qkv.scalar_type(), "rope_store_kv", {
    scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sn = sin.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t row = qkv.size(1) * D, kv_row = num_kv_heads * D;
    at::parallel_for(0, T, grain(row), [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(D);
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* ct = cp + t * D;
        const scalar_t* st = sn + t * D;
        for (int64_t h = 0; h < rot; ++h) {
          scalar_t* xh = x + t * row + h * D;
          if (rope_head_fast(xh, ct, st, half)) continue;
          for (int64_t c = 0; c < D; ++c) buf[c] = static_cast<float>(xh[c]);
          for (int64_t c = 0; c < D; ++c) {
            const float r = c < half ? -buf[c + half] : buf[c - half];
            float a = rnd<scalar_t>(buf[c] * static_cast<float>(ct[c]));
            float b = rnd<scalar_t>(r * static_cast<float>(st[c]));
            GPUSERV_ROUNDED("+x"(a), "+x"(b));
            xh[c] = static_cast<scalar_t>(a + b);
          }
        }
        if (sp[t] < 0) continue;
        std::memcpy(kc + sp[t] * kv_row, x + t * row + num_heads * D, kv_row * sizeof(scalar_t));
        std::memcpy(vc + sp[t] * kv_row, x + t * row + rot * D, kv_row * sizeof(scalar_t));
      }
    });
  });
}

}  // namespace

// The index of each row's largest value, as torch.argmax(x, -1): the first one on ties, the first NaN
// if the row has one. torch's CPU argmax read SmolLM2's [64, 49152] fp32 logits at ~2 GB/s (1.5 ms
// of a decode step); this is one vectorized max pass and one compare pass that stops at the hit.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
#if GPUSERV_AVX2
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(x);
    int nan = 0;
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vm = _mm256_max_ps(vm, v);
    }
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x), _CMP_UNORD_Q));
    float m = gpuserv_simd::hmax(vm);
    for (int64_t j = i; j < n; ++j) {
      nan |= std::isnan(x[j]);
      m = std::max(m, x[j]);
    }
    if (!nan) {
      const __m256 vmax = _mm256_set1_ps(m);
      int64_t k = 0;
      for (; k + 8 <= n; k += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), vmax, _CMP_EQ_OQ));
        if (hit) return k + __builtin_ctz(hit);
      }
      for (; k < n; ++k)
        if (x[k] == m) return k;
    }
    i = 0;  // a NaN somewhere: the scalar loop below finds the first one
  }
#endif
  int64_t best = 0;
  for (i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  x.size(1) > 0,
              "argmax_rows: x must be a contiguous, non-empty fp32 CPU [S, V]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, int num_heads, int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_store_kv", &rope_store_kv);
}
