"""The layers' packed weights cut from shared 2 MB-page blocks (runner/panel_arena.py, csrc/packed_panels_f32.cpp
huge_empty): the same panels and logits as from torch's allocator, one block per load, and a block unmapped
when the last tensor cut from it dies (an unloaded model's memory goes back), not before."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from factories import make_model_dir
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner import panel_arena
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.linear import packed_enabled
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.load import load_weights
from gpuservd.runner.model_config import load_arch
from gpuservd.runner.panel_arena import ALIGN, HUGE_PAGES_SWITCH, PanelArena

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

LINEARS = ("qkv", "o_proj", "gate_up", "down")
HUGE = 2 << 20


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping that holds addr, or None."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and not line.startswith(("VmFlags", " ")) and len(head[0].split("-")) == 2:
                try:
                    lo, hi = (int(v, 16) for v in head[0].split("-"))
                except ValueError:
                    continue
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@pytest.fixture
def packed_dtype(ops, request):
    dtype = request.param
    if not packed_enabled(torch.device("cpu"), dtype):
        pytest.skip(f"{dtype} weights are not packed on this CPU")
    return dtype


def _model(path, dtype):
    arch = load_arch(path)
    return arch, LlamaModel(arch, load_weights(path, arch, dtype, torch.device("cpu")), 256, dtype, "cpu")


def _logits(arch, model, dtype):
    cache = KVCache(cache_shape(arch, 4, dtype), 32, torch.device("cpu"))
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(5)).tolist()
    chunks = [SeqChunk(p, 0, cache.pool.allocate(3), True) for p in ids]
    return model.forward(build_batch(chunks, 4, torch.device("cpu")), cache.layer).clone()


@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16], indirect=True)
def test_layer_panels_share_one_huge_page_block_and_give_the_same_logits(packed_dtype, tmp_path, monkeypatch):
    dtype = packed_dtype
    path = make_model_dir(tmp_path / "m", num_hidden_layers=3)
    arch, model = _model(path, dtype)
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "0")
    _, plain = _model(path, dtype)
    storages = set()
    for i in range(arch.num_layers):
        for name in LINEARS:
            a, b = getattr(model.weights.layer(i), name).packed, getattr(plain.weights.layer(i), name).packed
            assert torch.equal(a, b) and a.is_contiguous()
            assert (a.data_ptr() - a.untyped_storage().data_ptr()) % ALIGN == 0
            storages.add(a.untyped_storage().data_ptr())
            assert "hg" not in (_vm_flags(b.data_ptr()) or [])
    # The load reserved its layers' bytes: one block, 2 MB-aligned, marked for huge pages.
    assert len(storages) == 1
    block = storages.pop()
    assert block % HUGE == 0 and "hg" in _vm_flags(block)
    assert torch.equal(_logits(arch, model, dtype), _logits(arch, plain, dtype))


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16], indirect=True)
def test_an_unloaded_models_block_is_unmapped_when_its_last_tensor_dies(packed_dtype, layered, tmp_path):
    path = make_model_dir(tmp_path / "m", num_hidden_layers=2)
    arch = load_arch(path)
    gc.collect()
    before = panel_arena.mapped_bytes()
    weights = load_weights(path, arch, packed_dtype, torch.device("cpu"), initial_layers=1 if layered else None)
    if layered:  # the second layer comes on a thread, which drops the arena when it ends
        weights.gate.wait_all()
        deadline = time.monotonic() + 30
        while any(t.name == "layered-load" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
    loaded = panel_arena.mapped_bytes()
    assert loaded >= before + HUGE
    kept = weights.layers[1].o_proj
    values = kept.packed.clone()
    del weights
    gc.collect()
    # One tensor of the block still alive holds the whole block: nothing unmapped under it.
    assert panel_arena.mapped_bytes() - before >= HUGE
    assert torch.equal(kept.packed, values)
    x = torch.randn(3, kept.in_features).to(packed_dtype)
    assert torch.isfinite(kept(x).float()).all()
    del kept
    gc.collect()
    assert panel_arena.mapped_bytes() == before


def test_arena_cuts_aligned_tensors_from_blocks_in_order(ops):
    gc.collect()
    before = panel_arena.mapped_bytes()
    arena = PanelArena(ops, block_bytes=4 << 20, reserve=5 << 20)
    a = arena.empty((100, 3), torch.float32)  # 1200 bytes: the next tensor starts one ALIGN on
    b = arena.empty((512, 1024), torch.bfloat16)  # 1 MB
    c = arena.empty((5 << 20,), torch.uint8)  # over half a block, past the reserve: a block of its own
    d = arena.empty((64, 64), torch.float32)  # back in the first block
    e = arena.empty((4, 1 << 20), torch.uint8)  # over half a block, but it fits the first block's rest (4.98 MB)
    f = arena.empty((1536 << 10,), torch.uint8)  # does not fit it: a new 4 MB block
    g = arena.empty((1, 5), torch.float32)  # in f's block
    base = a.untyped_storage().data_ptr()
    assert base % HUGE == 0 and a.data_ptr() == base and b.data_ptr() == base + ALIGN
    assert a.untyped_storage().nbytes() == 6 << 20  # the reserve, in whole 2 MB pages
    assert d.untyped_storage().data_ptr() == base and d.data_ptr() == base + ALIGN + (1 << 20)
    assert c.untyped_storage().nbytes() == 6 << 20 and c.untyped_storage().data_ptr() != base
    assert e.data_ptr() == d.data_ptr() + ALIGN * 4
    assert f.untyped_storage().nbytes() == 4 << 20 and g.untyped_storage().data_ptr() == f.data_ptr()
    assert g.data_ptr() == f.data_ptr() + (1536 << 10)
    for t in (a, b, c, d, e, f, g):
        assert t.is_contiguous() and t.data_ptr() % ALIGN == 0 and t.untyped_storage().data_ptr() % HUGE == 0
        t.fill_(1)  # writable, and no two overlap (the sums below)
    del t
    assert a.sum() == 300 and b.float().sum() == 512 * 1024 and c.sum(dtype=torch.int64) == 5 << 20
    assert d.sum() == 64 * 64 and e.sum(dtype=torch.int64) == 4 << 20 and f.sum(dtype=torch.int64) == 1536 << 10
    assert g.sum() == 5
    del arena  # the load is over: the blocks live as long as their tensors
    assert panel_arena.mapped_bytes() == before + (16 << 20)
    del a, b, d, e  # the first block goes with its last tensor
    gc.collect()
    assert panel_arena.mapped_bytes() == before + (10 << 20)
    del c, f, g
    gc.collect()
    assert panel_arena.mapped_bytes() == before


def test_without_memory_for_a_mapping_the_arena_falls_back_to_ordinary_pages(ops, tmp_path):
    """Where the 2 MB-aligned mapping cannot be made (an address-space limit here; THP "never" leaves the
    hint unused), huge_empty takes torch's allocator: the same panels, no huge-page mapping."""
    script = textwrap.dedent("""
        import resource, torch
        from gpuservd.runner import cpu_kernels
        from gpuservd.runner.linear import pack_panels
        from gpuservd.runner.panel_arena import PanelArena
        ops = cpu_kernels.get()
        w = torch.randn(1000, 1200, generator=torch.Generator().manual_seed(1))  # 4.6 MB of fp32 panels
        want = pack_panels(w)  # >= 2 MB: a mapping of its own, counted in panel_mapped_bytes
        mapped = ops.panel_mapped_bytes()
        vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
        # Room for torch's ~4.6 MB allocation, not for the 6 MB + 2 MB slack a huge-page block maps.
        resource.setrlimit(resource.RLIMIT_AS, (vm + (5 << 20) + (512 << 10), resource.RLIM_INFINITY))
        arena = PanelArena(ops, block_bytes=1 << 20)
        got = pack_panels(w, arena)
        mapped = ops.panel_mapped_bytes() - mapped
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(int(torch.equal(got, want)), mapped)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    equal, mapped = out.stdout.split()
    assert equal == "1" and mapped == "0"
