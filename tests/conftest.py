"""Shared fixtures: tiny models built once per session, an isolated GPUSERV_HOME per test."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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
def _small_bandwidth_probe():
    """The bench's memory-bandwidth probe sums a 64 MiB tensor here instead of 1 GiB.

    A bench run probes four times (floor.py), and filling and faulting in a fresh GiB took 1-4 s each: the
    largest part of every test that runs `gpuserv bench`. The tests check that the probe runs and that its
    reading reaches the floor and the report, never its value (no wall-clock numbers), and the code path
    is the same at any size; 1 GiB only keeps a real run's reading clear of the CPU caches."""
    from gpuservd.bench import floor

    defaults = floor.measure_read_bandwidth.__defaults__
    floor.measure_read_bandwidth.__defaults__ = (64 << 20, *defaults[1:])
    yield
    floor.measure_read_bandwidth.__defaults__ = defaults


@pytest.fixture(scope="session", autouse=True)
def _reap_daemons():
    """Daemons whose teardown left their interpreter's exit running beside the next tests: waited for here."""
    yield
    import daemon_harness

    daemon_harness.reap()
