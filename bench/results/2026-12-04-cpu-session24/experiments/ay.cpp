// Standalone timing of fp32 decode-attention items (SmolLM2's shape: 3 KV heads, 3 query heads each, 64 dims,
// blocks of 16): ay VARIANT B CTX LAYERS CONTIG. Each repetition runs B sequences' items over every layer's
// cache in turn (LAYERS copies: 1 = the cache stays in L2/L3, 30 = it comes from DRAM as in a step).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "attention_f32_y.h"
using namespace gpuserv_attn;
int main(int argc, char** argv) {
  const int var = atoi(argv[1]);
  const int64_t B = atoi(argv[2]), ctx = atoi(argv[3]), L = atoi(argv[4]), contig = atoi(argv[5]);
  const int64_t KVH = 3, G = 3, D = 64, BS = 16;
  const int64_t rs = KVH * D, bps = (ctx + BS - 1) / BS, nb = B * bps;
  std::vector<float> k(L * nb * BS * rs), v(L * nb * BS * rs), q(B * KVH * G * D), ref;
  std::mt19937 r(1); std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : k) x = u(r); for (auto& x : v) x = u(r); for (auto& x : q) x = u(r) * 0.125f;
  std::vector<int32_t> table(nb); for (int64_t i = 0; i < nb; ++i) table[i] = contig ? i : (i * 37) % nb;
  Shape sh{BS, KVH, G, D, rs};
  std::vector<float> m(B * KVH * G), l(B * KVH * G), acc(B * KVH * G * D), scratch(KVH * G * (kStep + 1) + 32 + f32_buffer_floats(rs));
  using Fn = void (*)(const Item&, const float*, const float*, const Shape&, float*);
  Fn fns[] = {attend_item_f32<3, 32>, attend_item_f32_inplace<3, 32, 0>, attend_item_f32_inplace<3, 32, 1>,
    attend_item_f32_mix<3, 32, 0, 0, 0>, attend_item_f32_mix<3, 32, 1, 24, 32>, attend_item_f32_mix<3, 32, 1, 48, 0>, attend_item_f32_mix<3, 32, 1, 8, 56>,
    attend_item_f32_ahead<3, 32, 8, 0>, attend_item_f32_ahead<3, 32, 8, 1>, attend_item_f32_ahead<3, 32, 16, 1>, attend_item_f32_ahead<3, 32, 32, 1>, attend_item_f32_ahead<3, 32, 16, 2>,
    attend_item_f32_overlap<3, 32, 16, 0>, attend_item_f32_overlap<3, 32, 8, 32>, attend_item_f32_overlap<3, 32, 4, 48>, attend_item_f32_overlap<3, 32, 0, 0>};
  Fn fn = fns[var];
  double best = 1e30;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t ly = 0; ly < L; ++ly) {
      const float* kl = k.data() + ly * nb * BS * rs;
      const float* vl = v.data() + ly * nb * BS * rs;
      for (int64_t b = 0; b < B; ++b) {
        Item it{q.data() + b * KVH * G * D, table.data() + b * bps, 0, ctx, &m[b * 9], &l[b * 9], &acc[b * 9 * D]};
        if (b + 1 < B) it.next_table = table.data() + (b + 1) * bps, it.next_t0 = 0, it.next_t1 = ctx;
        fn(it, kl, vl, sh, scratch.data());
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  double cs = 0; for (auto x : acc) cs += x;
  printf("v%d B=%ld ctx=%ld L=%ld contig=%ld: %.0f us a layer call, %.1f GB/s of KV, %.0f cycles/token at 3.2 GHz (sum %.6f)\n",
         var, B, ctx, L, contig, best * 1e6 / L, L * B * ctx * 2 * rs * 4 / best / 1e9, best * 3.2e9 / (L * B * ctx), cs);
}
