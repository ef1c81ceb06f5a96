"""The decoder layer's elementwise steps as Triton kernels, one launch each (the CUDA side of
cpu_kernels' fused ops, same call signatures):

- `rms_norm(x, w, eps)` and `add_rms_norm_(h, delta, w, eps)`: the residual add
  (in place on h, the residual stream) fused with the RMSNorm that follows it;
- `rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, H, KVH)`: rotate the q
  and k heads in place, store k and v in their cache slots; a slot of -1 (a
  padding row of a fixed-shape batch) writes nowhere;
- `silu_mul(gate_up)`: SiLU(gate) * up.

Each rounds where torch's unfused code rounds (statistics and products in
fp32, one rounding to the tensor's dtype per torch op), so bf16/fp16 results
equal the torch reference's to within a rounding step, and fp32 to
summation order. One program per token row: at decode batch sizes the
launches, not the bytes, are what these replace (a layer's ~35 small torch
kernels become about 10).

Imports Triton at the top; see triton_attention.py for why that is safe and
how the tests run these on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns per program of silu_mul


@triton.jit
def _add_rms_norm(h_ptr, d_ptr, w_ptr, out_ptr, n_cols, eps, stride_h, stride_d, stride_o,
                  HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    x = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * stride_d + c, mask=ok, other=0.0).to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)  # the residual stream keeps its dtype, as h + delta does
        tl.store(h_ptr + row * stride_h + c, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty)  # normalized in fp32, rounded, then scaled (transformers)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + c, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _rope_store_kv(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slots_ptr, stride_t, stride_cos, stride_sin,
                   num_heads, num_kv_heads,
                   HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, ROT_PAD: tl.constexpr, KV_PAD: tl.constexpr):
    t = tl.program_id(0)
    half = HEAD_DIM // 2
    c = tl.arange(0, HALF_PAD)
    c_ok = c < half
    h = tl.arange(0, ROT_PAD)
    rot = num_heads + num_kv_heads
    ok = (h < rot)[:, None] & c_ok[None, :]
    base = qkv_ptr + t * stride_t + h[:, None] * HEAD_DIM + c[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)  # [ROT_PAD, HALF_PAD] first halves
    x2 = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * stride_cos + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * stride_cos + half + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * stride_sin + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * stride_sin + half + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dt = qkv_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch's three ops round.
    y1 = ((x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    tl.store(base, y1, mask=ok)
    tl.store(base + half, y2, mask=ok)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # The rotated k heads are rows num_heads.. of y1/y2; write them from registers, v straight through.
    kv_row = num_kv_heads * HEAD_DIM
    is_k = (h >= num_heads) & (h < rot)
    k_dst = k_ptr + slot * kv_row + (h - num_heads)[:, None] * HEAD_DIM + c[None, :]
    k_ok = is_k[:, None] & c_ok[None, :] & (slot >= 0)
    tl.store(k_dst, y1, mask=k_ok)
    tl.store(k_dst + half, y2, mask=k_ok)
    j = tl.arange(0, KV_PAD)
    dcol = tl.arange(0, 2 * HALF_PAD)
    v_ok = (j < num_kv_heads)[:, None] & (dcol < HEAD_DIM)[None, :] & (slot >= 0)
    v = tl.load(qkv_ptr + t * stride_t + (rot + j)[:, None] * HEAD_DIM + dcol[None, :], mask=v_ok, other=0.0)
    tl.store(v_ptr + slot * kv_row + j[:, None] * HEAD_DIM + dcol[None, :], v, mask=v_ok)


@triton.jit
def _silu_mul(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_cols
    g = tl.load(gu_ptr + row * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + c, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt)  # F.silu's rounding, then the product's
    tl.store(out_ptr + row * stride_o + c, (s.to(tl.float32) * u).to(dt), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("expected a [rows, cols] tensor with contiguous rows")
    return x


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, D] (llama.rms_norm's rounding) into a new tensor."""
    _rows(x)
    out = torch.empty_like(x)
    if x.shape[0]:
        _add_rms_norm[(x.shape[0],)](x, x, w, out, x.shape[1], eps, x.stride(0), x.stride(0), out.stride(0),
                                     HAS_DELTA=False, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (the residual stream); returns RMSNorm(h) * w as a new tensor."""
    _rows(h), _rows(delta)
    out = torch.empty_like(h)
    if h.shape[0]:
        _add_rms_norm[(h.shape[0],)](h, delta, w, out, h.shape[1], eps, h.stride(0), delta.stride(0),
                                     out.stride(0), HAS_DELTA=True, BLOCK=triton.next_power_of_2(h.shape[1]))
    return out


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """qkv [T, H + 2 KVH, D]: rotate q and k in place with cos/sin [T, 1, D] (RopeTables.lookup), store
    k and v at flat slot slots[t] of the contiguous caches [N, bs, KVH, D]; slot -1 stores nothing."""
    t, heads, dim = qkv.shape
    if heads != num_heads + 2 * num_kv_heads or qkv.stride(2) != 1 or qkv.stride(1) != dim or dim % 2:
        raise ValueError("rope_store_kv: qkv must be [T, H + 2 KVH, D] with contiguous heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store_kv: the caches must be contiguous")
    if t:
        _rope_store_kv[(t,)](qkv, cos, sin, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), sin.stride(0),
                             num_heads, num_kv_heads, HEAD_DIM=dim, HALF_PAD=triton.next_power_of_2(dim // 2),
                             ROT_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
                             KV_PAD=triton.next_power_of_2(num_kv_heads))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> SiLU(gate) * up [T, I]."""
    _rows(gate_up)
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul[(t, triton.cdiv(two_i // 2, SILU_BLOCK))](gate_up, out, two_i // 2, gate_up.stride(0),
                                                            out.stride(0), BLOCK=SILU_BLOCK)
    return out
