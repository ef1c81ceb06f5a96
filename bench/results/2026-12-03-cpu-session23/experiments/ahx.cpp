// Standalone timing of attend_item_f32<3, 32> on a hot cache (SmolLM2's shape), with parts switched off.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#define GPUSERV_PART_TEST 1
#include "attention_f32_x.h"
using namespace gpuserv_attn;
int main(int argc, char** argv) {
  const int64_t KVH = 3, G = 3, D = 64, BS = 16, ctx = 400, B = NB;
  const int64_t rs = KVH * D, nb = B * ctx / BS;
  std::vector<float> k(nb * BS * rs), v(nb * BS * rs), q(B * KVH * G * D);
  std::mt19937 r(1); std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : k) x = u(r); for (auto& x : v) x = u(r); for (auto& x : q) x = u(r) * 0.125f;
  std::vector<int32_t> table(nb); for (int64_t i = 0; i < nb; ++i) table[i] = CONTIG ? i : (i * 37) % nb;
  Shape sh{BS, KVH, G, D, rs};
  std::vector<float> m(KVH * G), l(KVH * G), acc(KVH * G * D), scratch(KVH * G * (kStep + 1) + 32 + f32_buffer_floats(rs));
  double best = 1e30;
  for (int rep = 0; rep < 50; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < B; ++b) {
      Item it{q.data() + b * KVH * G * D, table.data() + b * (ctx / BS), 0, ctx, m.data(), l.data(), acc.data()};
      attend_item_f32<3, 32>(it, k.data(), v.data(), sh, scratch.data());
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  printf("%s: %.0f us a layer call, %.0f ns / %.0f cycles at 3.2 GHz a token\n", argc > 1 ? argv[1] : "", best * 1e6,
         best * 1e9 / (B * ctx), best * 3.2e9 / (B * ctx));
}
