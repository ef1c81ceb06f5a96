"""gpuservd/bench/fma_peak.py counts the work it did in the CPU's widest FMAs, and scripts/cpu_ceilings.py's
roofline picks the ceiling that binds (the read at few rows, the FMAs at many). No speed is asserted: the
machine may be shared."""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
from pathlib import Path

import pytest

from gpuservd.bench import fma_peak

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def ceilings():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("cpu_ceilings", SCRIPTS / "cpu_ceilings.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPTS))


def test_fma_probe_counts_each_threads_flops():
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: the probe cannot be built here")
    r = fma_peak.probe().fma_chains(1000, 2, 8)
    assert len(r) == 2
    per_iter = 8 * 2 * fma_peak.lanes()  # 8 chains of `lanes` lanes x (multiply + add)
    assert [t[0] for t in r] == [1000.0 * per_iter] * 2
    assert all(t[1] > 0 and t[2] >= 0 for t in r)
    assert all(math.isfinite(t[3]) for t in r)  # the chains converge instead of overflowing
    with pytest.raises(RuntimeError, match="acc must be"):
        fma_peak.probe().fma_chains(10, 1, 5)
    peak = fma_peak.fma_peak(1, 8, seconds=0.01, repeats=1)
    assert peak["threads"] == 1 and peak["gflops_wall"] > 0 and peak["gflops_cpu"] > 0


def test_the_probe_uses_the_widest_fma_the_cpu_has():
    assert fma_peak.isa_flags({"avx512f", "avx2", "fma"}) == ["-mavx512f", "-mfma"]
    assert fma_peak.isa_flags({"avx2", "fma"}) == ["-mavx2", "-mfma"]
    assert fma_peak.isa_flags({"sse4_2"}) == []
    assert (fma_peak.lanes({"avx512f", "fma"}), fma_peak.lanes({"avx2", "fma"}), fma_peak.lanes(set())) == (16, 8, 1)


def test_roofline_binds_on_the_read_at_few_rows_and_the_fmas_at_many(ceilings):
    c = {"fma": [{"threads": 2, "acc": 12, "gflops_cpu": 200.0, "gflops_wall": 190.0},
                 {"threads": 2, "acc": 4, "gflops_cpu": 100.0, "gflops_wall": 100.0}],
         "read_gb_s": {"2": 30.0}}
    assert ceilings.peak_gflops(c, 2) == 200.0  # the latency-bound 4-chain rate is not the peak
    n, k = 3072, 576
    w = n * k * 4
    t1, b1 = ceilings.roofline_s(1, n, k, w, c, 2)
    assert b1 == "read" and t1 == pytest.approx(w / 30e9)
    t64, b64 = ceilings.roofline_s(64, n, k, w, c, 2)
    assert b64 == "fma" and t64 == pytest.approx(2 * 64 * n * k / 200e9)
    # the crossing: 2 rows N K / peak = 4 N K / bw  ->  rows = 2 peak / bw ~ 13.3
    assert ceilings.roofline_s(13, n, k, w, c, 2)[1] == "read"
    assert ceilings.roofline_s(14, n, k, w, c, 2)[1] == "fma"
