"""4-bit column panels (runner/q4_panels.py, csrc/packed_gemm_f32.cpp) for fp32 weights that are exactly a
4-bit grid, as GGUF's Q4_1 dequantises to: the grid is found value for value, the fp32 kernel on its codes
gives the same bits as on fp32 panels at every row count and thread count, a weight one value off (or the
switch off) keeps fp32 panels, dense() and rows() read it back exactly, and a model whose projections
are such weights answers with the same logits either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpuservd.runner import q4_panels
from gpuservd.runner.linear import Linear, pack_panels


@pytest.fixture
def f32ops(ops):
    if not ops.packed_f32_available():
        pytest.skip("kernels built without AVX2/FMA: fp32 stays dense (oneDNN / F.linear)")
    return ops


def gguf_grid(n: int, k: int, kind: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """Random weights through GGUF's own quantiser and dequantiser of `kind`."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(w, kind), kind), dtype=np.float32))


def q4_1(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as the store holds SmolLM2's projections: GGUF Q4_1, dequantised."""
    return gguf_grid(n, k, GGMLQuantizationType.Q4_1, seed)


def assert_same_as_fp32_panels(ops, qp, w, b, threads):
    """The matmul on code panels qp gives the bits fp32 panels of w give, at every row count (the register
    path and the buffered one) and every tile height, with and without the bias."""
    n, k = w.shape
    fp = pack_panels(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 7, 8, 13, 48, 100):
            x = torch.randn(rows, k)
            for tile_rows in (0, 1, 4, 6):
                for bias in (None, b):
                    a = ops.packed_linear_f32(x, fp, n, bias, tile_rows)
                    c = ops.packed_linear_f32(x, qp, n, bias, tile_rows)
                    assert torch.equal(a, c), (rows, tile_rows)
            torch.testing.assert_close(c, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(old)


def engine_outputs(model_dir, name: str):
    """A float32 engine on model_dir (switches as the environment has them), four requests to the end:
    (the engine, each request's logprobs a token)."""
    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.engine.request import SamplingParams

    eng = LLMEngine(name, model_dir, EngineConfig(model=name, dtype="float32", kv_cache_bytes=4 << 20, block_size=4))
    params = SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False, logprobs=3)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate((1, 9, 40, 5)):
        eng.add_request(f"r{i}", torch.randint(3, 290, (n,), generator=g).tolist(), params)
    got: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.logprobs or [])
    return eng, got


@pytest.mark.parametrize("n,k", [(40, 64), (96, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q4_panels_are_bit_identical_to_fp32_panels(f32ops, n, k, threads):
    w, b = q4_1(n, k, seed=n), torch.randn(n)
    qp = f32ops.pack_panels_q4(w)
    assert qp.dtype == torch.uint8 and qp.shape == (-(-n // 16), k // 32, q4_panels.GROUP_BYTES)
    assert torch.equal(q4_panels.unpack(qp, n, k), w)
    assert_same_as_fp32_panels(f32ops, qp, w, b, threads)


def test_linear_takes_q4_panels_only_for_an_exact_grid(f32ops, monkeypatch):
    w = q4_1(64, 128, seed=1)
    lin = Linear(w.clone())
    assert lin.packed.dtype == torch.uint8 and lin.nbytes == lin.packed.numel()
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 17, 63, 8, 7, 17])  # both nibbles of a byte, a panel twice
    assert torch.equal(lin.rows(ids), w[ids])  # an embedding lookup reads only those rows' panels
    x = torch.randn(3, 128)
    assert torch.equal(lin(x), Linear(w.clone(), use_packed=True).__call__(x))
    off = w.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1.0))  # one value one ulp off its grid
    assert f32ops.pack_panels_q4(off).numel() == 0 and Linear(off).packed.dtype == torch.float32
    assert f32ops.pack_panels_q4(torch.randn(64, 128)).numel() == 0
    monkeypatch.setenv(q4_panels.SWITCH, "0")
    assert Linear(w.clone()).packed.dtype == torch.float32
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_bad_q4_panels_are_refused(f32ops):
    w = q4_1(32, 64)
    qp = f32ops.pack_panels_q4(w)
    with pytest.raises(RuntimeError, match="weight packs"):
        f32ops.packed_linear_f32(torch.randn(2, 96), qp, 32, None)
    with pytest.raises(RuntimeError, match="4-bit"):
        f32ops.packed_linear_f32(torch.randn(2, 64), qp[:, :, :100].contiguous(), 32, None)


def test_a_model_on_q4_grids_answers_the_same_with_its_codes(f32ops, tmp_path, monkeypatch):
    """A tiny Llama whose projections went through GGUF's Q4_1 (as the store's SmolLM2 did): its engine holds
    them as 4-bit panels and generates the same tokens with the same logprobs, bit for bit, as with fp32
    panels, decode rows and prefill chunks both (the whole decoder stack in one C++ op)."""
    from factories import make_model_dir
    from safetensors.torch import load_file, save_file

    from gpuservd.bench.floor import held_weight_bytes

    model_dir = make_model_dir(tmp_path / "q4")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name.endswith("proj.weight"):
            tensors[name] = q4_1(*t.shape, seed=i)
    save_file(tensors, path)

    def run(switch: str):
        monkeypatch.setenv(q4_panels.SWITCH, switch)
        eng, got = engine_outputs(model_dir, "q4")
        kinds = {eng.runner.weights.layer(0).qkv.packed.dtype, eng.runner.weights.layer(0).down.packed.dtype}
        return kinds, held_weight_bytes(eng.runner.weights, eng.runner.arch.num_layers), got

    (q4_kinds, q4_bytes, q4), (fp_kinds, fp_bytes, fp) = run("1"), run("0")
    assert q4_kinds == {torch.uint8} and fp_kinds == {torch.float32}
    assert q4_bytes < fp_bytes  # the bench's batch-1 floor counts the bytes held: the codes', not fp32's
    assert q4 == fp and all(len(v) == 12 for v in q4.values())
