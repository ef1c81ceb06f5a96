#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
int main(int argc, char** argv) {
  const size_t n = (size_t)160 << 20;  // bytes
  int T = atoi(argv[1]);
  float* a = (float*)aligned_alloc(64, n); memset(a, 1, n);
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th; std::vector<float> out(T);
    for (int t = 0; t < T; ++t) th.emplace_back([&, t] {
      const float* p = a + n / 4 / T * t; size_t m = n / 4 / T;
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (size_t i = 0; i < m; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i)); s1 = _mm256_add_ps(s1, _mm256_load_ps(p + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 16)); s3 = _mm256_add_ps(s3, _mm256_load_ps(p + i + 24));
      }
      float r[8]; _mm256_storeu_ps(r, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))); out[t] = r[0];
    });
    for (auto& x : th) x.join();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%d threads: %.1f GB/s (%g)\n", T, n / dt / 1e9, out[0]);
  }
}
