"""The fixed-shape decode step on the CPU (eagerly: graphs need CUDA): bucket padding gives the unpadded
path's greedy tokens, padding rows write no KV, the inputs are laid out in one buffer, and the
engine.cuda_graphs settings are checked and reported."""

from __future__ import annotations

import pytest
import torch

from gpuservd.config import CudaGraphsConfig, EngineConfig, check_batch_sizes, config_from_dict
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import UserError
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.decode_step import DecodeInputs, DecodeResult, bucket_for
from test_preemption import PARAMS, engine, prompts


def test_bucket_sizes_are_checked_with_the_setting_named():
    assert check_batch_sizes([1, 3, 8]) == (1, 3, 8)
    for bad in ([], [2, 2], [4, 1], [0, 1], [1, 2.5], "1,2", [True, 2], None):
        with pytest.raises(UserError, match=r"^engine\.cuda_graphs\.batch_sizes must"):
            check_batch_sizes(bad)
    with pytest.raises(UserError, match=r"engine\.cuda_graphs\.batch_sizes must be strictly increasing"):
        config_from_dict({"engine": {"cuda_graphs": {"batch_sizes": [1, 8, 4]}}})
    with pytest.raises(UserError, match=r"unknown key engine\.cuda_graphs\.'sizes'"):
        config_from_dict({"engine": {"cuda_graphs": {"sizes": [1]}}})
    with pytest.raises(UserError, match=r"engine\.cuda_graphs\.enabled must be true or false"):
        config_from_dict({"engine": {"cuda_graphs": {"enabled": "yes"}}})
    cfg = config_from_dict({"engine": {"cuda_graphs": {"enabled": False, "batch_sizes": [1, 2, 64]}}})
    assert cfg.cuda_graphs == CudaGraphsConfig(enabled=False, batch_sizes=[1, 2, 64])


def test_bucket_for():
    sizes = (1, 2, 4, 8, 24)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 24, 25)] == [1, 2, 4, 8, 8, 24, 24, None]


def test_inputs_fill_one_buffer_with_padding_rows():
    inp = DecodeInputs(max_batch=4, max_blocks=3, device=torch.device("cpu"))
    inp.token_ids.fill_(99)
    inp.slots.fill_(99)
    chunks = [SeqChunk([7], 5, [2, 6], True), SeqChunk([8], 0, [4], True)]
    inp.fill(chunks, bucket=4, block_size=4)
    assert inp.token_ids.tolist() == [7, 8, 0, 0]
    assert inp.positions.tolist() == [5, 0, 0, 0]
    assert inp.slots.tolist() == [6 * 4 + 1, 4 * 4, -1, -1]  # padding rows write nowhere
    assert inp.ctx_lens.tolist() == [6, 1, 0, 0]  # and read nothing
    assert inp.block_tables[0, :2].tolist() == [2, 6] and inp.block_tables[1, 0] == 4
    b = inp.batch(2)
    assert b.input_ids.data_ptr() == inp.token_ids.data_ptr() and b.num_decode == 2 and b.num_kernel_rows == 2
    with pytest.raises(ValueError, match="not a decode chunk"):
        inp.fill([SeqChunk([1, 2], 0, [0], True)], 1, 4)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        inp.fill([SeqChunk([1], 13, [0, 1, 2, 3], True)], 1, 4)


def _with_step(model_dir, sizes, **kw) -> LLMEngine:
    eng = engine(model_dir, **kw)
    eng.runner.enable_decode_step(sizes)
    return eng


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [3, 7]])
def test_greedy_tokens_through_padded_buckets_equal_the_unpadded_path(tiny_model_dir, ops, sizes):
    """Seven requests of different lengths finish at different steps, so the decode batch passes through
    several buckets, most of them padded; the tokens equal the build_batch path's."""
    ps = prompts(n=7, length=5)
    params = SamplingParams(max_tokens=10, **PARAMS)
    ref = engine(tiny_model_dir).generate(ps, params)
    eng = _with_step(tiny_model_dir, sizes)
    eng.runner.decode_step.inputs.device_buf.fill_(-5)  # stale contents must not matter
    ends = [SamplingParams(max_tokens=3 + i, **PARAMS) for i in range(7)]  # finishing one by one
    ids = [f"r{i}" for i in range(7)]
    for rid, p, sp in zip(ids, ps, ends):
        eng.add_request(rid, p, sp)
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in ids] == [r[: 3 + i] for i, r in enumerate(ref)]
    assert eng.runner.decode_step.last_path == "eager"
    assert eng.pool.num_free == eng.pool.capacity
    # And all at once, through the engine's generate (the same path other callers take).
    assert _with_step(tiny_model_dir, sizes).generate(ps, params) == ref


