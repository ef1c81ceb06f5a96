"""The C++ paged decode kernel agrees with the torch gather + SDPA path, and its absence is survivable."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from gpuservd.runner import cpu_kernels
from gpuservd.runner.attention import decode_attention, decode_attention_torch
from gpuservd.runner.batch import SeqChunk, build_batch

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.fixture(scope="module")
def kernel():
    ops = cpu_kernels.get()
    if ops is None:
        if HAS_COMPILER:
            pytest.fail(f"a compiler is present but the kernel did not load: {cpu_kernels.status()['reason']}")
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    return ops.paged_decode


def _case(lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Random caches, scattered block tables and a non-contiguous q, as the runner hands them over."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks of a sequence are not adjacent
    chunks, at = [], 0
    for n, nb in zip(lens, need):
        chunks.append(SeqChunk([0], n - 1, perm[at : at + nb], True))
        at += nb
    batch = build_batch(chunks, block_size, torch.device("cpu"))
    # q is a slice of the rotated q+k heads in the runner: rows strided past kv_heads extra heads.
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g).to(dtype)
    return qk[:, :heads], k_cache, v_cache, batch


LENS = [1, 16, 17, 15, 32, 5, 64, 33]  # 1 token, exact block multiples, one past / short of a boundary
CASES = {
    "gqa-smollm2-shape": dict(lens=LENS, heads=9, kv_heads=3, head_dim=64, block_size=16),
    "mha": dict(lens=LENS, heads=4, kv_heads=4, head_dim=32, block_size=16),
    "gqa-8-per-kv": dict(lens=LENS, heads=16, kv_heads=2, head_dim=128, block_size=8),
    "mqa": dict(lens=LENS, heads=6, kv_heads=1, head_dim=64, block_size=16),
    "odd-head-dim-scalar-path": dict(lens=LENS, heads=6, kv_heads=2, head_dim=12, block_size=4),
    "group-10-generic-path": dict(lens=LENS, heads=10, kv_heads=1, head_dim=64, block_size=16),
    "block-size-1": dict(lens=[1, 2, 7], heads=4, kv_heads=2, head_dim=16, block_size=1),
    # Past one 256-token partition: the partial softmaxes are combined (512 = exactly two partitions).
    "long-partitions": dict(lens=[1000, 256, 512, 257, 3, 770], heads=9, kv_heads=3, head_dim=64, block_size=16),
    "single-long": dict(lens=[2049], heads=9, kv_heads=3, head_dim=64, block_size=16),
    # Blocks longer than the kernel's 32-token step: a block is walked in several steps, the last short.
    "block-size-64": dict(lens=[1, 31, 32, 33, 64, 65, 200], heads=9, kv_heads=3, head_dim=64, block_size=64),
    "block-size-48-gqa-4": dict(lens=[47, 48, 49, 97, 300], heads=8, kv_heads=2, head_dim=32, block_size=48),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_torch_path_fp32(kernel, name, seed):
    q, k_cache, v_cache, batch = _case(**CASES[name], dtype=torch.float32, seed=seed)
    scale = q.shape[-1] ** -0.5
    want = decode_attention_torch(q, k_cache, v_cache, batch, scale)
    got = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_kernel_matches_fp32_reference_in_low_precision(kernel, dtype, atol):
    q, k_cache, v_cache, batch = _case(**CASES["long-partitions"], dtype=dtype, seed=2)
    scale = q.shape[-1] ** -0.5
    # Reference on the same (rounded) inputs in fp32; the kernel accumulates in fp32 and rounds once.
    want = decode_attention_torch(q.float(), k_cache.float(), v_cache.float(), batch, scale)
    got = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


def test_kernel_ignores_padding_and_other_sequences_blocks(kernel):
    """Garbage (NaN) in blocks a sequence does not own, and past its length in its last block, is never read."""
    q, k_cache, v_cache, batch = _case(lens=[3, 17], heads=4, kv_heads=2, head_dim=16, block_size=8,
                                       dtype=torch.float32, seed=4)
    want = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, 0.25)
    owned = {(int(row[t // 8]), t % 8) for row, n in zip(batch.decode_block_table, batch.decode_ctx_lens.tolist())
             for t in range(n)}
    for blk in range(k_cache.shape[0]):
        for s in range(8):
            if (blk, s) not in owned:
                k_cache[blk, s] = float("nan")
                v_cache[blk, s] = float("nan")
    got = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, 0.25)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decode_attention_uses_the_kernel_on_cpu(kernel, monkeypatch):
    q, k_cache, v_cache, batch = _case(**CASES["gqa-smollm2-shape"], dtype=torch.float32, seed=5)
    monkeypatch.setattr("gpuservd.runner.attention.decode_attention_torch", None)  # would raise if called
    out = decode_attention(q, k_cache, v_cache, batch, 0.125)
    assert out.shape == q.shape


def test_failed_build_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_state", {})

    def broken():
        raise RuntimeError("g++: fatal error: no input files\nError building extension")

    monkeypatch.setattr(cpu_kernels, "_load", broken)
    with caplog.at_level(logging.WARNING, logger="gpuservd.runner.cpu_kernels"):
        assert cpu_kernels.get() is None
        assert cpu_kernels.get() is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no input files" in lines[0] and "gathers KV blocks" in lines[0]
    q, k_cache, v_cache, batch = _case(**CASES["gqa-smollm2-shape"], dtype=torch.float32, seed=6)
    out = decode_attention(q, k_cache, v_cache, batch, 0.125)  # the torch path
    torch.testing.assert_close(out, decode_attention_torch(q, k_cache, v_cache, batch, 0.125))


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert cpu_kernels.get() is None
    assert cpu_kernels.status() == {"loaded": False, "reason": f"{cpu_kernels.ENV_SWITCH}=0", "build_s": None}


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_short_prefill_chunks_attend_in_the_kernel_with_the_decode_rows(kernel, dtype, atol, monkeypatch):
    """A flat batch of decode rows, short prefill chunks (from 0 and continuing) and one chunk past
    KERNEL_PREFILL_MAX_CTX: the kernel takes the first three kinds in one call, SDPA the long one,
    and every row equals the all-torch path (decode groups + one SDPA per chunk)."""
    from gpuservd.runner import attention
    from gpuservd.runner.batch import KERNEL_PREFILL_MAX_CTX

    heads, kv_heads, hd, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(7)
    long_start = KERNEL_PREFILL_MAX_CTX + 40
    spans = [(0, 1, 37), (0, 1, 300), (0, 23, 0), (0, 40, 96), (1, 64, long_start), (0, 1, 5)]  # (_, tokens, start)
    need = [-(-(s + n) // bs) for _, n, s in spans]
    k_cache = torch.randn(sum(need) + 3, bs, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(dtype)
    perm = torch.randperm(k_cache.shape[0], generator=g).tolist()
    chunks, at = [], 0
    for (_, n, s), nb in zip(spans, need):
        chunks.append(SeqChunk(list(range(1, n + 1)), s, perm[at:at + nb], True))
        at += nb
    batch = build_batch(chunks, bs, torch.device("cpu"))
    kinds = [m.kernel for m in batch.prefills]
    assert kinds.count(True) == 2 and kinds.count(False) == 1
    assert batch.num_kernel_rows == batch.num_decode + 23 + 40
    T = batch.num_tokens
    q = torch.randn(T, heads + kv_heads, hd, generator=g).to(dtype)[:, :heads]  # strided, as in the runner
    k = torch.randn(T, kv_heads, hd, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, hd, generator=g).to(dtype)
    scale = hd ** -0.5
    got = attention.paged_attention(q, k, v, k_cache, v_cache, batch, scale)
    monkeypatch.setattr(attention.cpu_kernels, "get", lambda: None)  # the torch path for everything
    want = attention.paged_attention(q, k, v, k_cache, v_cache, batch, scale, store_kv=False)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("growth", ["rising", "sink-first"])
def test_running_softmax_rescales_across_steps(kernel, threads, growth):
    """The kernel walks a context a step of up to 32 tokens at a time, keeping each head's running max, sum and
    weighted V: where a later step holds a larger score ("rising": scores grow with the position, so every step
    rescales what came before) or the first token dominates ("sink-first": later weights are ~exp(-60)), the
    result still matches the torch path, on one thread (a 256-token partition is 8 steps) and on two."""
    q, k_cache, v_cache, batch = _case(lens=[1, 40, 255, 256, 300, 513], heads=9, kv_heads=3, head_dim=64,
                                       block_size=16, dtype=torch.float32, seed=7)
    q = q.abs()  # every score follows the sign and size of its K row
    for row, n in zip(batch.decode_block_table.tolist(), batch.decode_ctx_lens.tolist()):
        for t in range(n):
            blk, off = row[t // 16], t % 16
            k_cache[blk, off] = k_cache[blk, off].abs() * (0.05 + t / 256 if growth == "rising" else 0.05)
            if growth == "sink-first" and t == 0:
                k_cache[blk, off] = 8.0
    assert_kernel_matches_torch(kernel, threads, q, k_cache, v_cache, batch)


def assert_kernel_matches_torch(kernel, threads, q, k_cache, v_cache, batch):
    """The kernel on `threads` threads gives the torch gather + SDPA path's result (fp32 bounds)."""
    scale = q.shape[-1] ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, scale)
    finally:
        torch.set_num_threads(before)
    want = decode_attention_torch(q, k_cache, v_cache, batch, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
