"""Shared fixtures: tiny models built once per session, an isolated GPUSERV_HOME per test."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Idle engines commit their KV pools (kv_cache/prefault.py): the suite builds hundreds of engines with pools
# of up to ~1.6 GB that would each be committed while a test waits; the tests of that mechanism turn it on.
os.environ.setdefault("GPUSERV_KV_PREFAULT", "0")

from factories import make_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a real (trained) byte-level BPE tokenizer."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_store_home() -> Path | None:
    """The GPUSERV_HOME that holds the pulled SmolLM2, if any (make test pulls it first)."""
    home = Path(os.environ.get("GPUSERV_HOME") or Path.home() / ".local" / "share" / "gpuserv")
    return home if (home / "models" / "smollm2" / "config.json").exists() else None


@pytest.fixture(scope="session")
def smollm2_dir(real_store_home) -> Path:
    if real_store_home is None:
        pytest.skip("SmolLM2 is not in the store (run `gpuserv pull smollm2`)")
    return real_store_home / "models" / "smollm2"


@pytest.fixture(scope="session")
def ops():
    """The C++ CPU kernels' op namespace; a test failure when a compiler is there and they did not load."""
    from gpuservd.runner import cpu_kernels

    ops = cpu_kernels.get()
    if ops is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(f"a compiler is present but the kernels did not load: {cpu_kernels.status()['reason']}")
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    return ops


@pytest.fixture()
def store_home(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """A private GPUSERV_HOME with the tiny model imported as 'tiny'."""
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path))
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny")
    return tmp_path


@pytest.fixture(scope="session", autouse=True)
def _short_bench_probes():
    """The bench's machine probes, shortened here: the memory-bandwidth probe sums a 64 MiB tensor
    instead of 1 GiB, the batch-1 decode step is the median of 7 steps instead of 63, and the FMA peak
    the best of 2 runs of 20 ms instead of 5 of 250 ms.

    A bench run probes the bandwidth four times (floor.py), and filling and faulting in a fresh GiB took
    1-4 s each; the 63 steps took about a second more: most of every test that runs `gpuserv bench`. The
    tests check that both probes run and that their readings reach the floor and the report, never their
    values (no wall-clock numbers), and the code paths are the same at any size; the full sizes only keep
    a real run's readings clear of the CPU caches and of one slow step."""
    from gpuservd.bench import engine_run, floor, fma_peak

    probes = [(floor.measure_read_bandwidth, (64 << 20,)), (engine_run.batch1_decode_step_s, (32, 8)),
              (fma_peak.fma_peak, (12, 0.02, 2))]
    saved = [fn.__defaults__ for fn, _ in probes]
    for fn, head in probes:
        fn.__defaults__ = (*head, *fn.__defaults__[len(head):])
    yield
    for (fn, _), defaults in zip(probes, saved):
        fn.__defaults__ = defaults


@pytest.fixture(scope="session", autouse=True)
def _reap_daemons():
    """Daemons whose teardown left their interpreter's exit running beside the next tests: waited for here."""
    yield
    import daemon_harness

    daemon_harness.reap()
