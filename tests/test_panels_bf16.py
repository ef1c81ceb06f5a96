"""bf16 column panels (csrc/packed_panels_f32.cpp) for fp32 weights whose every value is exactly a bf16:
the fp32 kernel on them gives the same bits as on fp32 panels, Linear picks them only for such weights
(its switch keeps fp32 panels), and rows / dense read them back exactly. Also: panel tensors of 2 MB
or more are mapped for transparent huge pages."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from gpuservd.runner.linear import BF16_PANELS_SWITCH, HUGE_PAGES_SWITCH, Linear, pack_panels, unpack_panels


@pytest.fixture
def f32ops(ops):
    if not ops.packed_f32_available():
        pytest.skip("kernels built without AVX2/FMA: fp32 stays dense (oneDNN / F.linear)")
    return ops


def _exact(*shape, seed=0):
    """Random fp32 values that are exactly bf16 (as an fp32 model upcast from a bf16 checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16().float()


# Panel tails (out % 16 of 1, 7, 9, 15), one input column, K over the 256-column block with a tail.
SHAPES = [(1, 1), (7, 13), (16, 32), (25, 577), (41, 300), (63, 1030)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_panels_are_bit_identical_to_fp32_panels(f32ops, out_f, in_f, threads):
    """Every row count 1-16 (and a few past a 96-row chunk), every tile height, with and without bias."""
    w, b = _exact(out_f, in_f, seed=out_f), torch.randn(out_f)
    pf, pb = pack_panels(w), f32ops.pack_panels_bf16(w)
    assert pb.dtype == torch.bfloat16 and pb.shape == pf.shape
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in list(range(1, 17)) + [31, 100]:
            x = torch.randn(rows, in_f)
            for tile_rows in (0, 1, 3, 4, 6, 8, 12):
                for bias in (None, b):
                    a = f32ops.packed_linear_f32(x, pf, out_f, bias, tile_rows)
                    c = f32ops.packed_linear_f32(x, pb, out_f, bias, tile_rows)
                    assert torch.equal(a, c), (rows, tile_rows)
            torch.testing.assert_close(c, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


def test_bf16_panel_layout_and_refusals(f32ops):
    """Columns 0-7 in the even halves of a k step, 8-15 in the odd ones, zero padded; a weight with a
    value that is not exactly bf16 is refused (its panels would round it), as are bad inputs."""
    w = _exact(20, 6, seed=3)
    p = f32ops.pack_panels_bf16(w)
    assert p.shape == (2, 6, 16)
    assert p[0, 2, 0] == w[0, 2] and p[0, 2, 1] == w[8, 2] and p[0, 2, 14] == w[7, 2] and p[0, 2, 15] == w[15, 2]
    assert p[1, 5, 6] == w[19, 5] and (p[1, :, 8:].float() == 0).all() and p[1, 0, 9] == 0
    assert torch.equal(unpack_panels(p, 20, 6), w)
    assert f32ops.bf16_exact(w) and f32ops.bf16_exact(torch.zeros(0))
    near = w.clone()
    near.view(torch.int32)[19, 5] += 1  # one value off by one ulp of fp32: no longer a bf16
    assert not f32ops.bf16_exact(near)
    with pytest.raises(RuntimeError, match="not exactly bf16"):
        f32ops.pack_panels_bf16(near)
    with pytest.raises(RuntimeError, match="pack_panels_bf16"):
        f32ops.pack_panels_bf16(w.bfloat16())
    with pytest.raises(RuntimeError, match="packed_linear_f32"):
        f32ops.packed_linear_f32(torch.randn(2, 7), p, 20, None)  # width
    with pytest.raises(RuntimeError, match="packed_linear_f32"):
        f32ops.packed_linear_f32(torch.randn(2, 6), p.half(), 20, None)  # fp16 panels


def test_linear_holds_bf16_exact_weights_in_bf16_panels(f32ops, monkeypatch):
    """Half the bytes, the same outputs bit for bit, rows and dense read back exactly; a weight that is
    not bf16-exact, or the switch off, keeps fp32 panels."""
    w, b = _exact(48, 40, seed=5), torch.randn(48)
    lin = Linear(w, b)
    assert lin.panels and lin.packed.dtype == torch.bfloat16 and lin.weight is None
    assert lin.nbytes == 48 * 40 * 2 + 48 * 4
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 47, 16, 15, 8, 7, 3, 40])
    assert lin.rows(ids).dtype == torch.float32 and torch.equal(lin.rows(ids), w[ids])
    monkeypatch.setenv(BF16_PANELS_SWITCH, "0")
    ref = Linear(w, b)
    assert ref.packed.dtype == torch.float32
    for rows in (1, 5, 8, 13, 16, 64):
        x = torch.randn(rows, 40)
        assert torch.equal(lin(x), ref(x))
    monkeypatch.delenv(BF16_PANELS_SWITCH)
    inexact = torch.randn(48, 40)
    assert Linear(inexact, b).packed.dtype == torch.float32
    big = torch.randn(1024, 576)  # 2.4 MB of panels: a huge-page mapping unless switched off
    assert "hg" in _vm_flags(Linear(big).packed.data_ptr())
    monkeypatch.setenv(HUGE_PAGES_SWITCH, "0")
    assert "hg" not in (_vm_flags(Linear(big).packed.data_ptr()) or [])


def test_tied_bf16_exact_embedding_is_one_bf16_panel_tensor(f32ops, tmp_path, monkeypatch):
    """An fp32 model whose tied embedding is bf16-exact (a bf16 checkpoint served in fp32): the head holds it in bf16 panels,
    token embeddings come out of them exactly, and logits match the fp32-panel head bit for bit."""
    from factories import make_model_dir

    from gpuservd.runner.load import load_weights
    from gpuservd.runner.model_config import load_arch

    model_dir = make_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    arch = load_arch(model_dir)

    def load(switch):
        monkeypatch.setenv(BF16_PANELS_SWITCH, switch)
        return load_weights(model_dir, arch, torch.float32, torch.device("cpu"))

    # Round the head to bf16 values before it is packed: what a bf16 checkpoint upcast to fp32 holds.
    import gpuservd.runner.load as load_mod

    real_linear = load_mod.Linear

    def rounding_linear(weight, *a, **k):
        if weight.shape[0] == arch.vocab_size:
            weight = weight.bfloat16().float()
        return real_linear(weight, *a, **k)

    monkeypatch.setattr(load_mod, "Linear", rounding_linear)
    bf, fp = load("1"), load("0")
    assert bf.embed is None and bf.lm_head.packed.dtype == torch.bfloat16
    assert fp.lm_head.packed.dtype == torch.float32
    assert bf.layers[0].qkv.packed.dtype == torch.float32  # random fp32 layer weights: not bf16-exact
    ids = torch.tensor([0, 1, 5, arch.vocab_size - 1])
    assert torch.equal(bf.embed_tokens(ids), fp.embed_tokens(ids))
    x = torch.randn(8, arch.hidden_size)
    assert torch.equal(bf.lm_head(x), fp.lm_head(x))


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping that holds addr, or None."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head[0].split("-")) == 2 and not line.startswith(("VmFlags", " ")):
            try:
                lo, hi = (int(v, 16) for v in head[0].split("-"))
            except ValueError:
                continue
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("bf16", [False, True])
def test_large_panel_tensors_are_mapped_for_huge_pages(f32ops, bf16):
    """A panel tensor of >= 2 MB starts on a 2 MB boundary in a mapping marked MADV_HUGEPAGE (VmFlags
    'hg'); whether the kernel then backs it with huge pages depends on its THP setting. Freed, its
    mapping goes away."""
    w = _exact(2048, 576, seed=7) if bf16 else torch.randn(1024, 576)
    p = f32ops.pack_panels_bf16(w) if bf16 else f32ops.pack_panels_f32(w)
    addr = p.data_ptr()
    assert addr % (2 << 20) == 0 and "hg" in _vm_flags(addr)
    assert torch.equal(unpack_panels(p, w.shape[0], 576), w)
    del p
    assert "hg" not in (_vm_flags(addr) or [])  # unmapped (a later mapping there is not marked)
    plain = f32ops.pack_panels_bf16(w, False) if bf16 else f32ops.pack_panels_f32(w, False)  # the A/B switch
    assert "hg" not in (_vm_flags(plain.data_ptr()) or []) and torch.equal(unpack_panels(plain, w.shape[0], 576), w)
    small = torch.randn(64, 64)  # under 2 MB: torch's allocator
    assert torch.equal(unpack_panels(f32ops.pack_panels_f32(small), 64, 64), small)
