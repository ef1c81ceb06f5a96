#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
// Pure reads of a pair-panel tensor [P, K2, 32] bf16, 2 threads split by groups of 3 panels as packed_linear does.
// mode 0: each thread's range as one flat stream (4 accumulators); 1: the kernel's order (3 panels side by side per
// pair step, one accumulator per panel).
double rd(const at::Tensor& packed, int64_t mode) {
  const int64_t P = packed.size(0), K2 = packed.size(1);
  const __m512* w = reinterpret_cast<const __m512*>(packed.data_ptr());
  const int64_t groups = (P + 2) / 3;
  std::vector<double> part(64, 0.0);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const int64_t p0 = g0 * 3, p1 = std::min(P, g1 * 3);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (mode == 0) {
      const __m512* s = w + p0 * K2; const int64_t n = (p1 - p0) * K2;
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) { a0 = _mm512_add_ps(a0, s[i]); a1 = _mm512_add_ps(a1, s[i+1]); a2 = _mm512_add_ps(a2, s[i+2]); a3 = _mm512_add_ps(a3, s[i+3]); }
      for (; i < n; ++i) a0 = _mm512_add_ps(a0, s[i]);
    } else {
      for (int64_t p = p0; p < p1; p += 3) {
        const int64_t nv = std::min<int64_t>(3, p1 - p);
        const __m512* s = w + p * K2;
        for (int64_t kk = 0; kk < K2; ++kk) {
          a0 = _mm512_add_ps(a0, s[kk]);
          if (nv > 1) a1 = _mm512_add_ps(a1, s[K2 + kk]);
          if (nv > 2) a2 = _mm512_add_ps(a2, s[2 * K2 + kk]);
        }
      }
    }
    part[at::get_thread_num()] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  });
  double t = 0; for (double x : part) t += x; return t;
}
TORCH_LIBRARY_FRAGMENT(gprd, m) { m.def("rd(Tensor p, int mode) -> float", &rd); }
