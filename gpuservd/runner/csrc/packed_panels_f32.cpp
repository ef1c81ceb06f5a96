// The column-panel layouts of packed_gemm_f32.cpp, built once per weight at load:
//
//     fp32:  packed[p][k][j] = W[16 p + j][k]                       (64 bytes a k step)
//     bf16:  packed[p][k][2 i] = hi16(W[16 p + i][k]), packed[p][k][2 i + 1] = hi16(W[16 p + 8 + i][k])
//
// (p: panel, j < 16, i < 8; out padded with zero rows). The bf16 form holds the high halves of a
// weight whose low halves are all zero (bf16_exact), so widening a half back is exact; its column
// order lets the kernel widen 16 halves with one shift and one mask (columns 0-7, then 8-15).
//
// Memory: a decode step streams every panel from DRAM once, 4 KB pages are one TLB miss every 64
// lines, and the hardware prefetchers stop at each page's end. So panels live in mappings aligned
// to 2 MB and marked MADV_HUGEPAGE: where transparent huge pages are enabled (even "madvise" only)
// the kernel backs them with 2 MB pages. Elsewhere (THP "never", no free huge page) the hint is
// ignored and the mapping stays ordinary anonymous memory, with the same contents. A panel tensor
// of 2 MB or more gets a mapping of its own; the layers' smaller ones (a SmolLM2 layer's four are
// 0.66-3.5 MB in bf16) are packed side by side into shared blocks from huge_empty (runner/
// panel_arena.py), since a mapping of their own covers whole huge pages only where it holds them.
// huge_pages=false keeps torch's allocator (the A/B reference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

constexpr int64_t kPanel = 16;                 // output columns per panel
constexpr size_t kHuge = size_t(2) << 20;      // a transparent huge page
constexpr size_t kPage = size_t(4) << 10;

std::atomic<int64_t> g_mapped{0};  // bytes in huge_map's mappings still alive (panel_mapped_bytes)

// An uninitialised mapping of at least `bytes`, 2 MB-aligned and marked MADV_HUGEPAGE, as a
// uint8 tensor that unmaps it when its storage dies; its length is rounded to 4 KB, or to 2 MB with
// whole_pages (every byte of it then on huge pages where the kernel gives them). Where the mapping
// cannot be made (no memory for it), torch's allocator: ordinary pages, the same contents.
at::Tensor huge_map(size_t bytes, bool whole_pages) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  const size_t unit = whole_pages ? kHuge : kPage;
  const size_t len = std::max<size_t>(unit, (bytes + unit - 1) / unit * unit);
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::empty({static_cast<int64_t>(bytes)}, options);
  // Keep the 2 MB-aligned part [start, start + len) and hand the slack on either side back.
  char* base = static_cast<char*>(raw);
  char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
  if (start > base) munmap(base, start - base);
  const size_t tail = (base + len + kHuge) - (start + len);
  if (tail) munmap(start + len, tail);
  madvise(start, len, MADV_HUGEPAGE);  // a hint: refused (no THP in this kernel) it changes nothing
  g_mapped += static_cast<int64_t>(len);
  return at::from_blob(start, {static_cast<int64_t>(len)}, [len](void* p) {
    munmap(p, len);
    g_mapped -= static_cast<int64_t>(len);
  }, options);
}

// An uninitialised [P, K, 16] tensor of dtype: in a mapping of its own (huge_map) when it fills at
// least one huge page (and huge_pages), else from torch's allocator.
at::Tensor panel_tensor(int64_t P, int64_t K, at::ScalarType dtype, bool huge_pages) {
  const size_t bytes = static_cast<size_t>(P * K * kPanel) * c10::elementSize(dtype);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (bytes < kHuge || !huge_pages) return at::empty({P, K, kPanel}, options);
  return huge_map(bytes, false).narrow(0, 0, static_cast<int64_t>(bytes)).view(dtype).view({P, K, kPanel});
}

// A block for panel tensors packed side by side (runner/panel_arena.py): `bytes` rounded up to whole
// 2 MB pages. The block's storage, shared by every tensor cut from it, unmaps it when the last dies.
at::Tensor huge_empty(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "huge_empty: bytes must be positive");
  return huge_map(static_cast<size_t>(bytes), true);
}

int64_t panel_mapped_bytes() { return g_mapped.load(); }

// A contiguous copy of t (any strides: the bf16 pair panels of packed_gemm.cpp are a permuted view of
// W that runner/linear.py hands in, so this is their one copy), in a huge-page mapping as panel_tensor's
// when it fills one: a decode step at 8 rows streamed SmolLM2's pair panels in 11.4-12.3 ms instead of
// 14.2-17.2 (2 threads, alternated).
at::Tensor huge_copy(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "huge_copy: a CPU tensor only");
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (bytes < kHuge) return t.clone(at::MemoryFormat::Contiguous);
  auto out = huge_map(bytes, false).narrow(0, 0, static_cast<int64_t>(bytes)).view(t.scalar_type()).view(t.sizes());
  out.copy_(t);
  return out;
}

