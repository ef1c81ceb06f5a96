"""This CPU's two ceilings for a matmul: the fp32 FMA rate and the read bandwidth, per core and for N threads.

- FMA peak: a loop of independent 8-lane fp32 FMAs (`acc[i] = acc[i] * m + c`, ACC chains), built with the
  same ISA flags as the runner's kernels (runner/cpu_kernels.py), one std::thread per thread. With 8 or
  more chains (2 FMA pipes x 4 cycles of latency on Zen 3) it runs at the core's peak; with 4 it shows the
  latency-bound rate a tile with too few accumulators gets. Each thread times itself twice: wall time and
  its own CPU time (CLOCK_THREAD_CPUTIME_ID). On a shared machine the CPU-time rate is the core's true rate
  (time the thread was off the core is not counted); the wall rate is what a call gets while others run.
- Read bandwidth: `gpuservd.bench.floor.measure_read_bandwidth`, the decode-floor probe (a sum over 1 GiB of
  distinct values), at 1 and N threads.

A matmul of M rows x K x N then has a roofline time max(4 N K / read_bw, 2 M N K / fma_peak): few rows are
bound by the read, many by the FMAs. bench_packed_f32.py reports every shape as a fraction of it.

    .venv/bin/python scripts/cpu_ceilings.py            # JSON on stdout, ~10 s
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gpuservd.bench.floor import measure_read_bandwidth
from gpuservd.runner import cpu_kernels

# One function per chain count; each thread writes (flops, wall s, cpu s, the chains' sum). The chains' values
# stay finite (x * 0.999999 + 1e-7 converges), and their sum is written out so the loop is not removed. Plain
# C++ with std::thread, no torch headers: it builds in about a second (a torch extension took ~40 s), with
# the runner's kernels' ISA flags so the FMAs are the ones the kernels issue.
_SOURCE = r"""
#include <stdint.h>
#include <time.h>
#include <thread>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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
#if defined(__AVX2__) && defined(__FMA__)
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


class _Probe:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.fma_chains
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def fma_chains(self, iters: int, threads: int, acc: int) -> torch.Tensor:
        """[threads, 4] float64: per thread its flops, wall seconds, CPU seconds and the chains' sum."""
        out = torch.zeros((threads, 4), dtype=torch.float64)
        if self._fn(iters, threads, acc, out.data_ptr()) != 0:
            raise RuntimeError(f"fma_chains: acc must be 4, 8 or 12, got {acc}")
        return out


_module: _Probe | None = None


def probe() -> _Probe:
    """The compiled probe, built once into the user's cache (keyed by its source and flags)."""
    global _module
    if _module is None:
        flags = [f for f in cpu_kernels._cflags() if f != "-fopenmp"] + ["-shared", "-fPIC", "-pthread"]
        key = hashlib.sha256((_SOURCE + " ".join(flags)).encode()).hexdigest()[:12]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuserv"
        lib = cache / f"fma_probe_{key}.so"
        if not lib.exists():
            cache.mkdir(parents=True, exist_ok=True)
            compiler = shutil.which("c++") or shutil.which("g++")
            if compiler is None:
                raise RuntimeError("no C++ compiler (c++ or g++) on PATH: the FMA probe cannot be built")
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: no half-written .so
                src, built = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
                src.write_text(_SOURCE)
                subprocess.run([compiler, *flags, str(src), "-o", str(built)], check=True, capture_output=True)
                os.replace(built, lib)
        _module = _Probe(ctypes.CDLL(str(lib)))
    return _module


def fma_peak(threads: int, acc: int = 12, seconds: float = 0.25, repeats: int = 5) -> dict:
    """GFLOP/s of `acc` independent FMA chains on `threads` threads, best of `repeats` runs of ~`seconds`:
    the sum over threads of each thread's flops / its wall time and / its CPU time."""
    mod = probe()
    r = mod.fma_chains(1000, threads, acc)  # warm-up; also sizes the loop
    rate = r[:, 0].sum().item() / max(r[:, 1].max().item(), 1e-6)
    iters = max(1000, int(1000 * seconds * rate / r[:, 0].sum().item()))
    best_wall = best_cpu = 0.0
    for _ in range(repeats):
        r = mod.fma_chains(iters, threads, acc)
        best_wall = max(best_wall, (r[:, 0] / r[:, 1]).sum().item() / 1e9)
        best_cpu = max(best_cpu, (r[:, 0] / r[:, 2].clamp(min=1e-9)).sum().item() / 1e9)
        assert math.isfinite(r[:, 3].sum().item())
    return {"threads": threads, "acc": acc, "gflops_wall": round(best_wall, 1), "gflops_cpu": round(best_cpu, 1)}


def measure(threads: int = 2) -> dict:
    """The ceilings at 1 and `threads` threads: FMA peak (12 and 4 chains) and read bandwidth."""
    out = {"fma": [], "read_gb_s": {}}
    for t in sorted({1, threads}):
        out["fma"].append(fma_peak(t, 12))
        out["read_gb_s"][str(t)] = round(measure_read_bandwidth(t) / 1e9, 1)
    out["fma"].append(fma_peak(1, 4))  # latency-bound: what a tile with 2-4 accumulators can reach
    return out


def peak_gflops(ceilings: dict, threads: int) -> float:
    """The FMA ceiling for `threads` threads (CPU-time rate: the core's own, without other jobs' share)."""
    return max(f["gflops_cpu"] for f in ceilings["fma"] if f["threads"] == threads and f["acc"] >= 8)


def roofline_s(rows: int, n: int, k: int, weight_bytes: float, ceilings: dict, threads: int) -> tuple[float, str]:
    """The least time a matmul [rows, k] x [k, n] can take here, and which ceiling sets it."""
    read = weight_bytes / (ceilings["read_gb_s"][str(threads)] * 1e9)
    fma = 2 * rows * n * k / (peak_gflops(ceilings, threads) * 1e9)
    return (read, "read") if read >= fma else (fma, "fma")


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
