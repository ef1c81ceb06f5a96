"""The packed fp32 kernel (csrc/packed_gemm_f32.cpp) computes x @ W^T + b like torch for every row
count, and Linear holds fp32 CPU weights in its column panels by default (one copy; a tied embedding
is read back out of it; GPUSERV_PACKED_WEIGHTS=0 keeps the dense layout)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuservd.runner.linear import Linear, pack_panels, packed_enabled, unpack_panels


def _check(y, x, w, b):
    """Within fp32 rounding of the exact (fp64) answer: relative to the output's largest magnitude,
    the error stays under 5e-6 (one accumulator chain along k: 2.5e-6 at 4099 columns, where torch's
    blocked sums reach 2.5e-7), and y matches F.linear to 1e-5."""
    ref = x.double() @ w.double().t()
    if b is not None:
        ref = ref + b.double()
    scale = ref.abs().max().item() + 1e-30
    assert (y.double() - ref).abs().max().item() / scale < 5e-6
    assert (y - F.linear(x, w, b)).abs().max().item() / scale < 1e-5


# Panel tails (out % 16), a single input column, SmolLM2's shapes, a width over the 256-column K block
# with a tail, a long row.
SHAPES = [(1, 1), (7, 13), (16, 32), (17, 31), (50, 577), (960, 576), (576, 1536), (33, 4099)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 16, 31, 64, 97, 130, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(ops, out_f, in_f, rows, bias):
    """Row counts: one tile, split tiles, several 96-row chunks (decode batches and prefill chunks)."""
    g = torch.Generator().manual_seed(out_f * 1000 + in_f * 10 + rows)
    x, w = torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    y = ops.packed_linear_f32(x, pack_panels(w), out_f, b)
    assert y.shape == (rows, out_f) and y.dtype == torch.float32
    _check(y, x, w, b)


@pytest.mark.parametrize("tile_rows", range(1, 13))
def test_every_tile_height(ops, tile_rows):
    """The AVX2 build tiles 6 rows, an AVX-512VL build 12: every height's code runs here too."""
    g = torch.Generator().manual_seed(tile_rows)
    w, b = torch.randn(40, 300, generator=g), torch.randn(40, generator=g)
    p = pack_panels(w)
    for rows in (1, tile_rows, tile_rows + 1, 2 * tile_rows + 3, 100):
        x = torch.randn(rows, 300, generator=g)
        _check(ops.packed_linear_f32(x, p, 40, b, tile_rows), x, w, b)


def test_x_with_a_row_stride(ops):
    """A column slice of a wider tensor (unit column stride, row stride > in) is read in place."""
    big = torch.randn(20, 100)
    x = big[:, 10:74]
    w = torch.randn(20, 64)
    _check(ops.packed_linear_f32(x, pack_panels(w), 20, None), x, w, None)


def test_refuses_wrong_shapes(ops):
    w = pack_panels(torch.randn(20, 6))
    assert w.shape == (2, 6, 16)
    for bad in ((torch.randn(2, 8), w, 20, None),  # wrong width
                (torch.randn(2, 6), w, 40, None),  # more outputs than packed
                (torch.randn(2, 6).bfloat16(), w, 20, None),  # bf16 x
                (torch.randn(2, 6), w, 20, torch.randn(19)),  # bias of the wrong length
                (torch.randn(2, 6), w.transpose(1, 2), 20, None)):  # not a panel tensor
        with pytest.raises(RuntimeError, match="packed_linear_f32"):
            ops.packed_linear_f32(*bad)
    with pytest.raises(RuntimeError, match="tile_rows"):
        ops.packed_linear_f32(torch.randn(2, 6), w, 20, None, 13)
    assert ops.packed_linear_f32(torch.randn(0, 6), w, 20, None).shape == (0, 20)


