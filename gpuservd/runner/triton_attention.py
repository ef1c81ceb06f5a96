"""Paged decode attention in Triton: one query token per sequence over its KV blocks in the cache.

Work split: one program per (sequence, KV head, partition). A program loads
the query heads of its KV head's whole GQA group as the rows of one tile, so
each K/V block is read once for the group, not once per query head. The
sequence's blocks are cut into `num_parts` contiguous partitions (a fixed
number per launch, a compile-time constant) so that one long context is
spread over many programs instead of serializing the step; each partition
writes its running max, sum and unnormalized output (fp32) and a second,
small kernel merges them. Context lengths and block tables are read from
device memory inside the kernel, so a CUDA graph captured once replays for
any lengths that fit its table. A row of length 0 (a padding row of a
fixed-shape batch) reads nothing and returns zeros.

Arithmetic: q.k and p.v on the tensor cores (`tl.dot`) with fp32
accumulation; fp32 inputs use IEEE fp32 products (not tf32), so fp32 matches
the torch reference to rounding. Probabilities are rounded to the cache's
dtype before p.v, as flash attention does.

`IEEE` tiles go through fp32 products: for fp32 inputs (no tf32), and for
every dtype in Triton's interpreter on the CPU, whose bf16 `tl.dot` is wrong
(3.7: bf16 bits read as another type); the products of bf16/fp16 values are
exact in fp32, so that path computes what the GPU's half-precision dot does.

Cache layout: [num_blocks, block_size, kv_heads, head_dim] per layer
(kv_cache/cache.py), any strides for the first three, head_dim contiguous.

The module imports Triton at the top: the runner imports it only where
kernels can run (gpu_kernels.py). With TRITON_INTERPRET=1 set before the
import, the same kernels run in Triton's interpreter on CPU tensors (the
tests do this).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_PARTS = 16  # partitions per sequence, at most
PART_MIN_TOKENS = 256  # a partition covers at least this many context tokens (fewer: merge costs more)
MIN_TILE_ROWS = 16  # tl.dot's smallest tile side: small GQA groups are padded with masked rows


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    """Multiprocessors of CUDA device `index` (asked once: every layer of every step needs it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_partitions(max_ctx_tokens: int, batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Partitions per sequence for a launch: enough that the longest context spreads over several
    programs, no more than keeps about four programs per multiprocessor busy (beyond that the other
    sequences already fill the device and the merge's extra reads are pure cost)."""
    by_len = triton.next_power_of_2(max(1, -(-max_ctx_tokens // PART_MIN_TOKENS)))
    by_fill = triton.next_power_of_2(max(1, -(-4 * num_sms // max(1, batch * kv_heads))))
    return max(1, min(MAX_PARTS, by_len, by_fill))


@triton.jit
def _decode_partition(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in the base-2 domain (exp2)
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_PARTS: tl.constexpr, IEEE: tl.constexpr, USE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_part = tl.cdiv(num_blocks, NUM_PARTS)
    first = part * per_part
    last = tl.minimum(first + per_part, num_blocks)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for i in range(first, last):
        block = tl.load(table_ptr + seq * stride_tb + i).to(tl.int64)
        k = tl.load(k_ptr + block * stride_kb + n[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=d_ok[None, :], other=0.0)  # [BLOCK_SIZE, DIM_PAD]
        v = tl.load(v_ptr + block * stride_vb + n[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=d_ok[None, :], other=0.0)
        if not USE_DOT:  # blocks under 16 tokens: tl.dot's minimum tile; products summed in registers
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        elif IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where((i * BLOCK_SIZE + n)[None, :] < ctx, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block in range holds a real token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not USE_DOT:
            pv = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        elif IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # Partials: [batch, heads, NUM_PARTS] for m and l, [batch, heads, NUM_PARTS, HEAD_DIM] for acc.
    row = (seq * num_heads + heads) * NUM_PARTS + part
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_partitions(
    m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, DIM_PAD)
    p_ok = p < NUM_PARTS
    row = (seq * num_heads + head) * NUM_PARTS + p
    m = tl.load(m_ptr + row, mask=p_ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=p_ok, other=0.0)
    m_max = tl.max(m, 0)
    # Empty partitions (m = -inf) weigh nothing; a row with no context at all (padding) gives zeros.
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l, 0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=p_ok[:, None] & (d < HEAD_DIM)[None, :],
                  other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    o = tl.where(denom > 0.0, o / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, num_parts: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, heads, head_dim] over each row's cached context; returns [B, heads, head_dim].

    block_table [B, max_blocks] int32 and ctx_lens [B] int32 live on q's device; rows of length 0 give
    zeros. num_parts: partitions per sequence (None: chosen from the table's width and the batch)."""
    b, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    if num_heads % kv_heads or q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_decode: heads must be a multiple of kv heads, head_dim contiguous")
    if num_parts is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
        num_parts = num_partitions(block_table.shape[1] * block_size, b, kv_heads, sms)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    part_m = torch.empty(b, num_heads, num_parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(b, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    dim_pad = triton.next_power_of_2(head_dim)
    use_dot = block_size >= MIN_TILE_ROWS
    _decode_partition[(b, kv_heads, num_parts)](
        q, k_cache, v_cache, block_table, ctx_lens, part_m, part_l, part_acc,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        num_heads,
        GROUP=group, GROUP_PAD=max(MIN_TILE_ROWS if use_dot else 2, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, NUM_PARTS=num_parts,
        IEEE=q.dtype == torch.float32 or not q.is_cuda, USE_DOT=use_dot,
    )
    _merge_partitions[(b, num_heads)](
        part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_PARTS=num_parts, PARTS_PAD=triton.next_power_of_2(num_parts),
    )
    return out
