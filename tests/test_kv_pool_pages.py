"""The CPU KV pool: lazily zeroed anonymous memory, advised for 2 MB pages unless switched off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuservd.kv_cache.cache import HUGE_PAGES_ENV, CacheShape, KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(addr: int) -> bool | None:
    """THPeligible of the mapping holding addr (None where smaps does not say)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def _pool() -> KVCache:
    shape = CacheShape(2, 3, 16, 64, torch.bfloat16)  # 4 MB a layer's K or V at 1024 blocks
    return KVCache(shape, 1024, torch.device("cpu"))


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_the_pool_is_advised_for_huge_pages_and_the_switch_keeps_small_ones(monkeypatch):
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    cache = _pool()
    assert _thp_eligible(cache.kv.data_ptr()) is True
    assert torch.count_nonzero(cache.kv) == 0  # still zeros, as the attention's masked slots need
    if "[madvise]" in THP.read_text():  # with `always` every mapping is eligible, advised or not
        monkeypatch.setenv(HUGE_PAGES_ENV, "0")
        assert _thp_eligible(_pool().kv.data_ptr()) is False