@pytest.mark.parametrize("n,k", [(37, 11), (64, 40), (16, 8), (5, 3), (48, 577)])
def test_pack_round_trip(n, k):
    """Whole panels (register transposes of 8 x 8 blocks plus a column tail) and a zero-padded last one."""
    w = torch.randn(n, k)
    p = pack_panels(w)
    P = -(-n // 16)
    assert p.shape == (P, k, 16) and p.is_contiguous()
    assert torch.equal(p, F.pad(w, (0, 0, 0, 16 * P - n)).reshape(P, 16, k).transpose(1, 2))
    assert torch.equal(unpack_panels(p, n, k), w)
    assert p[(n - 1) // 16, k - 1, (n - 1) % 16] == w[n - 1, k - 1]  # packed[p][k][j] = W[16p + j][k]


def test_linear_packs_fp32_by_default_and_serves_every_row_count(ops, monkeypatch):
    if not ops.packed_f32_available():
        pytest.skip("kernels built without AVX2/FMA: fp32 stays dense (oneDNN / F.linear)")
    w, b = torch.randn(48, 40), torch.randn(48)
    lin = Linear(w, b)
    assert lin.panels and lin.packed is not None and lin.weight is None and not lin.gemv
    assert lin.nbytes == lin.packed.numel() * 4 + 48 * 4 == (48 * 40 + 48) * 4
    assert torch.equal(lin.dense(), w)
    ids = torch.tensor([0, 47, 16, 15, 3])
    assert torch.equal(lin.rows(ids), w[ids])
    calls = []
    real = lin._ops

    class Spy:
        def packed_linear_f32(self, *a):
            calls.append(a[0].shape[0])
            return real.packed_linear_f32(*a)

    monkeypatch.setattr(lin, "_ops", Spy())
    rows_seen = (1, 8, 32, 64, 65, 300)
    for rows in rows_seen:
        x = torch.randn(rows, 40)
        _check(lin(x), x, w, b)
    assert calls == list(rows_seen)
    xt = torch.randn(40, 7).t()  # column stride 7: copied to unit stride first
    _check(lin(xt), xt, w, b)
    x3 = torch.randn(2, 3, 40)  # leading dims are flattened and restored
    torch.testing.assert_close(lin(x3), F.linear(x3, w, b), atol=1e-4, rtol=1e-5)
    assert lin.fp32(x3[0]).dtype == torch.float32
    monkeypatch.setenv("GPUSERV_PACKED_WEIGHTS", "0")
    assert not packed_enabled(torch.device("cpu"), torch.float32)
    dense = Linear(w, b)
    assert dense.packed is None and dense.weight is w and dense.gemv


def test_fp32_model_loads_into_panels_with_one_tied_copy(ops, tmp_path, monkeypatch):
    """Every layer's matmuls and the tied head take the packed path by default; the embedding's rows
    come out of the head's panels, and the model's bytes count it once."""
    if not ops.packed_f32_available():
        pytest.skip("kernels built without AVX2/FMA: fp32 stays dense (oneDNN / F.linear)")
    from factories import make_model_dir

    from gpuservd.runner.load import load_weights
    from gpuservd.runner.model_config import load_arch

    model_dir = make_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    arch = load_arch(model_dir)
    packed = load_weights(model_dir, arch, torch.float32, torch.device("cpu"))
    for lw in packed.layers:
        for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
            assert lin.panels and lin.weight is None
    assert packed.embed is None and packed.tied and packed.lm_head.panels
    monkeypatch.setenv("GPUSERV_PACKED_WEIGHTS", "0")
    dense = load_weights(model_dir, arch, torch.float32, torch.device("cpu"))
    assert dense.embed is not None and dense.lm_head.weight is dense.embed
    ids = torch.tensor([1, 5, arch.vocab_size - 1])
    assert torch.equal(packed.embed_tokens(ids), dense.embed_tokens(ids))
    assert packed.nbytes() == dense.nbytes()
    for lp, ld in zip(packed.layers, dense.layers):
        assert torch.equal(lp.gate_up.dense(), ld.gate_up.weight)
        x = torch.randn(5, arch.hidden_size)
        torch.testing.assert_close(lp.qkv(x), ld.qkv(x), atol=1e-5, rtol=1e-5)


_LOAD_RSS = """
import sys, torch
from gpuservd.runner.load import load_weights
from gpuservd.runner.model_config import load_arch
import gpuservd.runner.load as load
if sys.argv[2] == "keep":
    load.return_freed_memory = lambda device: None
d = sys.argv[1]
w = load_weights(d, load_arch(d), torch.float32, torch.device("cpu"))
assert w.lm_head.panels
anon = int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) << 10
print(anon - w.nbytes())
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/status")
def test_packing_does_not_leave_a_second_copy_resident(ops, smollm2_dir):
    """The dense fp32 copies the panels are built from are dropped, and their heap pages given back:
    the process holds SmolLM2's weights once (plus the interpreter and torch), not the dense copies too."""
    if not ops.packed_f32_available():
        pytest.skip("kernels built without AVX2/FMA: fp32 stays dense (oneDNN / F.linear)")
    import os
    import subprocess
    import sys

    # Both loads at once, one thread each: each process reads only its own RssAnon.
    procs = {mode: subprocess.Popen([sys.executable, "-c", _LOAD_RSS, str(smollm2_dir), mode],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=os.environ | {"OMP_NUM_THREADS": "1"}) for mode in ("keep", "return")}

    def extra(mode):
        out, err = procs[mode].communicate(timeout=300)
        assert procs[mode].returncode == 0, err
        return int(out.split()[-1])

    try:
        kept, returned = extra("keep"), extra("return")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert kept - returned > 64 << 20  # what glibc kept of the dense copies (~140 MB here)
    assert returned < 250 << 20  # above the 540 MB of weights: the runtime's own memory only


def test_a_library_without_avx2_keeps_fp32_dense(monkeypatch):
    """Its scalar tile would stand in for oneDNN: fp32 stays in the dense layout there."""
    from gpuservd.runner import cpu_kernels

    class NoAvx2:
        def packed_f32_available(self):
            return False

    monkeypatch.setattr(cpu_kernels, "get", lambda: NoAvx2())
    assert not packed_enabled(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("out_f", [16 * 17 + 5, 16 * 40, 3])
def test_every_panel_once_for_any_team_size(ops, threads, out_f):
    """Weights over the 256 KB threshold go to the thread team in chunks of panels, and a thread done
    early takes chunks from the back of another's run: with more threads than cores (8 on a 2-core
    machine, where some start late and others take their chunks), fewer panels than threads (3 outputs:
    one panel) and a tail of 5 columns, every output is written once and right (y starts uninitialised),
    with fp32 and bf16 panels alike."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(out_f + threads)
        w = (torch.randn(out_f, 4100, generator=g) / 8).bfloat16().float()  # >= 256 KB from 1 panel up
        b = torch.randn(out_f, generator=g)
        fp32, halves = pack_panels(w), ops.pack_panels_bf16(w)
        for rows in (1, 8, 48):
            x = torch.randn(rows, 4100, generator=g)
            y = ops.packed_linear_f32(x, fp32, out_f, b)
            _check(y, x, w, b)
            for _ in range(3):  # the split differs from call to call; each panel's sums do not
                assert torch.equal(ops.packed_linear_f32(x, fp32, out_f, b), y)
                assert torch.equal(ops.packed_linear_f32(x, halves, out_f, b), y)
    finally:
        torch.set_num_threads(old)
