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
// Work split: each thread owns a contiguous run of panels (dealt in chunks; a thread done early
// takes chunks from the back of another's run, see Claims), so it streams its share of W from DRAM
// as one sequential run, and prefetches the next lines of it into L2 while it computes on the
// current ones. Except below kPrefetchRows
// rows: a tile needs only 2-4 FMAs a 64-byte line, far below what the core
// can do, so the hardware prefetcher alone keeps the one sequential stream at
// the read rate, and the software prefetches only took load slots and miss
// buffers (on the 2-core EPYC, 1 thread, process CPU time, min of 15 alternated
// passes over SmolLM2's qkv, down, gate_up and LM head: without them a 1-row
// call took 0.89-0.92x the time, 1.03-1.04x a plain sum over the same bytes;
// at 4-48 rows the prefetches save 5-25%). Within a range:
// chunks of up to kMc rows of x (kept in L2), panel by panel, and when
// a chunk has more than one row block, blocks of kKc input positions (a 16 KB
// slice of the panel stays in L1 while every row block passes over it; the
// accumulators go to y between K blocks). Either way W is read front to back.
//
// bf16 panels: a weight whose every value is exactly a bf16 (its fp32 low 16 bits are zero, as in a
// checkpoint published in bf16 and served in fp32) may be held as its high halves, 32 bytes a k step
// instead of 64 (packed_panels_f32.cpp builds them). A k step loads the 16 halves at once and widens
// them in two integer ops (even halves: columns 0-7, odd halves: 8-15; shifting a half into the high
// 16 bits of a zero word gives back the exact fp32), so the FMAs see the same operands in the same
// order as with fp32 panels: bit-identical results from half the bytes.
//
// 4-bit panels: a weight whose every group of 32 input positions of a row is exactly q * d + m (q in
// 0..15, d and m fp16: GGUF's Q4_1 dequantised to fp32, as the store's SmolLM2 projections are) may be
// held as those codes (q4_panels.cpp finds and checks them at load), 5 bits a weight instead of 32. Per
// panel and group of 32 k: 16 fp16 scales, 16 fp16 offsets, then 32 k steps of 16 nibbles (column j in
// byte j % 8, low nibble for j < 8). Each K block is expanded into an L1 buffer of fp32 panel (one FMA
// a value: q * d is exact in fp32, so q * d + m rounds once, as the dequantisation did) and the fp32
// tiles run over it: bit-identical results, and at the 1-8 rows of a decode tail, where a step is a
// pass over the weights, a seventh of the bytes.
//
// Numerics: fp32 products and fp32 accumulation along k in order within a K
// block; the bias is added once at the end. The summation order differs from
// MKL's, so results agree with torch to rounding (relative ~1e-6).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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
// The prefetches a tile issues while it runs: count consecutive 64-byte lines from at (into L2), one
// every `every` k steps from the first.
struct Pf {
  const char* at;
  int64_t count;
  int64_t every;
};

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

// Whether this library has the vector kernel. Without AVX2/FMA (another architecture, or an old
// x86) the scalar tile still computes correct results, but oneDNN / F.linear on the dense weight are
// far faster there, so Linear keeps that layout.
bool packed_f32_available() { return GPUSERV_AVX2 != 0; }

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

// Panels [p0, p1) against all rows of x. Panel by panel, and within a panel K block by K block,
// so W is read front to back (one sequential stream per thread) and each K block's slice is
// prefetched while the one before it is computed (never past w_end).
template <typename T>
void panels(const Call<T>& c, int64_t p0, int64_t p1, const char* w_end) {
  constexpr int64_t kStepBytes = kPanel * sizeof(T);  // one k step of a panel: 64 B fp32, 32 B bf16
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
        const T* wp = c.w + (p * c.K + k0) * kPanel;
        // As many lines of W as this K block reads, kPfAhead bytes past its start (on every chunk:
        // past the first, a W larger than the caches comes from DRAM again), shared out over the row
        // blocks; one row block runs over all of K at once and fetches the next panel. A fixed
        // distance, not "the next K block": after a short last block of a panel (K = 576: 256, 256,
        // 64) that one began 4 KB ahead, too late to arrive in time, and the 8-row step ran 15-20%
        // slower (1 thread, AVX2 tiles; 8 KB ahead was as slow, 16-64 KB level).
        const char* next = nb == 1 ? reinterpret_cast<const char*>(wp + kc * kPanel)
                                   : reinterpret_cast<const char*>(wp) + kPfAhead;
        const int64_t lines = rows < kPrefetchRows ? 0
            : std::max<int64_t>(0, std::min<int64_t>((kc * kStepBytes + 63) / 64, (w_end - next) / 64));
        o.first = k0 == 0;
        o.last = k0 + kc == c.K;
        int64_t m = mc0;
        // Each row block issues its share evenly over its k steps, so the prefetches go out at about
        // the rate the tiles consume W.
        const int64_t share = (lines + nb - 1) / nb;
        const int64_t every = share ? std::max<int64_t>(1, kc / share) : 1;
        for (int64_t b = 0; b < nb; ++b) {
          const int mr = static_cast<int>(base + (b < extra ? 1 : 0));
          o.y = c.y + m * c.N + p * kPanel;
          const Pf pf{next + b * share * 64, std::max<int64_t>(0, std::min(share, lines - b * share)), every};
          tile(mr, c.x + m * c.ldx + k0, c.ldx, wp, kc, o, pf);
          m += mr;
        }
      }
    }
  }
}

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

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const Call<T> c{x.data_ptr<float>(), x.stride(0), M, K, static_cast<const T*>(packed.data_ptr()), P, N,
                  bias, y.data_ptr<float>(), mr_max};
  const auto at_panel = [&](int64_t p) { return reinterpret_cast<const char*>(c.w + p * K * kPanel); };
  // In its own run a thread's prefetches run on into its next chunk; a taken one stands alone.
  split(P, K * kPanel * static_cast<int64_t>(sizeof(T)),
        [&](int64_t p0, int64_t p1, int64_t own_end) { panels(c, p0, p1, at_panel(own_end)); });
}

