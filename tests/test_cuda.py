"""The engine on a CUDA device: the same tokens as on the CPU, and the CUDA-only paths (asynchronous
swap copies on side streams, layered loading through pinned buffers on a side stream, INT8 expanded
on the GPU) keep every run exact. Skipped where torch sees no CUDA device (CI, the CPU build); run
on a GPU machine with `pytest tests/test_cuda.py` (scripts/device_run.sh does)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from gpuservd.engine.request import SamplingParams  # noqa: E402
from factories import run_requests  # noqa: E402
from test_preemption import PARAMS, engine, prompts, run, swap_round_trip  # noqa: E402

CUDA = "cuda:0"


def test_greedy_tokens_and_logits_match_the_cpu(tiny_model_dir):
    from gpuservd.runner.batch import SeqChunk

    cpu, gpu = engine(tiny_model_dir, mode="off"), engine(tiny_model_dir, device=CUDA, mode="off")
    assert gpu.runner.cache.kv.is_cuda
    ps = prompts()
    params = SamplingParams(max_tokens=12, **PARAMS)
    assert gpu.generate(ps, params) == cpu.generate(ps, params)
    p = ps[-1]
    blocks = list(range(-(-len(p) // 4)))
    a = cpu.runner.execute([SeqChunk(p, 0, blocks, True)])
    b = gpu.runner.execute([SeqChunk(p, 0, blocks, True)]).cpu()
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["swap", "partial_swap", "recompute"])
def test_preemption_under_memory_pressure_is_exact(tiny_model_dir, kind):
    ref = engine(tiny_model_dir, device=CUDA, mode="off").generate(prompts(), SamplingParams(max_tokens=12, **PARAMS))
    eng = engine(tiny_model_dir, num_blocks=16, device=CUDA, mode="on", kind=kind, partial_keep_fraction=0.34)
    out, pre, moves = run(eng, prompts())
    assert out == ref
    assert pre and {p["kind"] for p in pre} == {kind}
    if kind != "recompute":
        assert moves and all(m["seconds"] > 0 for m in moves)  # filled from the copies' CUDA events
        # No probe at start on CUDA (the pinned pool is still being allocated): the swaps measured the link.
        assert eng.scheduler.cost.host_bandwidth and eng.host_pool.kv.is_pinned()
    assert eng.pool.num_free == eng.pool.capacity and eng.host_pool.num_used == 0


@pytest.mark.parametrize("kind", ["swap", "partial_swap"])
def test_swap_round_trip_restores_every_block(tiny_model_dir, kind):
    """Out, overwrite everything the request gave up, back in: the KV is bit-identical, with the host
    copies still in flight when the freed blocks are overwritten (the forward's stream waits only for
    the gather)."""
    before, after, moves = swap_round_trip(tiny_model_dir, kind, device=CUDA)
    assert torch.equal(after, before)
    assert all(m.seconds > 0 for m in moves)


def test_layered_load_gives_the_full_loads_tokens(tiny_model_dir):
    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine

    cfg = EngineConfig(model="tiny", device=CUDA, dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    full = LLMEngine("tiny", tiny_model_dir, cfg)
    layered = LLMEngine("tiny", tiny_model_dir, cfg, initial_layers=1)
    params = SamplingParams(max_tokens=8, **PARAMS)
    assert layered.generate(prompts(), params) == full.generate(prompts(), params)
    assert layered.runner.weights.gate.num_ready == layered.runner.arch.num_layers


def test_int8_weights_are_expanded_on_the_device(tiny_model_dir, tmp_path):
    """The INT8 file's bytes cross to the GPU as int8 and are expanded there: the device weights equal
    the CPU's expansion of the same file, and the bytes read are the INT8 file's, not fp32's."""
    import shutil

    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.runner.load import SafetensorsReader
    from gpuservd.weights.int8_file import Int8Reader, int8_path, write_int8

    d = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, d)
    write_int8(SafetensorsReader(d), d)
    cfg = EngineConfig(model="tiny", device=CUDA, dtype="float32", block_size=4, kv_cache_bytes=4 << 20)
    src = Int8Reader(int8_path(d))
    gpu = LLMEngine("tiny", d, cfg, weight_source=src)
    cpu = LLMEngine("tiny", d, EngineConfig(model="tiny", dtype="float32", block_size=4, kv_cache_bytes=4 << 20),
                    weight_source=Int8Reader(int8_path(d)))
    g, c = gpu.runner.weights.layer(0), cpu.runner.weights.layer(0)
    for name in ("qkv", "o_proj", "gate_up", "down"):
        torch.testing.assert_close(getattr(g, name).weight.cpu(), getattr(c, name).dense(), rtol=0, atol=1e-6)
    fp32_bytes = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    assert 0 < src.bytes_read < 0.4 * fp32_bytes


