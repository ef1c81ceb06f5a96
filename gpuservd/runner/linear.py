"""Linear layers, with the fastest kernel the device offers.

One copy of each weight, dense [out, in] as the checkpoint stores it, serves
both kinds of call on the CPU:
- decode-sized row counts (<= GEMV_MAX_ROWS) go to the C++ kernel `gemv`
  (csrc/gemv.cpp), which streams W once at close to memory bandwidth: at
  batch 1 a matmul is a pass over its weights, and oneDNN's inner product
  reached ~18 GB/s of the machine's ~30-45; in bf16 on a CPU with
  AVX512_BF16 the kernel's dot-product path takes up to GEMV_MAX_ROWS_BF16_DP;
- larger row counts (prefill chunks, big decode batches) go to oneDNN's inner
  product on the same dense weight (within ~5% of oneDNN with its own reordered
  weight from 64 rows up, measured; `F.linear`/MKL was 10-25% slower).
Keeping the oneDNN-reordered weight as well would double the model's memory;
dropping the dense one (as before) left the GEMV nothing it could stream, and
kept a second copy of a tied embedding for the LM head (113 MB on SmolLM2).
Without oneDNN (CUDA, or a torch built without it) `F.linear` takes the rows
the kernel does not; without the C++ kernels (GPUSERV_CPU_KERNELS=0, no
compiler) everything goes to oneDNN / `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels

# oneDNN builds and caches one kernel per distinct row count. Rows above EXACT_ROWS
# (prefill chunks) are padded up to a multiple of ROW_BUCKET, so a long-running
# daemon holds a bounded set of kernels (about 80 per weight shape) instead of one
# per token count ever seen, which grew RSS by megabytes a second under mixed traffic.
# Decode batches (<= EXACT_ROWS) run unpadded: padding 33 rows to 64 would cost more
# than the kernel cache saves.
EXACT_ROWS = 64
ROW_BUCKET = 32
# Row counts up to this go to the GEMV kernel. On the 2-core EPYC (one layer's four
# SmolLM2 matmuls, 1 thread, AVX-512VL registers): 1.25x faster than oneDNN with
# reordered weights at 8 rows, even at 16, 5% slower at 32, and level with oneDNN on
# the dense weight at 64 (bench/results/2026-11-29-cpu-gemv).
GEMV_MAX_ROWS = 32
# bf16 on a CPU with AVX512_BF16, where the kernel multiplies bf16 pairs with vdpbf16ps: up to 64
# rows. Over 30 layers of SmolLM2 weights streamed from DRAM (2 threads) it ran 1.7x / 1.4x / 1.3x
# faster than F.linear's oneDNN bf16 matmul at 32 / 48 / 64 rows, level at 96-128
# (bench/results/2026-11-29-cpu-dtype).
GEMV_MAX_ROWS_BF16_DP = 64
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """y = x @ W^T + b for x [T, in]; W [out, in] as stored in the checkpoint (kept as given,
    so a tied LM head shares the embedding's storage)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, use_onednn: bool = False,
                 use_gemv: bool | None = None):
        self.weight = weight if weight.is_contiguous() else weight.contiguous()
        self.bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        self.nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        self.onednn = use_onednn  # rows the GEMV does not take go to oneDNN (dense weight), else F.linear
        if use_gemv is None:
            use_gemv = weight.device.type == "cpu" and weight.dtype in GEMV_DTYPES
        self._gemv = cpu_kernels.get() if use_gemv else None
        self.gemv_max_rows = GEMV_MAX_ROWS
        if self._gemv is not None and weight.dtype == torch.bfloat16 and cpu_kernels.bf16_dp():
            self.gemv_max_rows = GEMV_MAX_ROWS_BF16_DP

    @property
    def gemv(self) -> bool:
        """Whether decode-sized row counts run on the C++ GEMV kernel."""
        return self._gemv is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._gemv is not None and rows <= self.gemv_max_rows and x.dim() == 2:
            return self._gemv.gemv(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)
        if self.onednn:
            if rows > EXACT_ROWS and rows % ROW_BUCKET:
                pad = ROW_BUCKET - rows % ROW_BUCKET
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
