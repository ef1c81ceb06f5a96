// Does prefetching the next layer's KV during the current layer's matmuls let the attention read it from
// cache? side MODE B CTX ITERS: per layer, a matmul-like loop (6 rows x 16 columns register tile over 576,
// operands in L1/L2, ITERS passes) then the fp32 attention item over that layer's cache; 30 layers' caches
// in turn. MODE 0: no side prefetch; 1: the next layer's K and V lines spread over the matmul (T0);
// 2: the same with NTA; 3: attention only; 4: matmul only.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "attention_f32.h"
using namespace gpuserv_attn;

struct Side {  // the lines still to prefetch: [p, end)
  const char* p = nullptr; const char* end = nullptr;
};

template <int HINT>
__attribute__((noinline)) float matmul_like(const float* A, const float* B, int64_t iters, Side* side, int64_t per_iter) {
  __m256 acc[6][2];
  for (auto& r : acc) r[0] = r[1] = _mm256_setzero_ps();
  for (int64_t it = 0; it < iters; ++it) {
    for (int64_t k = 0; k < 576; ++k) {
      const __m256 b0 = _mm256_loadu_ps(B + k * 16), b1 = _mm256_loadu_ps(B + k * 16 + 8);
      for (int r = 0; r < 6; ++r) {
        const __m256 a = _mm256_broadcast_ss(A + r * 576 + k);
        acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
      }
      if (side && (k & 63) == 0)
        for (int64_t x = 0; x < per_iter && side->p < side->end; ++x, side->p += 64)
          _mm_prefetch(side->p, HINT == 0 ? _MM_HINT_T0 : _MM_HINT_NTA);
    }
  }
  float s = 0; for (auto& r : acc) s += hsum(_mm256_add_ps(r[0], r[1]));
  return s;
}

int main(int argc, char** argv) {
  const int mode = atoi(argv[1]);
  const int64_t B = atoi(argv[2]), ctx = atoi(argv[3]), iters = atoi(argv[4]), L = 30;
  const int64_t KVH = 3, G = 3, D = 64, BS = 16;
  const int64_t rs = KVH * D, bps = (ctx + BS - 1) / BS, nb = B * bps, layer_floats = nb * BS * rs;
  std::vector<float> k(L * layer_floats), v(L * layer_floats), q(B * KVH * G * D);
  std::mt19937 r(1); std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : k) x = u(r); for (auto& x : v) x = u(r); for (auto& x : q) x = u(r) * 0.125f;
  std::vector<int32_t> table(nb); for (int64_t i = 0; i < nb; ++i) table[i] = (i * 37) % nb;  // scattered
  std::vector<float> A(6 * 576), Bm(576 * 16); for (auto& x : A) x = u(r); for (auto& x : Bm) x = u(r);
  Shape sh{BS, KVH, G, D, rs};
  std::vector<float> m(B * 9), l(B * 9), acc(B * 9 * D), scratch(KVH * G * (kStep + 1) + 32 + f32_buffer_floats(rs));
  // lines of one layer's K + V, issued per matmul k-block so that they are spread over the matmul
  const int64_t lines = 2 * layer_floats * 4 / 64, kblocks = iters * 9;
  const int64_t per_iter = (lines + kblocks - 1) / kblocks;
  double best = 1e30, tm = 0, ta = 0, bm = 1e30, ba = 1e30; float sink = 0;
  for (int rep = 0; rep < 10; ++rep) {
    tm = ta = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t ly = 0; ly < L; ++ly) {
      const int64_t nx = (ly + 1) % L;
      // K then V of the next layer as two halves of the side stream (the whole arrays: the blocks in use)
      Side sk{reinterpret_cast<const char*>(k.data() + nx * layer_floats), reinterpret_cast<const char*>(k.data() + (nx + 1) * layer_floats)};
      Side sv{reinterpret_cast<const char*>(v.data() + nx * layer_floats), reinterpret_cast<const char*>(v.data() + (nx + 1) * layer_floats)};
      auto a0 = std::chrono::steady_clock::now();
      if (mode != 3) {
        if (mode == 1 || mode == 2) {
          // half the matmul streams K, the other half V
          if (mode == 1) { sink += matmul_like<0>(A.data(), Bm.data(), iters / 2, &sk, 2 * per_iter); sink += matmul_like<0>(A.data(), Bm.data(), iters - iters / 2, &sv, 2 * per_iter); }
          else { sink += matmul_like<1>(A.data(), Bm.data(), iters / 2, &sk, 2 * per_iter); sink += matmul_like<1>(A.data(), Bm.data(), iters - iters / 2, &sv, 2 * per_iter); }
        } else sink += matmul_like<0>(A.data(), Bm.data(), iters, nullptr, 0);
      }
      auto a1 = std::chrono::steady_clock::now();
      if (mode != 4) {
        const float* kl = k.data() + ly * layer_floats;
        const float* vl = v.data() + ly * layer_floats;
        for (int64_t b = 0; b < B; ++b) {
          Item it{q.data() + b * KVH * G * D, table.data() + b * bps, 0, ctx, &m[b * 9], &l[b * 9], &acc[b * 9 * D]};
          if (b + 1 < B) it.next_table = table.data() + (b + 1) * bps, it.next_t0 = 0, it.next_t1 = ctx;
          attend_item_f32<3, 32>(it, kl, vl, sh, scratch.data());
        }
      }
      auto a2 = std::chrono::steady_clock::now();
      tm += std::chrono::duration<double>(a1 - a0).count(); ta += std::chrono::duration<double>(a2 - a1).count();
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t < best) best = t, bm = tm, ba = ta;
  }
  printf("mode %d B=%ld ctx=%ld iters=%ld: %.0f us a layer (matmul %.0f, attention %.0f) [%g]\n", mode, B, ctx, iters,
         best * 1e6 / L, bm * 1e6 / L, ba * 1e6 / L, sink * 0);
}
