// The pieces the column-panel matmuls share (packed_gemm_f32.cpp: fp32 and bf16 panels; code_panels.h:
// 4-bit and 8-bit code panels): the register tiles over an fp32 panel slice, the arguments of a call, and the work
// split over the threads. The layout and the reasons are in packed_gemm_f32.cpp's header.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace gpuserv_panels {

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
constexpr int64_t kChunkBytes = 128 << 10;     // the least W a thread claims at once
constexpr int64_t kPfAhead = 32 << 10;         // how far past a K block's start its prefetches begin
// Rows of x (a chunk's) from which W is prefetched in software. A step's linears over SmolLM2's 30 layers,
// AVX2 tiles, 1 thread, CPU time, prefetching from 2 rows against never, alternated twice: 2 rows 20.6 /
// 21.6 ms with, 16.8 / 18.7 without; 3 rows 20.0 / 22.0 with, 22.4 / 24.9 without; 4 rows and up with.
constexpr int64_t kPrefetchRows = 3;

struct Out {
  float* y;            // the tile's first output (row m0, column 16 p)
  int64_t ldy;
  const float* bias;   // the panel's bias, or nullptr
  int ncols;           // valid columns of this panel (16 except the last panel)
  bool first, last;    // first K block: start from zero; last: add the bias
};

// The prefetches a tile issues while it runs: count consecutive 64-byte lines from at (into L2), one
// every `every` k steps from the first.
struct Pf {
  const char* at;
  int64_t count;
  int64_t every;
};

