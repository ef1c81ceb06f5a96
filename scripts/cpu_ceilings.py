"""This CPU's two ceilings for a matmul: the fp32 FMA rate and the read bandwidth, per core and for N threads.

- FMA peak: gpuservd/bench/fma_peak.py (independent fp32 FMA chains in the CPU's widest vectors, one
  std::thread per thread; wall and CPU-time rates). With 8 or more chains it runs at the core's peak;
  with 4 it shows the latency-bound rate a tile with too few accumulators gets.
- Read bandwidth: `gpuservd.bench.floor.measure_read_bandwidth`, the decode-floor probe (a sum over 1 GiB of
  distinct values), at 1 and N threads.

A matmul of M rows x K x N then has a roofline time max(4 N K / read_bw, 2 M N K / fma_peak): few rows are
bound by the read, many by the FMAs. bench_packed_f32.py reports every shape as a fraction of it.

    .venv/bin/python scripts/cpu_ceilings.py            # JSON on stdout, ~10 s
"""

from __future__ import annotations

import json

from gpuservd.bench.floor import measure_read_bandwidth
from gpuservd.bench.fma_peak import fma_peak


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
