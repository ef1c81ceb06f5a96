"""The Llama-family forward pass over a paged KV cache, layer by layer.

This is the only place that runs model math. `forward()` takes a flat batch
(see batch.py) and returns logits only for the rows that sample, so prefill
chunks do not pay for the LM head on every token.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels, gpu_kernels
from gpuservd.runner.attention import paged_attention
from gpuservd.runner.batch import ForwardBatch
from gpuservd.runner.linear import Linear, OutputBuffer
from gpuservd.runner.model_config import ModelArch
from gpuservd.runner.rope import RopeTables, apply_rope
from gpuservd.runner.model_weights import LayerWeights, ModelWeights

STACK_ENV = "GPUSERV_CPU_STACK"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: statistics in fp32, scale in the weight dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights + rope tables + the per-layer math. Holds no KV; the cache is passed in."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, max_len: int, dtype: torch.dtype, device):
        self.arch = arch
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.rope = RopeTables(arch, max_len, dtype, self.device)
        self.scale = arch.head_dim ** -0.5
        self._q_size = arch.num_heads * arch.head_dim
        # The fused layer steps, built or loaded now rather than in the first step: C++ on the CPU
        # (cpu_kernels.py), Triton on CUDA (gpu_kernels.py); None = torch ops.
        if self.device.type == "cpu":
            self._ops = cpu_kernels.get()
        else:
            self._ops = gpu_kernels.get(self.device, dtype)
        # Where the LM head writes the logits step after step (linear.py OutputBuffer), or None: a new tensor
        # each forward. ModelRunner sets one on the CPU; its logits are then valid until the next forward.
        self.logits_out: OutputBuffer | None = None
        # Which fused layer steps run: "c++", "triton", or None (torch ops).
        self.kernels = None if self._ops is None else ("c++" if self.device.type == "cpu" else "triton")
        # Called between a layer's attention and its MLP (the halfway point of every layer): the sharing
        # arbiter's yield point, so a neighbour waits at most half a layer of this model. None = no call.
        self.mid_layer = None
        # Decode-style forwards run every layer in one C++ op where they can (_stack_args);
        # GPUSERV_CPU_STACK=0 keeps the per-layer loop (section timings, A/B).
        self.stack_enabled = self.kernels == "c++" and os.environ.get(STACK_ENV, "1") != "0"

    def layer_forward(self, i: int, h: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, rope):
        """One decoder layer on hidden states h [T, D]; rope = (cos, sin) of the batch. Returns the new h [T, D]."""
        if self._ops is not None:
            return self._layer_forward_fused(i, h, kv, batch, rope)[0]
        a = self.arch
        lw: LayerWeights = self.weights.layer(i)
        x = rms_norm(h, lw.input_norm, a.rms_norm_eps)
        t = h.shape[0]
        qkv = lw.qkv(x).view(t, a.num_heads + 2 * a.num_kv_heads, a.head_dim)  # [T, H + 2 KVH, hd]
        qk = apply_rope(qkv[:, : a.num_heads + a.num_kv_heads], *rope)  # q and k heads rotated together
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, a.num_heads + a.num_kv_heads :]
        attn = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)  # [T, H, hd]
        h = h + lw.o_proj(attn.reshape(t, self._q_size))
        if self.mid_layer is not None:
            self.mid_layer(i)
        x = rms_norm(h, lw.post_norm, a.rms_norm_eps)
        gate, up = lw.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        return h + lw.down(F.silu(gate) * up)

    def _layer_forward_fused(self, i: int, h: torch.Tensor, kv, batch: ForwardBatch, rope,
                             x: torch.Tensor | None = None, fuse_next: bool = False):
        """layer_forward with one C++ op per elementwise step; updates h in place (h is the residual stream).
        x: h under this layer's input norm when the previous layer made it (else it is made here).
        fuse_next: the closing residual add and the next layer's input norm run as one op (one call and one
        pass over h fewer a layer) and this returns (h, x_next); else (h, None)."""
        a, ops = self.arch, self._ops
        lw: LayerWeights = self.weights.layer(i)
        t = h.shape[0]
        if x is None:
            x = ops.rms_norm(h, lw.input_norm, a.rms_norm_eps)
        qkv = lw.qkv(x).view(t, a.num_heads + 2 * a.num_kv_heads, a.head_dim)  # [T, H + 2 KVH, hd]
        # q and k heads rotated in place, this step's k and v stored in their cache slots.
        ops.rope_store_kv(qkv, rope[0], rope[1], kv[0], kv[1], batch.slots, a.num_heads, a.num_kv_heads)
        if batch.num_kernel_rows == t:  # every row attends in the kernel, which reads k and v from the cache
            q, k, v = qkv[:, : a.num_heads], None, None  # one view (a split makes three: ~10 us a layer)
        else:
            q, k, v = qkv.split([a.num_heads, a.num_kv_heads, a.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale, store_kv=False)  # [T, H, hd]
        x = ops.add_rms_norm_(h, lw.o_proj(attn.reshape(t, self._q_size)), lw.post_norm, a.rms_norm_eps)
        if self.mid_layer is not None:
            self.mid_layer(i)
        delta = lw.down(ops.silu_mul(lw.gate_up(x)))
        if not fuse_next:
            return h.add_(delta), None
        # The next layer's weights asked for only now: a layered load may still be bringing them in.
        return h, ops.add_rms_norm_(h, delta, self.weights.layer(i + 1).input_norm, a.rms_norm_eps)

    def _stack_args(self, batch: ForwardBatch, kv_layers):
        """decoder_stack's per-layer lists when this forward can run all its layers in that one op, else None:
        it needs the C++ kernels, every row attending in the paged kernel, every layer loaded, no call between
        layers (the arbiter's halfway point: runner.model.mid_layer) and every linear a plain packed Linear of one
        layout (a variant's adapters and the unpacked paths take the layer loop)."""
        if not self.stack_enabled or self._ops is None or batch.num_kernel_rows != batch.input_ids.shape[0]:
            return None
        if self.mid_layer is not None:
            return None
        gate = self.weights.gate
        if gate is not None and gate.num_ready < self.arch.num_layers:
            return None  # a layered load still streams layers in: the loop waits for each as it goes
        weights, biases, norms, k_caches, v_caches = [], [], [], [], []
        panels = None
        for i, lw in enumerate(self.weights.layers):
            if lw is None:
                return None
            for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                if type(lin) is not Linear or lin.packed is None or panels not in (None, lin.panels):
                    return None
                panels = lin.panels
                weights.append(lin.packed)
                biases.append(lin.bias)
            norms += (lw.input_norm, lw.post_norm)
            k, v = kv_layers(i)
            k_caches.append(k)
            v_caches.append(v)
        widths = [lin.out_features for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
        return weights, biases, widths, panels, norms, k_caches, v_caches

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.weights.embed_tokens(batch.input_ids)  # [T, D]

    def logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [S, V] for the rows in batch.logits_indices."""
        x = rms_norm(h.index_select(0, batch.logits_indices), self.weights.final_norm, self.arch.rms_norm_eps)
        return self.weights.lm_head.fp32(x, self.logits_out)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_layers, suspend=None, resume: "LayerCheckpoint | None" = None):
        """Run the layers; kv_layers(i) gives layer i's (k_cache, v_cache). Returns logits [S, V], or a
        LayerCheckpoint when suspend(i) says to stop after layer i (layer-granularity preemption);
        forward(..., resume=checkpoint) goes on from there. Layers [0, i] have written their KV."""
        if resume is None:
            h, start = self.embed(batch), 0
        else:
            h, start = resume.hidden, resume.next_layer
        rope = self.rope.lookup(batch.positions)
        if resume is None and suspend is None:
            stack = self._stack_args(batch, kv_layers)
            if stack is not None:  # every layer in one C++ call: the same ops, no interpreter between them
                self._ops.decoder_stack(h, *stack, rope[0], rope[1], batch.slots, batch.kernel_block_table,
                                        batch.kernel_ctx_lens, self.arch.num_heads, self.arch.num_kv_heads,
                                        self.arch.rms_norm_eps, self.scale)
                return self.logits(h, batch)
        last = self.arch.num_layers - 1
        x = None  # the fused path: h under the next layer's input norm, made by the layer before
        for i in range(start, self.arch.num_layers):
            if self._ops is None:
                h = self.layer_forward(i, h, kv_layers(i), batch, rope)
            else:
                h, x = self._layer_forward_fused(i, h, kv_layers(i), batch, rope, x, fuse_next=i < last)
            if suspend is not None and i < last and suspend(i):
                return LayerCheckpoint(batch, h, i + 1)  # x is h's norm: a resumed forward makes it again
        return self.logits(h, batch)


class LayerCheckpoint:
    """A forward stopped between layers: the batch and the hidden states entering `next_layer`."""

    def __init__(self, batch: ForwardBatch, hidden: torch.Tensor, next_layer: int):
        self.batch = batch
        self.hidden = hidden
        self.next_layer = next_layer
