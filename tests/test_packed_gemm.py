"""The packed bf16 kernel (csrc/packed_gemm.cpp) computes x @ W^T + b like torch, and Linear holds
bf16 weights in its pair-panel layout (one copy; a tied embedding is read back out of it).

The kernel exists only where the CPU has AVX512_BF16: these tests skip, saying so, elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import Linear, pack_pairs, packed_enabled, unpack_pairs


@pytest.fixture(scope="module")
def pk(ops):
    if not (hasattr(ops, "packed_available") and ops.packed_available()):
        pytest.skip("no AVX512_BF16 on this CPU (or the kernels were built without -mavx512bf16): "
                    "bf16 weights stay dense and take gemv / F.linear")
    return ops


def _ref(x, w, b):
    y = F.linear(x.float(), w.float())
    return y if b is None else y + b.float()


@pytest.mark.parametrize("out_f,in_f", [(1, 1), (7, 13), (16, 32), (17, 31), (33, 70), (960, 576), (576, 1536),
                                        (50, 577)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 31, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(pk, out_f, in_f, rows, bias):
    """Panel tails (out % 16), odd widths (a zero pair), row tails of the 8-row blocks, several 64-row chunks."""
    g = torch.Generator().manual_seed(out_f * 1000 + in_f * 10 + rows)
    x = (torch.randn(rows, in_f, generator=g) / 4).bfloat16()
    w = (torch.randn(out_f, in_f, generator=g) / 4).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    y = pk.packed_linear(x, pack_pairs(w), out_f, b)
    assert y.shape == (rows, out_f) and y.dtype == torch.bfloat16
    # One bf16 rounding of an fp32-accumulated result (plus fp32 summation-order noise).
    torch.testing.assert_close(y.float(), _ref(x, w, b), atol=1e-3 * in_f ** 0.5, rtol=8e-3)
    # fp32 out: the accumulators themselves, no rounding (products of bf16 are exact in fp32).
    yf = pk.packed_linear(x, pack_pairs(w), out_f, b, True)
    assert yf.dtype == torch.float32
    torch.testing.assert_close(yf, _ref(x, w, b), atol=1e-5 * in_f ** 0.5, rtol=1e-5)


def test_padding_never_multiplies_garbage(pk):
    """An odd width reads x through an even copy: a NaN past the row's end must not leak in."""
    big = torch.full((3, 8), float("nan")).bfloat16()
    big[:, :5] = torch.randn(3, 5).bfloat16()
    x = big[:, :5]  # row stride 8, width 5: the pair (x[4], x[5]) would read the NaN
    w = torch.randn(20, 5).bfloat16()
    y = pk.packed_linear(x, pack_pairs(w), 20, None)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), _ref(x, w, None), atol=0.05, rtol=8e-3)


def test_packed_linear_refuses_wrong_shapes(pk):
    w = pack_pairs(torch.randn(20, 6).bfloat16())
    with pytest.raises(RuntimeError, match="packed_linear"):
        pk.packed_linear(torch.randn(2, 8).bfloat16(), w, 20, None)  # wrong width
    with pytest.raises(RuntimeError, match="packed_linear"):
        pk.packed_linear(torch.randn(2, 6).bfloat16(), w, 40, None)  # more outputs than packed
    with pytest.raises(RuntimeError, match="packed_linear"):
        pk.packed_linear(torch.randn(2, 6), w, 20, None)  # fp32 x
    with pytest.raises(RuntimeError, match="packed_linear"):
        pk.packed_linear(torch.randn(2, 6).bfloat16(), w, 20, torch.randn(19).bfloat16())
    assert pk.packed_linear(torch.randn(0, 6).bfloat16(), w, 20, None).shape == (0, 20)


def test_pack_round_trip_and_rows():
    w = torch.randn(37, 11).bfloat16()
    p = pack_pairs(w)
    assert p.shape == (3, 6, 32)
    assert torch.equal(unpack_pairs(p, 37, 11), w)
    assert torch.equal(p.view(3, 6, 16, 2)[2, 5, 4, 0], w[36, 10])  # packed[p][kk][2j + e] = W[16p + j][2kk + e]


def test_linear_holds_one_packed_copy_and_serves_every_row_count(pk, monkeypatch):
    w, b = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16()
    lin = Linear(w, b)
    assert lin.packed is not None and lin.weight is None and not lin.gemv
    assert lin.nbytes == lin.packed.numel() * 2 + 48 * 2
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 47, 16, 15, 3])
    assert torch.equal(lin.rows(ids), w[ids])
    calls = []
    real = lin._ops

    class Spy:
        def packed_linear(self, *a):
            calls.append(a[0].shape[0])
            return real.packed_linear(*a)

    monkeypatch.setattr(lin, "_ops", Spy())
    for rows in (1, 64, 65, 300):
        x = torch.randn(rows, 40).bfloat16()
        torch.testing.assert_close(lin(x).float(), _ref(x, w, b), atol=0.05, rtol=8e-3)
    assert calls == [1, 64, 65, 300]
    x3 = torch.randn(2, 3, 40).bfloat16()  # leading dims are flattened and restored
    torch.testing.assert_close(lin(x3).float(), _ref(x3, w, b), atol=0.05, rtol=8e-3)
    # fp32 takes column panels instead (test_packed_gemm_f32.py); the switch keeps the dense layout
    assert Linear(w.float(), b.float()).panels
    monkeypatch.setenv("GPUSERV_PACKED_WEIGHTS", "0")
    assert not packed_enabled(torch.device("cpu"), torch.bfloat16)
    assert Linear(w, b).packed is None


def test_tied_embedding_is_one_packed_tensor(pk, tmp_path, monkeypatch):
    """A tied LM head packed: the dense embedding is dropped and token rows come from the head."""
    from factories import make_model_dir

    from gpuservd.runner.model_config import load_arch
    from gpuservd.runner.load import load_weights

    tiny_model_dir = make_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    arch = load_arch(tiny_model_dir)
    assert arch.tie_word_embeddings
    packed = load_weights(tiny_model_dir, arch, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("GPUSERV_PACKED_WEIGHTS", "0")
    dense = load_weights(tiny_model_dir, arch, torch.bfloat16, torch.device("cpu"))
    assert dense.embed is not None and dense.lm_head.weight is dense.embed
    assert packed.embed is None and packed.tied and packed.lm_head.packed is not None
    ids = torch.tensor([1, 5, arch.vocab_size - 1])
    assert torch.equal(packed.embed_tokens(ids), packed.lm_head.dense()[ids])
    assert torch.equal(packed.embed_tokens(ids), dense.embed_tokens(ids))
    # counted once
    head = packed.lm_head.nbytes
    layers = sum(lw.nbytes() for lw in packed.layers)
    assert packed.nbytes() == head + layers + packed.final_norm.numel() * 2