def test_padding_rows_leave_the_cache_alone(tiny_model_dir, ops):
    eng = _with_step(tiny_model_dir, [8])
    runner = eng.runner
    cache = runner.cache.kv
    cache.normal_()
    before = cache.clone()
    chunks = [SeqChunk([5], 9, [3, 1, 7], True), SeqChunk([6], 2, [0], True)]
    out = runner.execute(chunks)
    assert isinstance(out, DecodeResult) and out.logits.shape == (2, runner.arch.vocab_size)
    assert torch.equal(out.greedy, out.logits.argmax(-1))  # chosen beside the logits, as a graph does
    changed = (cache != before).flatten(0, 1).any(-1).any(-1)  # [layers * 2, blocks, block_size]
    touched = {(int(b), int(o)) for b, o in changed.any(0).nonzero().tolist()}
    assert touched == {(7, 1), (0, 2)}  # the two real rows' slots; six padding rows wrote nowhere
    ref = eng.runner.model.forward  # the unpadded path's logits for the same rows
    cache.copy_(before)
    from gpuservd.runner.batch import build_batch

    want = ref(build_batch(chunks, 4, torch.device("cpu")), runner.cache.layer)
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)


def test_graphs_on_a_cpu_device_are_a_reported_fallback(tiny_model_dir, caplog):
    cfg = EngineConfig(model="tiny", block_size=4, kv_cache_bytes=4 << 20,
                       cuda_graphs=CudaGraphsConfig(enabled=True))
    with caplog.at_level("WARNING"):
        eng = LLMEngine("tiny", tiny_model_dir, cfg)
    assert "CUDA graphs need a CUDA device" in caplog.text
    st = eng.decode_status()
    assert st["path"] == "eager" and "asked for" in st["reason"] and st["captured"] == []
    default = engine(tiny_model_dir).decode_status()
    assert default["path"] == "eager" and default["reason"] == "eager on cpu"


@pytest.mark.smollm2
def test_smollm2_greedy_through_buckets_equals_the_unpadded_path(smollm2_dir, ops):
    from gpuservd.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    ps = [tok.encode(t) for t in ("The capital of France is", "def fib(n):", "Once upon a time,")]
    # One engine for both runs (a second SmolLM2 build costs seconds): prefix caching off, so the bucketed
    # run prefills the prompts again rather than finding the first run's blocks, as a fresh engine would.
    cfg = EngineConfig(model="smollm2", dtype="bfloat16", kv_cache_bytes=64 << 20, prefix_caching=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False)
    eng = LLMEngine("smollm2", smollm2_dir, cfg, tokenizer=tok)
    ref = eng.generate(ps, params)
    assert eng.runner.decode_step is None  # the reference took the unpadded path
    eng.runner.enable_decode_step([2, 4])  # three rows padded to 4
    assert eng.generate(ps, params) == ref


def test_stop_ids_are_checked_in_the_step(tiny_model_dir, ops):
    """Each row's stop ids travel with its inputs; the step says which chosen token is one of them, and
    the engine stops those requests exactly where the host check stops them."""
    eng = _with_step(tiny_model_dir, [4])
    runner = eng.runner
    chunks = [SeqChunk([5], 9, [3, 1, 7], True), SeqChunk([6], 2, [0], True), SeqChunk([9], 0, [2], True)]
    first = runner.execute(chunks).greedy.tolist()
    chunks[0].stop_ids = (first[0],)  # row 0 stops on the token it chooses; row 1 on another; row 2 too many
    chunks[1].stop_ids = (first[1] + 1,)
    chunks[2].stop_ids = tuple(range(first[2], first[2] + 9))
    ids, stops = runner.execute(chunks).host()
    assert ids == first and stops == [True, False, None]  # None: nine ids, checked on the host instead
    ps = prompts(n=3, length=6)
    free = engine(tiny_model_dir).generate(ps, SamplingParams(max_tokens=8, **PARAMS))
    params = [SamplingParams(max_tokens=8, stop_token_ids=[out[4]], **PARAMS) for out in free]
    want, got = {}, {}
    for eng, into in ((engine(tiny_model_dir), want), (_with_step(tiny_model_dir, [1, 2, 4]), got)):
        for i, (p, sp) in enumerate(zip(ps, params)):
            eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished():
            for o in eng.step():
                into.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    into[o.request_id + ":reason"] = o.finish_reason
    assert got == want and all(want[f"r{i}:reason"].value == "stop" for i in range(3))


def rerun_record(fn, pool):
    """A CPU stand-in for CUDA graph capture: the first run's outputs are the static outputs, and each
    replay runs fn again and copies into them (a real replay writes the same memory)."""
    first = fn()

    def copy_into(dst, src):
        if isinstance(dst, torch.Tensor):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        elif isinstance(dst, tuple):
            for d, s in zip(dst, src):
                copy_into(d, s)
        else:  # a LayerCheckpoint between segments
            copy_into(dst.hidden, src.hidden)

    def replay():
        with torch.inference_mode():  # the forward's outputs are inference tensors
            copy_into(first, fn())

    return replay, first


