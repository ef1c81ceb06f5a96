"""8-bit column panels (runner/q8_panels.py, csrc/q8_panels.cpp) for fp32 weights that are exactly an 8-bit
grid, as GGUF's Q8_0 dequantises to (the store's SmolLM2 embedding and tied LM head): the grid is found value
for value, the fp32 kernel on its codes gives the same bits as on fp32 panels at every row count and thread
count, a weight one value off (or the switch off) keeps fp32 panels, dense() and rows() read it back
exactly, and a model whose tied LM head is such a weight answers with the same logits either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_q4_panels import assert_same_as_fp32_panels, engine_outputs, f32ops, gguf_grid, q4_1  # noqa: F401 (fixture)

from gpuservd.runner import code_panels, q4_panels, q8_panels
from gpuservd.runner.linear import Linear


def q8_0(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as the store holds SmolLM2's embedding and tied LM head: GGUF Q8_0, dequantised."""
    return gguf_grid(n, k, GGMLQuantizationType.Q8_0, seed)


@pytest.mark.parametrize("n,k", [(40, 64), (100, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_panels_are_bit_identical_to_fp32_panels(f32ops, n, k, threads):
    w, b = q8_0(n, k, seed=n), torch.randn(n)
    w[3, 32:64] = 0.0  # a group of zeros: scale 0
    qp = f32ops.pack_panels_q8(w)
    assert qp.dtype == torch.uint8 and qp.shape == (-(-n // 16), k // 32, q8_panels.GROUP_BYTES)
    assert torch.equal(q8_panels.unpack(qp, n, k), w)
    assert_same_as_fp32_panels(f32ops, qp, w, b, threads)

def test_linear_takes_q8_panels_only_for_an_exact_grid(f32ops, monkeypatch):
    w = q8_0(64, 128, seed=1)
    lin = Linear(w.clone())
    assert lin.packed.shape[-1] == q8_panels.GROUP_BYTES and lin.nbytes == lin.packed.numel()
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 17, 63, 8, 7, 17])  # a panel twice, first and last columns
    assert torch.equal(lin.rows(ids), w[ids])  # an embedding lookup reads only those rows' panels
    x = torch.randn(3, 128)
    off = w.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1.0))  # one value one ulp off its grid
    assert f32ops.pack_panels_q8(off).numel() == 0 and Linear(off).packed.dtype == torch.float32
    assert f32ops.pack_panels_q8(torch.randn(64, 128)).numel() == 0
    monkeypatch.setenv(q8_panels.SWITCH, "0")
    assert Linear(w.clone()).packed.dtype == torch.float32
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_each_grid_gets_its_own_format(f32ops):
    """A Q4_1 weight is not taken for an 8-bit one or the reverse; a 4-bit grid takes the fewer bytes."""
    w4, w8 = q4_1(32, 64), q8_0(32, 64)
    assert code_panels.format_of(code_panels.pack_exact(w4, f32ops)) is q4_panels
    assert code_panels.format_of(code_panels.pack_exact(w8, f32ops)) is q8_panels
    assert f32ops.pack_panels_q4(w8).numel() == 0
    with pytest.raises(ValueError, match="code-panel"):
        code_panels.format_of(torch.zeros(2, 2, 7, dtype=torch.uint8))


def test_bad_q8_panels_are_refused(f32ops):
    w = q8_0(32, 64)
    qp = f32ops.pack_panels_q8(w)
    with pytest.raises(RuntimeError, match="weight packs"):
        f32ops.packed_linear_f32(torch.randn(2, 96), qp, 32, None)
    with pytest.raises(RuntimeError, match="8-bit"):
        f32ops.packed_linear_f32(torch.randn(2, 64), qp[:, :, :100].contiguous(), 32, None)


def test_a_model_with_a_q8_lm_head_answers_the_same_with_its_codes(f32ops, tmp_path, monkeypatch):
    """A tiny tied Llama whose embedding went through GGUF's Q8_0 (as the store's SmolLM2's did): its engine
    holds the tied LM head as 8-bit panels, looks tokens up in them, and generates the same tokens with the
    same logprobs, bit for bit, as with fp32 panels."""
    from factories import make_model_dir
    from safetensors.torch import load_file, save_file

    from gpuservd.bench.floor import held_weight_bytes

    model_dir = make_model_dir(tmp_path / "q8", tie_word_embeddings=True)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("lm_head.weight", None)  # tied: the embedding is the head
    t = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = q8_0(*t.shape, seed=3)
    save_file(tensors, path)

    def run(switch: str):
        monkeypatch.setenv(q8_panels.SWITCH, switch)
        eng, got = engine_outputs(model_dir, "q8")
        assert eng.runner.weights.tied
        head = eng.runner.weights.lm_head.packed
        return head.shape[-1], held_weight_bytes(eng.runner.weights, eng.runner.arch.num_layers), got

    (q8_width, q8_bytes, q8), (fp_width, fp_bytes, fp) = run("1"), run("0")
    assert q8_width == q8_panels.GROUP_BYTES and fp_width == 16
    assert q8_bytes < fp_bytes
    assert q8 == fp and all(len(v) == 12 for v in q8.values())
