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
// held as those codes, 5 bits a weight instead of 32 (q4_panels.cpp finds and checks them at load and
// runs the matmul on them). Per panel and group of 32 k: 16 fp16 scales, 16 fp16 offsets, then 32 k
// steps of 16 nibbles (column j in byte j % 8, low nibble for j < 8). Each K block is expanded into an
// L1 buffer of fp32 panel (one FMA a value: q * d is exact in fp32, so q * d + m rounds once, as the
// dequantisation did) and the fp32 tiles run over it; at 1-4 rows the codes of several panels are
// expanded in registers instead, side by side. Bit-identical results either way, and at the 1-8 rows
// of a decode tail, where a step is a pass over the weights, a seventh of the bytes. 8-bit panels hold a
// weight that is exactly q * d per 32 input positions (GGUF's Q8_0: the store's SmolLM2 embedding and
// tied LM head) the same way (q8_panels.cpp, 8.5 bits a weight; in registers up to 8 rows); both
// formats run through code_panels.h.
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

#include "packed_tiles.h"

namespace {

using namespace gpuserv_panels;

// Whether this library has the vector kernel. Without AVX2/FMA (another architecture, or an old
// x86) the scalar tile still computes correct results, but oneDNN / F.linear on the dense weight are
// far faster there, so Linear keeps that layout.
bool packed_f32_available() { return GPUSERV_AVX2 != 0; }

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

// y [M, N] = x [M, K] @ W^T (+ bias [N]); packed = W in column panels [ceil(N/16), K, 16], fp32 or
// (a bf16-exact W, from pack_panels_bf16) bf16 halves.
// tile_rows: the register tile's height (0: this build's own, and code panels' narrow path at few rows;
// 1-12 for tests of every tile).
// into: where to write y (packed_linear_f32_out: a buffer reused step after step), else a new tensor.
at::Tensor packed_linear_f32_into(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                  const std::optional<at::Tensor>& bias, int64_t tile_rows, const at::Tensor* into) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear_f32: CPU tensors only");
  const bool codes = packed.scalar_type() == at::kByte;
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16 || codes),
              "packed_linear_f32: fp32 x and an fp32, bf16 or 4-/8-bit (uint8) panel weight only");
  const bool q8 = codes && packed.dim() == 3 && packed.size(2) == kQ8GroupBytes;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (codes ? packed.size(2) == kQGroupBytes || q8 : packed.size(2) == kPanel),
              "packed_linear_f32: weight must be a contiguous panel tensor [P, K, 16] (4-bit: [P, K / 32, ",
              kQGroupBytes, "], 8-bit: [P, K / 32, ", kQ8GroupBytes, "]), got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear_f32: x must be [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  const int64_t packed_k = codes ? packed.size(1) * kQGroup : packed.size(1);
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
  if (q8)
    run_q8(x, packed, N, b, y, mr, tile_rows == 0);
  else if (codes)
    run_q4(x, packed, N, b, y, mr, tile_rows == 0);
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
