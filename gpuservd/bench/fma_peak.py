"""This CPU's fp32 FMA peak: how many multiply-adds a second its cores can do at most.

A loop of independent fp32 FMAs (`acc[i] = acc[i] * m + c`, ACC chains) in the widest vectors the CPU has
(16 lanes with AVX-512F, 8 with AVX2 + FMA, else scalar), one std::thread per thread. With 8 or more chains
(2 FMA pipes x 4 cycles of latency on Zen 3) it runs at the core's peak; with 4 it shows the
latency-bound rate a matmul tile with too few accumulators gets. Each thread times itself twice: wall
time and its own CPU time (CLOCK_THREAD_CPUTIME_ID). On a shared machine the CPU-time rate is the core's
true rate (time the thread was off the core is not counted); the wall rate is what a call gets while
others run.

Plain C++ with std::thread, no torch headers: it builds in about a second (a torch extension took ~40 s),
into the user's cache, keyed by its source and flags. The bench's compute floor (compute_floor.py) and
scripts/cpu_ceilings.py's roofline divide work by this peak.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gpuservd.dtypes import cpu_flags

# One function per chain count; each thread writes (flops, wall s, cpu s, the chains' sum). The chains' values
# stay finite (x * 0.999999 + 1e-7 converges), and their sum is written out so the loop is not removed.
_SOURCE = r"""
#include <stdint.h>
#include <time.h>
#include <thread>
#include <vector>
#include <immintrin.h>

namespace {
double seconds(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

template <int ACC>
void chains(int64_t iters, double* out) {
  const double w0 = seconds(CLOCK_MONOTONIC), c0 = seconds(CLOCK_THREAD_CPUTIME_ID);
  float sink = 0.f;
#if defined(__AVX512F__)
  __m512 a[ACC];
  for (int i = 0; i < ACC; ++i) a[i] = _mm512_set1_ps(1e-3f * i);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  for (int i = 0; i < ACC; ++i) sink += _mm512_reduce_add_ps(a[i]);
  const double flops = 32.0 * ACC * iters;  // 16 lanes x (multiply + add)
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[ACC];
  for (int i = 0; i < ACC; ++i) a[i] = _mm256_set1_ps(1e-3f * i);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  }
  for (int i = 0; i < ACC; ++i) sink += _mm256_cvtss_f32(a[i]);
  const double flops = 16.0 * ACC * iters;  // 8 lanes x (multiply + add)
#else
  float a[ACC];
  for (int i = 0; i < ACC; ++i) a[i] = 1e-3f * i;
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < ACC; ++i) a[i] = a[i] * 0.999999f + 1e-7f;
  for (int i = 0; i < ACC; ++i) sink += a[i];
  const double flops = 2.0 * ACC * iters;
#endif
  out[0] = flops;
  out[1] = seconds(CLOCK_MONOTONIC) - w0;
  out[2] = seconds(CLOCK_THREAD_CPUTIME_ID) - c0;
  out[3] = sink;
}
}  // namespace

// out: [threads][4], per thread its flops, wall seconds, CPU seconds and the chains' sum. -1: a bad acc.
extern "C" int fma_chains(int64_t iters, int64_t threads, int64_t acc, double* out) {
  if (acc != 4 && acc != 8 && acc != 12) return -1;
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([=] {
      if (acc == 4) chains<4>(iters, out + 4 * t);
      else if (acc == 8) chains<8>(iters, out + 4 * t);
      else chains<12>(iters, out + 4 * t);
    });
  for (auto& th : pool) th.join();
  return 0;
}
"""


def isa_flags(flags: set[str] | None = None) -> list[str]:
    """Compiler flags for the widest FMA this CPU has (the probe measures the machine, not a kernel build)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return ["-mavx512f", "-mfma"]
    if {"avx2", "fma"} <= flags:
        return ["-mavx2", "-mfma"]
    return []


def lanes(flags: set[str] | None = None) -> int:
    """fp32 lanes of one FMA of the probe on this CPU (16, 8 or 1)."""
    isa = isa_flags(flags)
    return 16 if "-mavx512f" in isa else 8 if isa else 1


class Probe:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.fma_chains
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def fma_chains(self, iters: int, threads: int, acc: int) -> list[list[float]]:
        """Per thread [flops, wall seconds, CPU seconds, the chains' sum]."""
        out = (ctypes.c_double * (4 * threads))()
        if self._fn(iters, threads, acc, ctypes.addressof(out)) != 0:
            raise RuntimeError(f"fma_chains: acc must be 4, 8 or 12, got {acc}")
        return [list(out[4 * t: 4 * t + 4]) for t in range(threads)]


_module: Probe | None = None


class NoCompiler(RuntimeError):
    """No C++ compiler on PATH: the probe cannot be built."""


def probe() -> Probe:
    """The compiled probe, built once into the user's cache (keyed by its source and flags)."""
    global _module
    if _module is None:
        flags = ["-O2", "-std=c++17", *isa_flags(), "-shared", "-fPIC", "-pthread"]
        key = hashlib.sha256((_SOURCE + " ".join(flags)).encode()).hexdigest()[:12]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuserv"
        lib = cache / f"fma_peak_{key}.so"
        if not lib.exists():
            compiler = shutil.which("c++") or shutil.which("g++")
            if compiler is None:
                raise NoCompiler("no C++ compiler (c++ or g++) on PATH: the FMA probe cannot be built")
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: no half-written .so
                src, built = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
                src.write_text(_SOURCE)
                subprocess.run([compiler, *flags, str(src), "-o", str(built)], check=True, capture_output=True)
                os.replace(built, lib)
        _module = Probe(ctypes.CDLL(str(lib)))
    return _module


def fma_peak(threads: int, acc: int = 12, seconds: float = 0.25, repeats: int = 5) -> dict:
    """GFLOP/s of `acc` independent FMA chains on `threads` threads, best of `repeats` runs of ~`seconds`:
    the sum over threads of each thread's flops / its wall time and / its CPU time."""
    mod = probe()
    r = mod.fma_chains(1000, threads, acc)  # warm-up; also sizes the loop
    flops = sum(t[0] for t in r)
    rate = flops / max(max(t[1] for t in r), 1e-6)
    iters = max(1000, int(1000 * seconds * rate / flops))
    best_wall = best_cpu = 0.0
    for _ in range(repeats):
        r = mod.fma_chains(iters, threads, acc)
        best_wall = max(best_wall, sum(t[0] / t[1] for t in r) / 1e9)
        best_cpu = max(best_cpu, sum(t[0] / max(t[2], 1e-9) for t in r) / 1e9)
        assert all(math.isfinite(t[3]) for t in r)
    return {"threads": threads, "acc": acc, "lanes": lanes(), "gflops_wall": round(best_wall, 1),
            "gflops_cpu": round(best_cpu, 1)}
