"""Attention over the paged KV cache, for a flat batch of mixed chunks.

Cache layout per layer: [num_blocks, block_size, kv_heads, head_dim], so a
token's slot is one flat index (block * block_size + offset) and this step's
K/V go in with a single index_copy_.

Decode tokens (one per sequence) attend, on the CPU, through the C++ kernel
of cpu_kernels.py, which reads the blocks in place: in a same-process A/B it
was faster than the gather + SDPA path below at every batch size and context
length measured (bench/results/2026-11-29-cpu-paged-attention), mostly because
the gather copy, half of the torch path's time at long context, is gone.
On CUDA they attend through the Triton kernel of triton_attention.py (one
program per sequence and KV head for the whole GQA group, the context split
into partitions and merged), which reads lengths and block tables from device
memory, so a captured CUDA graph replays it for any lengths.
Where no kernel is available (not built, Triton missing), decode tokens
attend in groups of similar context length (see batch.py): each group is one
fused `scaled_dot_product_attention` over its gathered blocks, the query heads
of each KV head standing in as the query rows (they all see the whole
context), with a mask only where lengths differ. Prefill chunks attend one at
a time through SDPA against their gathered context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels, gpu_kernels
from gpuservd.runner.batch import DecodeGroup, ForwardBatch, PrefillMeta


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch):
    """Store this step's k, v [T, kv_heads, head_dim] into their slots of one layer's cache."""
    kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, batch.slots, v)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The blocks of each row of block table [b, nblk] as [b, nblk * block_size, kv_heads, head_dim]."""
    b, nblk = table.shape
    block_size, kv_heads, head_dim = cache.shape[1:]
    return cache.index_select(0, table.view(-1)).view(b, nblk * block_size, kv_heads, head_dim)


def _decode_group(q: torch.Tensor, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
    """q [b, heads, hd] of one group -> [b, heads, hd]."""
    b, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    k = _gather(k_cache, g.block_table)[:, : g.max_len].transpose(1, 2)  # [b, kv_heads, L, hd] (a view)
    v = _gather(v_cache, g.block_table)[:, : g.max_len].transpose(1, 2)
    qg = q.view(b, kv_heads, group, head_dim)  # each KV head's query heads as `group` query rows
    # The fused CPU kernel reads the strided views directly; in a same-process A/B at
    # b = 1..64 it beat a masked matmul + softmax (per KV head or on contiguous copies) by 2-7x.
    mask = None if g.mask is None else g.mask[:, None, None, :]
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Attention of the decode queries q [B, heads, head_dim] over their cached contexts."""
    ops = cpu_kernels.get() if q.device.type == "cpu" else gpu_kernels.get(q.device, q.dtype)
    if ops is not None:
        return ops.paged_decode(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, scale)
    return decode_attention_torch(q, k_cache, v_cache, batch, scale)


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """The gather + SDPA path of decode_attention (other devices, no kernel, and the kernel's reference)."""
    groups = batch.decode_groups
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, groups[0], scale)  # rows are 0..B-1 in order
    out = torch.empty_like(q)
    for g in groups:
        out[g.rows] = _decode_group(q.index_select(0, g.rows), k_cache, v_cache, g, scale)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk q [n, heads, hd] over its context; returns [n, heads, hd]."""
    n, num_heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    if meta.ctx_len == meta.q_len:
        k, v = k_new.transpose(0, 1), v_new.transpose(0, 1)  # [kv_heads, n, hd]; nothing cached before
    else:
        # The whole context (earlier chunks + this one) from the cache.
        k = _gather(k_cache, meta.block_ids[None])[0, : meta.ctx_len].transpose(0, 1)  # [kv_heads, ctx, hd]
        v = _gather(v_cache, meta.block_ids[None])[0, : meta.ctx_len].transpose(0, 1)
    # 4-D [1, heads, len, hd] with enable_gqa: torch's CPU flash kernel takes that shape and shares each KV
    # head between its query heads itself; 3-D inputs (and repeat_interleave'd KV) fell to the math path,
    # 9x slower in fp32 and 75x in bf16 on one 32-token chunk of SmolLM2 shape (2 threads, micro-benchmark).
    gqa = num_heads != kv_heads
    qh = q.transpose(0, 1)[None]  # [1, heads, n, hd]
    k, v = k[None], v[None]  # [1, kv_heads, ctx, hd]
    if meta.ctx_len == meta.q_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at absolute position ctx_len - n + i and sees keys up to it.
        offset = meta.ctx_len - n
        qpos = torch.arange(n, device=q.device)[:, None] + offset
        kpos = torch.arange(meta.ctx_len, device=q.device)[None, :]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=kpos <= qpos, scale=scale, enable_gqa=gqa)
    out = out[0]
    return out.transpose(0, 1)  # [n, heads, hd]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    store_kv: bool = True,
) -> torch.Tensor:
    """Write k, v [T, kv_heads, hd] to the cache (unless the caller already has), then attend for every
    token; returns [T, heads, hd]. k and v may be None where the caller has stored them and every row
    attends in the CPU kernel (batch.num_kernel_rows == T), which reads them from the cache."""
    if store_kv:
        write_kv(k_cache, v_cache, k, v, batch)
    # The leading rows in one call: on the CPU with the kernel, the decode rows and the short prefill
    # chunks (batch.py: KERNEL_PREFILL_MAX_CTX); otherwise the decode rows. Other chunks attend one by one.
    ops = cpu_kernels.get() if batch.num_kernel_rows and q.device.type == "cpu" else None
    if ops is not None:
        head = batch.num_kernel_rows
        rows = ops.paged_decode(q if head == q.shape[0] else q[:head], k_cache, v_cache, batch.kernel_block_table,
                                batch.kernel_ctx_lens, scale)
    else:
        head = batch.num_decode
        rows = decode_attention(q[:head], k_cache, v_cache, batch, scale) if head else None
    if head == q.shape[0]:
        return rows
    out = torch.empty_like(q)
    if head:
        out[:head] = rows
    for meta in batch.prefills:
        if ops is None or not meta.kernel:
            sl = slice(meta.q_start, meta.q_start + meta.q_len)
            out[sl] = prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, meta, scale)
    return out