#if GPUSERV_AVX2
inline __m256i lane_mask(int n) {  // lanes [0, n) set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The panel's 16 columns at one k step, widened to fp32: w0 = columns 0-7, w1 = 8-15.
inline __attribute__((always_inline)) void load_w(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
inline __attribute__((always_inline)) void load_w(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));  // halves: c0 c8 c1 c9 ...
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One k step of the tile: a[m] += x[m * ldx] * w[0..15] for the MR rows (the panel's 16 columns in two
// registers, each x element broadcast once).
template <int MR, typename T>
inline __attribute__((always_inline)) void rank1(const float* x, int64_t ldx, const T* w, __m256* a0, __m256* a1) {
  __m256 w0, w1;
  load_w(w, w0, w1);
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    const __m256 xb = _mm256_broadcast_ss(x + m * ldx);
    a0[m] = _mm256_fmadd_ps(w0, xb, a0[m]);
    a1[m] = _mm256_fmadd_ps(w1, xb, a1[m]);
  }
}

// MR rows of x (row stride ldx, from column k0) against one panel slice w [kc][16].
template <int MR, typename T>
inline void micro(const float* __restrict x, int64_t ldx, const T* __restrict w, int64_t kc, const Out& o,
                  Pf pf) {
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
  int64_t k = 0;
  for (; pf.count > 0 && k + pf.every <= kc; --pf.count) {
    _mm_prefetch(pf.at, _MM_HINT_T1);
    pf.at += 64;
    for (int64_t j = 0; j < pf.every; ++j, ++k) rank1<MR>(x + k, ldx, w + k * kPanel, a0, a1);
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

// Column j of a panel's k step, as fp32 (bf16 panels interleave columns 0-7 with 8-15).
inline float w_at(const float* w, int j) { return w[j]; }
inline float w_at(const uint16_t* w, int j) {
  const uint32_t bits = static_cast<uint32_t>(w[j < 8 ? 2 * j : 2 * (j - 8) + 1]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The same tile in scalar code (a build without AVX2/FMA).
template <typename T>
inline void micro_scalar(int mr, const float* x, int64_t ldx, const T* w, int64_t kc, const Out& o) {
  for (int m = 0; m < mr; ++m)
    for (int j = 0; j < o.ncols; ++j) {
      float s = o.first ? 0.f : o.y[m * o.ldy + j];
      for (int64_t k = 0; k < kc; ++k) s += w_at(w + k * kPanel, j) * x[m * ldx + k];
      o.y[m * o.ldy + j] = s + (o.last && o.bias ? o.bias[j] : 0.f);
    }
}

template <typename T>
void tile(int mr, const float* x, int64_t ldx, const T* w, int64_t kc, const Out& o, Pf pf) {
#if GPUSERV_AVX2
  switch (mr) {
    case 1: micro<1>(x, ldx, w, kc, o, pf); break;
    case 2: micro<2>(x, ldx, w, kc, o, pf); break;
    case 3: micro<3>(x, ldx, w, kc, o, pf); break;
    case 4: micro<4>(x, ldx, w, kc, o, pf); break;
    case 5: micro<5>(x, ldx, w, kc, o, pf); break;
    case 6: micro<6>(x, ldx, w, kc, o, pf); break;
    case 7: micro<7>(x, ldx, w, kc, o, pf); break;
    case 8: micro<8>(x, ldx, w, kc, o, pf); break;
    case 9: micro<9>(x, ldx, w, kc, o, pf); break;
    case 10: micro<10>(x, ldx, w, kc, o, pf); break;
    case 11: micro<11>(x, ldx, w, kc, o, pf); break;
    default: micro<kMrCap>(x, ldx, w, kc, o, pf); break;
  }
#else
  (void)pf;
  micro_scalar(mr, x, ldx, w, kc, o);
#endif
}

template <typename T>
struct Call {
  const float* x;
  int64_t ldx, M, K;
  const T* w;  // [P][K][16]: fp32, or bf16 halves in column pairs
  int64_t P, N;
  const float* bias;
  float* y;    // [M, N]
  int mr_max;
};

// The work split: each thread owns a contiguous run of panel chunks and takes them front to back
// (one sequential stream of W per thread); a thread whose run is done takes chunks from the back of
// the run with the most left, as long as that run has more than the chunk its owner takes next
// (which the owner's prefetches may already have brought in). So a thread that gets its core late
// (the daemon's pool workers run at idle priority beside the event loop; a shared machine; a
// hypervisor's steal) costs the call about a chunk's time, not its whole share. Each run is
// lo | hi << 32 (chunk indices) in a cache line of its own, claimed by compare-and-swap.
class Claims {
 public:
  static constexpr int kMaxThreads = 64;

  Claims(int64_t chunks, int threads) : n_(threads) {
    for (int t = 0; t < n_; ++t)
      runs_[t].v.store(static_cast<uint64_t>(chunks * t / n_) | static_cast<uint64_t>(chunks * (t + 1) / n_) << 32,
                       std::memory_order_relaxed);
  }
  // The end of thread t's own run as it was dealt (chunk index).
  int64_t run_end(int t, int64_t chunks) const { return chunks * (t + 1) / n_; }
  // The next chunk for thread t, or -1 when none is left anywhere.
  int64_t next(int t) {
    if (const int64_t c = take(t, true); c >= 0) return c;
    for (;;) {
      int victim = -1;
      uint64_t most = 0;
      for (int v = 0; v < n_; ++v) {
        const uint64_t r = runs_[v].v.load(std::memory_order_relaxed), lo = r & 0xFFFFFFFFu, hi = r >> 32;
        if (hi > lo + 1 && hi - lo > most) most = hi - lo, victim = v;
      }
      if (victim < 0) return -1;
      if (const int64_t c = take(victim, false); c >= 0) return c;
    }
  }

 private:
  int64_t take(int v, bool front) {
    uint64_t r = runs_[v].v.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = r & 0xFFFFFFFFu, hi = r >> 32;
      if (lo + (front ? 0 : 1) >= hi) return -1;  // a thief leaves the owner its next chunk (prefetched)
      const uint64_t want = front ? (lo + 1) | hi << 32 : lo | (hi - 1) << 32;
      if (runs_[v].v.compare_exchange_weak(r, want, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? lo : hi - 1);
    }
  }
  struct alignas(64) Run {
    std::atomic<uint64_t> v;
  };
  Run runs_[kMaxThreads];
  int n_;
};

// Panels [0, P) over the threads: fn(p0, p1, own_end) for each chunk a thread takes, own_end the end of
// that thread's own run (or p1 for a chunk taken from another's run). panel_bytes: one panel's fp32 bytes
// (the work a panel is, whatever its width in memory).
template <typename F>
void split(int64_t P, int64_t panel_bytes, F&& fn) {
  const int threads = std::min<int>(at::get_num_threads(), Claims::kMaxThreads);
  if (P * panel_bytes < kParallelBytes || threads == 1 || P == 1 || at::in_parallel_region()) {
    fn(0, P, P);
    return;
  }
  // About 16 chunks a thread (the last one a late thread leaves is short), of 1-16 panels and at
  // least 128 KB of W (each chunk costs a claim and starts its stream afresh).
  const int64_t chunk = std::clamp<int64_t>(std::max(P / (16 * threads), (kChunkBytes + panel_bytes - 1) / panel_bytes),
                                            1, 16);
  const int64_t chunks = (P + chunk - 1) / chunk;
  Claims claims(chunks, threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t own_end = std::min(P, claims.run_end(static_cast<int>(t), chunks) * chunk);
      for (int64_t ch; (ch = claims.next(static_cast<int>(t))) >= 0;) {
        const int64_t p0 = ch * chunk, p1 = std::min(P, p0 + chunk);
        fn(p0, p1, p1 <= own_end ? own_end : p1);
      }
    }
  });
}

constexpr int64_t kQGroup = 32;                        // code panels: k positions per scale (and offset)
constexpr int64_t kQGroupBytes = 64 + kQGroup * 8;    // 4-bit: 16 fp16 scales, 16 fp16 offsets, 32 steps of 16 nibbles
constexpr int64_t kQ8GroupBytes = 32 + kQGroup * 16;  // 8-bit: 16 fp16 scales, 32 steps of 16 signed bytes

// y [M, N] = x @ W^T (+ bias) with W in 4-bit panels [P, K / 32, 320] (q4_panels.cpp) or 8-bit panels
// [P, K / 32, 544] (q8_panels.cpp). narrow: few rows may take code_panels.h's register-expanded path.
void run_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max,
            bool narrow);
void run_q8(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max,
            bool narrow);

}  // namespace gpuserv_panels