// Whether every value of an fp32 tensor is exactly a bf16 (its low 16 bits are zero), so its bf16
// panels give the same products as fp32 ones. Stops at the first value that is not.
bool bf16_exact(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat, "bf16_exact: an fp32 CPU tensor only");
  const at::Tensor wc = w.contiguous();
  const auto* bits = static_cast<const uint32_t*>(wc.data_ptr());
  const int64_t n = wc.numel();
  constexpr int64_t kChunk = 4096;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    uint32_t low = 0;
    const int64_t i1 = std::min(n, i0 + kChunk);
    for (int64_t i = i0; i < i1; ++i) low |= bits[i] & 0xFFFFu;  // vectorised: no early exit inside a chunk
    if (low) return false;
  }
  return true;
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


// `out` of pack_panels_*_into: the panel tensor [P, K, 16] of dtype, contiguous.
const at::Tensor& checked_out(const at::Tensor& out, int64_t P, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == dtype && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({P, K, kPanel}),
              "pack_panels: out must be a contiguous ", dtype, " CPU tensor [", P, ", ", K, ", ", kPanel, "], got ",
              out.scalar_type(), " ", out.sizes());
  return out;
}

// W [N, K] fp32 -> column panels [ceil(N/16), K, 16], zero padded: once per weight at load. It
// transposes 8 x 8 blocks in registers and writes each panel front to back: 1.7x torch's permuted
// copy on a 3072 x 576 weight (1 thread); on large weights both are bound by the first-touch page
// faults of the new tensor.
// out: where to write them (a tensor cut from a shared block), else a new panel_tensor.
at::Tensor pack_f32(const at::Tensor& w, bool huge_pages, const at::Tensor* into) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "pack_panels_f32: W must be an fp32 [out, in] CPU tensor");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kPanel - 1) / kPanel;
  auto out = into ? checked_out(*into, P, K, at::kFloat) : panel_tensor(P, K, at::kFloat, huge_pages);
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


// W [N, K] fp32, every value bf16-exact -> bf16 column panels [ceil(N/16), K, 16] (layout above),
// zero padded. Refuses a W with a value that is not exactly a bf16: its panels would round it.
at::Tensor pack_bf16(const at::Tensor& w, bool huge_pages, const at::Tensor* into) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "pack_panels_bf16: W must be an fp32 [out, in] CPU tensor");
  TORCH_CHECK(bf16_exact(w), "pack_panels_bf16: W has values that are not exactly bf16 (low 16 bits set); "
              "pack it with pack_panels_f32");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kPanel - 1) / kPanel;
  auto out = into ? checked_out(*into, P, K, at::kBFloat16) : panel_tensor(P, K, at::kBFloat16, huge_pages);
  const auto* src = static_cast<const uint32_t*>(wc.data_ptr());
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, K * kPanel * 2));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* panel = dst + p * K * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {  // column j of the panel: one row of W, read in order
        const int64_t n = p * kPanel + j;
        const int64_t pos = j < 8 ? 2 * j : 2 * (j - 8) + 1;
        if (n >= N) {
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + pos] = 0;
          continue;
        }
        const uint32_t* row = src + n * K;
        for (int64_t k = 0; k < K; ++k) panel[k * kPanel + pos] = static_cast<uint16_t>(row[k] >> 16);
      }
    }
  });
  return out;
}

at::Tensor pack_panels_f32(const at::Tensor& w, bool huge_pages) { return pack_f32(w, huge_pages, nullptr); }
at::Tensor pack_panels_bf16(const at::Tensor& w, bool huge_pages) { return pack_bf16(w, huge_pages, nullptr); }
void pack_panels_f32_into(const at::Tensor& w, const at::Tensor& out) { pack_f32(w, false, &out); }
void pack_panels_bf16_into(const at::Tensor& w, const at::Tensor& out) { pack_bf16(w, false, &out); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(gpuserv, m) {
  m.def("pack_panels_f32(Tensor w, bool huge_pages=True) -> Tensor");
  m.def("pack_panels_bf16(Tensor w, bool huge_pages=True) -> Tensor");
  m.def("bf16_exact(Tensor w) -> bool");
  m.def("huge_copy(Tensor t) -> Tensor");
  m.def("pack_panels_f32_into(Tensor w, Tensor(a!) out) -> ()");
  m.def("pack_panels_bf16_into(Tensor w, Tensor(a!) out) -> ()");
  m.def("huge_empty(int bytes) -> Tensor", &huge_empty);  // no tensor argument to dispatch on
  m.def("panel_mapped_bytes() -> int", &panel_mapped_bytes);
}

TORCH_LIBRARY_IMPL(gpuserv, CPU, m) {
  m.impl("pack_panels_f32", &pack_panels_f32);
  m.impl("pack_panels_bf16", &pack_panels_bf16);
  m.impl("bf16_exact", &bf16_exact);
  m.impl("huge_copy", &huge_copy);
  m.impl("pack_panels_f32_into", &pack_panels_f32_into);
  m.impl("pack_panels_bf16_into", &pack_panels_bf16_into);
}