def _graph_engine(model_dir, **graphs):
    from gpuservd.config import CudaGraphsConfig, EngineConfig
    from gpuservd.engine.engine import LLMEngine

    cfg = EngineConfig(model="tiny", device=CUDA, block_size=4, kv_cache_bytes=4 << 20,
                       cuda_graphs=CudaGraphsConfig(**graphs))
    return LLMEngine("tiny", model_dir, cfg)


def test_cuda_graph_decode_gives_the_eager_tokens(tiny_model_dir):
    """Decode steps replayed from graphs (captured at start, one per bucket) give the eager engine's
    greedy tokens, through padded buckets; status says graphs run, and which buckets."""
    ps = prompts(n=5)
    params = SamplingParams(max_tokens=12, **PARAMS)
    eager = _graph_engine(tiny_model_dir, enabled=False)
    assert eager.decode_status()["path"] == "eager" and "enabled is false" in eager.decode_status()["reason"]
    want = eager.generate(ps, params)
    eng = _graph_engine(tiny_model_dir, batch_sizes=[1, 2, 8])
    st = eng.decode_status()
    assert st["path"] == "cuda_graphs" and st["captured"] == [1, 2, 8] and st["kernels"] == "triton"
    assert eng.generate(ps, params) == want
    assert eng.runner.decode_step.last_path == "graph"
    assert eng.pool.num_free == eng.pool.capacity


def test_cuda_graphs_off_by_environment(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("GPUSERV_CUDA_GRAPHS", "0")
    st = _graph_engine(tiny_model_dir).decode_status()
    assert st["path"] == "eager" and "GPUSERV_CUDA_GRAPHS=0" in st["reason"]


def test_arbiter_yields_run_between_per_layer_graph_segments(tiny_model_dir):
    """With a yield point (the sharing arbiter), decode steps replay per-layer segment graphs and the
    yield runs between them, once per layer boundary; the tokens stay the eager ones."""
    ps = prompts(n=3)
    params = SamplingParams(max_tokens=6, **PARAMS)
    want = _graph_engine(tiny_model_dir, enabled=False).generate(ps, params)
    eng = _graph_engine(tiny_model_dir, batch_sizes=[1, 4])
    calls = []
    eng.yield_point = calls.append
    assert eng.decode_status()["segmented"]
    assert eng.generate(ps, params) == want
    assert eng.runner.decode_step.last_path == "graph"
    layers = eng.runner.arch.num_layers
    assert calls and set(calls) <= set(range(layers))  # layer indices; decode steps give layers - 1 per step




def test_device_sampling_and_overlap_through_graphs(tiny_model_dir):
    """Seeded sampling rows drawn by the device sampler's graph give the eager fixed-shape step's tokens
    (the same kernels and shapes), with overlap on (the CUDA default) and off; greedy rows too."""
    ps = prompts(n=5)
    params = [SamplingParams(max_tokens=10 + i, temperature=0.7 + 0.1 * i, top_p=0.9, top_k=20 * (i % 2),
                             seed=i, **PARAMS) for i in range(4)] + [SamplingParams(max_tokens=9, **PARAMS)]
    fixed = _graph_engine(tiny_model_dir, enabled=False)
    fixed.runner.enable_decode_step([1, 2, 8])
    fixed.overlap = False
    want = run_requests(fixed, ps, params)
    eng = _graph_engine(tiny_model_dir, batch_sizes=[1, 2, 8])
    assert eng.decode_status()["overlap"] is True and eng.overlap
    assert run_requests(eng, ps, params) == want
    assert eng.runner.decode_step.last_path == "graph" and eng.pool.num_free == eng.pool.capacity
    off = _graph_engine(tiny_model_dir, batch_sizes=[1, 2, 8])  # fresh: no prefix cache hits from the run above
    off.overlap = False
    assert run_requests(off, ps, params) == want