constexpr int64_t kQGroup = 32;                      // k positions per scale and offset
constexpr int64_t kQGroupBytes = 64 + kQGroup * 8;  // 16 fp16 scales, 16 fp16 offsets, 32 steps of 16 nibbles

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
    // Byte j of a k step holds column j (low nibble) and column j + 8 (high nibble). The step's 8 bytes go
    // to every quadword (one broadcast load), one shuffle within each 128-bit half puts byte j alone in
    // 32-bit lane j, and then column j is a mask away and column j + 8 a shift: 8 instructions a step where
    // unpacking each half with its own zero-extension took 11, and the expansion is most of a narrow
    // step's linear time.
    const __m256i spread = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int64_t kk = 0; kk < kQGroup; ++kk, out += kPanel) {
      int64_t bits;
      std::memcpy(&bits, blk + 64 + 8 * kk, 8);
      const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi64x(bits), spread);
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
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

void run_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias, at::Tensor& y, int mr_max) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const Call<float> c{x.data_ptr<float>(), x.stride(0), M, K, nullptr, P, N, bias, y.data_ptr<float>(), mr_max};
  const auto* q = packed.data_ptr<uint8_t>();
  split(P, K * kPanel * static_cast<int64_t>(sizeof(float)),
        [&](int64_t p0, int64_t p1, int64_t) { panels_q4(c, q, p0, p1); });
}

// y [M, N] = x [M, K] @ W^T (+ bias [N]); packed = W in column panels [ceil(N/16), K, 16], fp32 or
// (a bf16-exact W, from pack_panels_bf16) bf16 halves.
// tile_rows: the register tile's height (0: this build's own; 1-12 for tests of every tile).
// into: where to write y (packed_linear_f32_out: a buffer reused step after step), else a new tensor.
at::Tensor packed_linear_f32_into(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                  const std::optional<at::Tensor>& bias, int64_t tile_rows, const at::Tensor* into) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear_f32: CPU tensors only");
  const bool q4 = packed.scalar_type() == at::kByte;
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16 || q4),
              "packed_linear_f32: fp32 x and an fp32, bf16 or 4-bit (uint8) panel weight only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == (q4 ? kQGroupBytes : kPanel) && packed.is_contiguous(),
              "packed_linear_f32: weight must be a contiguous panel tensor [P, K, 16] (4-bit: [P, K / 32, ",
              kQGroupBytes, "]), got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear_f32: x must be [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const int64_t packed_k = q4 ? packed.size(1) * kQGroup : packed.size(1);
  TORCH_CHECK(packed_k == K && N > 0 && (N + kPanel - 1) / kPanel == P,
              "packed_linear_f32: x is [", M, ", ", K, "] but the weight packs [", N, ", ", packed_k, "]");
  TORCH_CHECK(tile_rows >= 0 && tile_rows <= kMrCap, "packed_linear_f32: tile_rows must be 0-", kMrCap);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N && bias->scalar_type() == at::kFloat,
                "packed_linear_f32: bias must be a contiguous fp32 [", N, "]");
  if (into)
    TORCH_CHECK(into->device().is_cpu() && into->scalar_type() == at::kFloat && into->is_contiguous() &&
                    into->sizes() == at::IntArrayRef({M, N}),
                "packed_linear_f32_out: out must be a contiguous fp32 [", M, ", ", N, "]");
  auto y = into ? *into : at::empty({M, N}, x.options());
  if (M == 0 || K == 0) return K == 0 && M ? (has_bias ? y.copy_(bias->expand({M, N})) : y.zero_()) : y;
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  const int mr = tile_rows ? static_cast<int>(tile_rows) : kMr;
  if (q4)
    run_q4(x, packed, N, b, y, mr);
  else if (packed.scalar_type() == at::kFloat)
    run<float>(x, packed, N, b, y, mr);
  else
    run<uint16_t>(x, packed, N, b, y, mr);
  return y;
}

at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias, int64_t tile_rows) {
  return packed_linear_f32_into(x, packed, N, bias, tile_rows, nullptr);
}

void packed_linear_f32_out(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  packed_linear_f32_into(x, packed, N, bias, 0, &out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("packed_linear_f32(Tensor x, Tensor packed, int n, Tensor? bias, int tile_rows=0) -> Tensor");
  m.def("packed_linear_f32_out(Tensor x, Tensor packed, int n, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("packed_f32_available() -> bool", &packed_f32_available);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) {
  m.impl("packed_linear_f32", &packed_linear_f32);
  m.impl("packed_linear_f32_out", &packed_linear_f32_out);
}