def test_graph_control_flow_with_a_stand_in_capture(tiny_model_dir, ops, caplog):
    """Everything around the capture, on a CPU: one replay per bucket reading the persistent inputs,
    greedy ids and stop verdicts from the static outputs, per-layer segments with the arbiter's yield
    between them, and a failed capture falling back to eager with the reason in the status."""
    from gpuservd.runner.cuda_graphs import DecodeGraphs

    ps = prompts(n=5, length=5)
    params = SamplingParams(max_tokens=8, **PARAMS)
    want = engine(tiny_model_dir).generate(ps, params)
    eng = _with_step(tiny_model_dir, [1, 2, 4, 8])
    runner = eng.runner
    runner.decode_step.graphs = DecodeGraphs(runner.decode_step, record=rerun_record)
    runner.capture_graphs()
    assert runner.decode_status()["captured"] == [1, 2, 4, 8]
    assert eng.generate(ps, params) == want
    assert runner.decode_step.last_path == "graph"
    calls = []
    eng.yield_point = calls.append  # the arbiter: segments are captured now
    st = runner.decode_status()
    assert st["segmented"] and st["path"] == "cuda_graphs"
    assert eng.generate(ps, params) == want
    layers = runner.arch.num_layers
    assert calls and set(calls) == set(range(layers))  # prefill steps yield too; decode between segments
    decode_steps = sum(1 for r in eng.telemetry.recent() if r.num_prefill_tokens == 0 and r.num_decode_tokens)
    assert calls.count(0) >= decode_steps  # each decode step replayed its segments with a yield between

    def broken(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    eng2 = _with_step(tiny_model_dir, [2])
    eng2.runner.decode_step.graphs = DecodeGraphs(eng2.runner.decode_step, record=broken)
    with caplog.at_level("WARNING"):
        eng2.runner.capture_graphs()
    st = eng2.decode_status()
    assert st["path"] == "fixed_shape_eager" and "capture failed (RuntimeError: operation not permitted" in st["reason"]
    assert "decode steps run the fixed-shape step eagerly" in caplog.text
    assert eng2.generate(ps, params) == want


def test_a_layered_load_captures_at_the_first_decode_step(tiny_model_dir, ops):
    """While layers still stream in, nothing is captured; the first decode-only step after the load
    captures the whole-forward graphs, and the per-layer segments too when an arbiter already yields."""
    from gpuservd.runner.cuda_graphs import DecodeGraphs

    ps = prompts(n=2, length=5)
    params = SamplingParams(max_tokens=6, **PARAMS)
    want = engine(tiny_model_dir).generate(ps, params)
    cfg = EngineConfig(model="tiny", block_size=4, kv_cache_bytes=4 << 20)
    eng = LLMEngine("tiny", tiny_model_dir, cfg, initial_layers=1)
    step = eng.runner.enable_decode_step([1, 2])
    step.graphs = DecodeGraphs(step, record=rerun_record)
    calls = []
    eng.yield_point = calls.append  # before any capture: remembered
    assert step.graphs.captured == [] and not step.graphs.segmented
    assert eng.generate(ps, params) == want
    assert step.graphs.captured == [1, 2] and step.graphs.segmented and step.last_path == "graph"


def test_a_triton_kernel_that_fails_to_compile_is_a_one_line_logged_fallback(monkeypatch, caplog):
    """On CUDA the kernels are compiled at engine start; a failure is logged once, in one line, status says
    why, and the runner takes the torch ops (GPUSERV_TRITON=0 likewise). Checked here without a GPU: the
    failure comes before any CUDA call."""
    from gpuservd.runner import gpu_kernels

    monkeypatch.setattr(gpu_kernels, "_state", {})

    def broken():
        raise RuntimeError("CompilationError at 12:4:\n    acc += tl.dot(p, v)\nunsupported tile shape")

    monkeypatch.setattr(gpu_kernels, "_load", broken)
    with caplog.at_level("WARNING"):
        assert gpu_kernels.get("cuda:0", torch.bfloat16) is None
        assert gpu_kernels.get("cuda:0", torch.bfloat16) is None  # remembered: not compiled (or logged) again
    lines = [r.getMessage() for r in caplog.records if "Triton kernels not used" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "RuntimeError: unsupported tile shape" in lines[0]
    st = gpu_kernels.status()
    assert st["loaded"] is False and st["reason"] == "RuntimeError: unsupported tile shape"
    monkeypatch.setattr(gpu_kernels, "_state", {})
    monkeypatch.setenv("GPUSERV_TRITON", "0")
    assert gpu_kernels.get("cuda:0") is None and gpu_kernels.status() == {
        "loaded": False, "reason": "GPUSERV_TRITON=0", "compile_s": None, "disabled": True}
    assert gpu_kernels.get("cpu") is None  # the CPU has its C++ kernels instead
