"""The decoder_stack op (all layers of a forward in one C++ call) gives the layer loop's logits bit for bit, runs
wherever a forward allows it, and steps aside where something must happen between layers."""

from __future__ import annotations

import pytest
import torch

from factories import make_hf_model
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.load import load_weights
from gpuservd.runner.model_config import load_arch

CPU = torch.device("cpu")


class _Counted:
    """The op namespace with decoder_stack calls counted."""

    def __init__(self, ops):
        self._ops = ops
        self.stacks = 0

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name != "decoder_stack":
            return fn

        def counted(*a):
            self.stacks += 1
            return fn(*a)
        return counted


def _dtypes(ops):
    out = ["float32"]
    if ops.packed_available():
        out.append("bfloat16")  # bf16 pair panels need AVX512_BF16
    return out


def _steps(model, arch, dt, long_prompt: int = 0):
    """Logits of a chunked prefill of three prompts, then two decode steps of all three."""
    cache = KVCache(cache_shape(arch, 4, dt), 256, CPU)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, long_prompt or 4)]
    tables = [cache.pool.allocate(-(-(len(p) + 2) // 4)) for p in prompts]
    out = [model.forward(build_batch([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)], 4, CPU), cache.layer)]
    for step in range(2):
        chunks = [SeqChunk([7 + step], len(p) + step, t, True) for p, t in zip(prompts, tables)]
        out.append(model.forward(build_batch(chunks, 4, CPU), cache.layer))
    return torch.cat(out)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: a qkv bias and GQA
def test_stack_gives_the_layer_loops_logits_bit_for_bit(ops, tmp_path, family):
    make_hf_model(tmp_path, family)
    arch = load_arch(tmp_path)
    for dtype in _dtypes(ops):
        dt = getattr(torch, dtype)
        weights = load_weights(tmp_path, arch, dt, CPU)
        logits = {}
        for stacked in (True, False):
            model = LlamaModel(arch, weights, 512, dt, "cpu")
            model.stack_enabled = stacked
            model._ops = counted = _Counted(model._ops)
            logits[stacked] = _steps(model, arch, dt)
            assert counted.stacks == (3 if stacked else 0), dtype  # the prefill (short chunks) and both decodes
        assert torch.equal(logits[True], logits[False]), dtype


def test_stack_steps_aside_where_layers_need_the_loop(ops, tmp_path):
    make_hf_model(tmp_path, "llama")
    arch = load_arch(tmp_path)
    weights = load_weights(tmp_path, arch, torch.float32, CPU)
    model = LlamaModel(arch, weights, 1024, torch.float32, "cpu")
    model._ops = counted = _Counted(model._ops)
    # A prompt past the kernel's prefill context attends through SDPA: that forward takes the loop, the decode
    # steps after it the stack.
    _steps(model, arch, torch.float32, long_prompt=600)
    assert counted.stacks == 2
    # The arbiter's halfway point must run inside each layer.
    seen = []
    model.mid_layer = seen.append
    counted.stacks = 0
    _steps(model, arch, torch.float32)
    assert counted.stacks == 0 and seen[:arch.num_layers] == list(range(arch.num_layers))
    model.mid_layer = None
    # A linear that is not a plain packed Linear (a variant's adapter wraps it, say).
    lw = weights.layer(1)
    plain = lw.down
    lw.down = lambda x: plain(x)
    try:
        _steps(model, arch, torch.float32)
        assert counted.stacks == 0
    finally:
        lw.down = plain
    # A suspended forward (layer-granularity preemption) stops between layers; it and its resume take the loop.
    cache = KVCache(cache_shape(arch, 4, torch.float32), 16, CPU)
    batch = build_batch([SeqChunk(list(range(3, 14)), 0, cache.pool.allocate(3), True)], 4, CPU)
    cp = model.forward(batch, cache.layer, suspend=lambda i: i == 0)
    model.forward(batch, cache.layer, resume=cp)
    assert counted.stacks == 0


def test_the_switch_keeps_the_layer_loop(ops, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSERV_CPU_STACK", "0")
    make_hf_model(tmp_path, "llama")
    arch = load_arch(tmp_path)
    model = LlamaModel(arch, load_weights(tmp_path, arch, torch.float32, CPU), 512, torch.float32, "cpu")
    assert not model.stack_enabled


def test_an_engine_alone_on_its_device_yields_nowhere_and_stacks_its_layers(ops, tiny_model_dir):
    """Under the arbiter an engine thread's forward yields halfway through and after each layer; while no other
    model shares the device there is nobody to yield to, so a step calls no yield point and its layers run in
    one op; once a neighbour registers, the next step yields again."""
    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.engine.request import SamplingParams
    from gpuservd.sharing.arbiter import Arbiter
    from gpuservd.sharing.config import SharingClass, SharingConfig

    cfg = EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=4 << 20, block_size=4)
    eng = LLMEngine("tiny", tiny_model_dir, cfg)
    model = eng.runner.model
    model._ops = counted = _Counted(model._ops)
    arb = Arbiter(SharingConfig())
    handle = arb.register("tiny", "dev", 1.0, SharingClass.BEST_EFFORT)
    calls = []
    eng.yield_point = lambda layer: calls.append(layer)
    eng.device_alone = handle.alone
    eng.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    assert calls == [] and counted.stacks == 1
    other = arb.register("other", "dev", 1.0, SharingClass.BEST_EFFORT)
    eng.step()
    n = model.arch.num_layers
    assert counted.stacks == 1 and len(calls) == 2 * n - 1  # halfway through each layer, and after all but the last
    other.close()
    eng.step()
    assert counted.stacks == 2 and len(calls) == 2 * n - 1
