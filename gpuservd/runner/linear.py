"""Linear layers, with the fastest kernel the device offers.

fp32 on the CPU (the engine's default there): the one copy of each weight is
repacked at load into column panels ([out/16][in][16], csrc/packed_gemm_f32.cpp
explains the layout) and every row count goes to `packed_linear_f32`, an
outer-product kernel (6 x 16 register tiles on AVX2, 12 x 16 with AVX-512VL's
32 registers) with no per-output reductions. On the 2-core AVX2 EPYC, over
SmolLM2's four layer shapes with W streamed from DRAM (2 threads, the other
processes stopped; MEASURE-gemm22.md has the commands), in GFLOP/s:
rows 1: 11.4 packed, 10.5 gemv; 8: 67 / 66; 16: 114 / 69 (oneDNN 55);
32: 150 / 86 (88); 64: 175 / 98 (107); 256: 177, oneDNN (which reorders W
on every call) 147. As fast or faster at every row count, so the panels are
the only copy: keeping the dense weight too for gemv / oneDNN would double the
model's memory for no row count that needs it.
`rows(ids)` reads dense rows back out of the panels, so a tied embedding and
LM head stay one tensor. A weight whose every fp32 value is exactly a bf16
(checked at load: a checkpoint published in bf16 and served in fp32; the
store's SmolLM2 fp32 weights are not) is held in bf16 column panels instead:
the kernel widens each value back to the same fp32 before the same FMAs, so
its results are bit-identical from half the bytes (at 1-8 rows a matmul is a
pass over its weights: a 49152 x 576 LM head, 113 MB in fp32, took 3.0 vs 5.0
ms at 1 row, 4.1 vs 6.4 ms at 8, 2 threads, interleaved on the loaded
machine). `GPUSERV_PANELS_BF16=0` keeps such a weight in fp32 panels (the A/B
reference).

The dense layout, W [out, in] as the checkpoint stores it, serves everything
else, and fp32 under `GPUSERV_PACKED_WEIGHTS=0` (the A/B reference):
- decode-sized row counts (<= GEMV_MAX_ROWS) go to the C++ kernel `gemv`
  (csrc/gemv.cpp), a dot-product kernel that streams W once: at batch 1 a
  matmul is a pass over its weights; in bf16 on a CPU with AVX512_BF16 the
  kernel's dot-product path takes up to GEMV_MAX_ROWS_BF16_DP;
- larger row counts (prefill chunks, big decode batches) go to oneDNN's inner
  product on the same dense weight (within ~5% of oneDNN with its own reordered
  weight from 64 rows up, measured; `F.linear`/MKL was 10-25% slower).
Without oneDNN (CUDA, or a torch built without it) `F.linear` takes the rows
the kernel does not; without the C++ kernels (GPUSERV_CPU_KERNELS=0, no
compiler) everything goes to oneDNN / `F.linear` on the dense weight.

bf16 on a CPU with AVX512_BF16 is packed too: the one copy is the weight in
pair panels (csrc/packed_gemm.cpp) and every row count goes to `packed_linear`,
whose vdpbf16ps outer products multiply bf16 pairs. Over 30 layers of SmolLM2
shapes (2 threads) it ran 1.28x faster than the dense dot-product gemv at 32
and at 64 rows, as fast or faster at 1-16 rows, and 1.03-1.17x faster than
oneDNN's bf16 matmul on the dense weight at 128-512 rows; see
bench/results/2026-11-29-cpu-packed-gemm. bf16 without AVX512_BF16, fp16, and
CUDA keep the dense layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels
# HUGE_PAGES_SWITCH is re-exported: tests and scripts name it from here, with the other switches.
from gpuservd.runner import code_panels
from gpuservd.runner.panel_arena import HUGE_PAGES_SWITCH, PanelArena, huge_pages_on, switch_on  # noqa: F401

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
PANEL = 16  # output columns per panel of both packed layouts (fp32 lanes of one AVX-512 register)
PACKED_SWITCH = "GPUSERV_PACKED_WEIGHTS"
BF16_PANELS_SWITCH = "GPUSERV_PANELS_BF16"
# HUGE_PAGES_SWITCH: panels in 2 MB-aligned MADV_HUGEPAGE mappings (csrc/packed_panels_f32.cpp), the
# layers' cut from shared blocks (panel_arena.py); =0 keeps torch's allocator (the A/B reference).
# Where column j of a bf16 panel's k step lies: columns 0-7 in the even halves, 8-15 in the odd ones
# (csrc/packed_panels_f32.cpp).
BF16_PANEL_POS = [2 * j if j < 8 else 2 * (j - 8) + 1 for j in range(PANEL)]


def pack_pairs(w: torch.Tensor, arena: PanelArena | None = None) -> torch.Tensor:
    """W [N, K] -> pair panels [ceil(N/16), ceil(K/2), 32]: packed[p][kk][2j + e] = W[16p + j][2kk + e],
    zero padded (csrc/packed_gemm.cpp); on the CPU on 2 MB pages like the column panels': cut from the
    arena's blocks when given, else in a mapping of their own (csrc/packed_panels_f32.cpp huge_copy)."""
    n, k = w.shape
    p, k2 = -(-n // PANEL), -(-k // 2)
    if n % PANEL or k % 2:
        w = torch.nn.functional.pad(w, (0, 2 * k2 - k, 0, p * PANEL - n))
    pairs = w.reshape(p, PANEL, k2, 2).permute(0, 2, 1, 3)
    if arena is not None and w.device.type == "cpu":
        out = arena.empty((p, k2, 2 * PANEL), w.dtype)
        out.view(p, k2, PANEL, 2).copy_(pairs)  # permuted straight into place
        return out
    ops = cpu_kernels.get() if w.device.type == "cpu" else None
    if ops is None or not hasattr(ops, "huge_copy") or not huge_pages_on():
        return pairs.contiguous().view(p, k2, 2 * PANEL)
    return ops.huge_copy(pairs).view(p, k2, 2 * PANEL)  # the permuted view copied once, into place


def unpack_pairs(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense W [n, k] a pair-panel tensor holds."""
    p, k2, _ = packed.shape
    return packed.view(p, k2, PANEL, 2).permute(0, 2, 1, 3).reshape(p * PANEL, 2 * k2)[:n, :k]


def pack_panels(w: torch.Tensor, arena: PanelArena | None = None) -> torch.Tensor:
    """W [N, K] fp32 -> column panels [ceil(N/16), K, 16]: packed[p][k][j] = W[16p + j][k], zero padded
    (csrc/packed_gemm_f32.cpp); cut from the arena's blocks when given."""
    ops = cpu_kernels.get() if w.device.type == "cpu" and w.dtype == torch.float32 else None
    if ops is not None and hasattr(ops, "pack_panels_f32"):
        # register transposes: cheaper at load than the permuted copy below
        if arena is not None:
            out = arena.empty((-(-w.shape[0] // PANEL), w.shape[1], PANEL), torch.float32)
            ops.pack_panels_f32_into(w, out)
            return out
        return ops.pack_panels_f32(w, huge_pages_on())
    n, k = w.shape
    p = -(-n // PANEL)
    if n % PANEL:
        w = torch.nn.functional.pad(w, (0, 0, 0, p * PANEL - n))
    return w.reshape(p, PANEL, k).transpose(1, 2).contiguous()


def pack_panels_exact(w: torch.Tensor, arena: PanelArena | None = None) -> torch.Tensor:
    """Column panels of W [N, K] fp32: 4- or 8-bit codes when W is exactly such a grid (code_panels.py), in bf16
    when every value of W is exactly a bf16 (bit-identical products, half the bytes) and the kernels can
    build them, else in fp32; cut from the arena's blocks when given."""
    ops = cpu_kernels.get() if w.device.type == "cpu" and w.dtype == torch.float32 else None
    codes = code_panels.pack_exact(w, ops, arena) if ops is not None else None  # on a GGUF grid: its codes
    if codes is not None:
        return codes
    if (ops is not None and hasattr(ops, "pack_panels_bf16") and switch_on(BF16_PANELS_SWITCH)
            and ops.bf16_exact(w)):
        if arena is not None:
            out = arena.empty((-(-w.shape[0] // PANEL), w.shape[1], PANEL), torch.bfloat16)
            ops.pack_panels_bf16_into(w, out)
            return out
        return ops.pack_panels_bf16(w, huge_pages_on())
    return pack_panels(w, arena)


def unpack_panels(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense W [n, k] a column-panel tensor holds (fp32 from bf16 panels: exact)."""
    p = packed.shape[0]
    if packed.dtype == torch.uint8:
        return code_panels.unpack(packed, n, k)
    if packed.dtype == torch.bfloat16:
        packed = packed[:, :, BF16_PANEL_POS].float()
    return packed.transpose(1, 2).reshape(p * PANEL, k)[:n]


def packed_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype on this device are held packed: bf16 in pair panels (a CPU with
    AVX512_BF16), fp32 in column panels (a CPU with AVX2 and FMA)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not switch_on(PACKED_SWITCH):
        return False
    ops = cpu_kernels.get()
    if ops is None:
        return False
    if dtype == torch.float32:  # the library's vector kernel (else its scalar loops would stand in for oneDNN)
        return bool(hasattr(ops, "packed_f32_available") and ops.packed_f32_available())
    return bool(hasattr(ops, "packed_available") and ops.packed_available())


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class OutputBuffer:
    """One fp32 [rows, cols] output that a caller reuses call after call (the LM head's logits: rows x
    49152 fp32 for SmolLM2, 9.4 MB at 48 rows). A new tensor that size each step comes from a fresh
    mapping whenever glibc's mmap threshold says so, and its first writes then fault every 4 KB page
    in: 5.3 ms CPU a 48-row step against 0.55 ms written into memory already mapped (1 thread). It
    grows to the most rows asked for; above max_bytes (an all-logits prefill of thousands of rows)
    it gives nothing and the caller takes a new tensor, so a rare burst does not stay in memory."""

    def __init__(self, cols: int, max_bytes: int = 64 << 20):
        self.cols, self.max_bytes = cols, max_bytes
        self._buf: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor | None:
        """Its first n rows, [n, cols] contiguous (what they held is overwritten), or None past max_bytes."""
        if n * self.cols * 4 > self.max_bytes:
            return None
        if self._buf is None or self._buf.shape[0] < n:
            # In steps of 16 rows: a batch that fills up one row at a time reallocates a few times, not n.
            grow = min(-(-n // 16) * 16, max(n, self.max_bytes // (4 * self.cols)))
            self._buf = None  # let go of the smaller one first
            self._buf = torch.empty(grow, self.cols, dtype=torch.float32)
        return self._buf[:n]


class Linear:
    """y = x @ W^T + b for x [T, in]; W [out, in] as stored in the checkpoint (kept as given,
    so a tied LM head shares the embedding's storage), or repacked (fp32 in column panels, bf16
    on AVX512_BF16 in pair panels; `weight` is then None and `rows` / `dense` read it back). arena: where
    the panels go (a load's shared huge-page blocks, panel_arena.py), else a mapping or tensor of their own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, use_onednn: bool = False,
                 use_gemv: bool | None = None, use_packed: bool | None = None, arena: PanelArena | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        if use_packed is None:
            use_packed = packed_enabled(weight.device, weight.dtype)
        self.packed = None
        self.panels = use_packed and weight.dtype == torch.float32  # fp32 column panels, else bf16 pairs
        if use_packed:
            self.packed = pack_panels_exact(weight, arena) if self.panels else pack_pairs(weight, arena)
        self._row_offsets = None  # rows(): where each input column of a row lies in the packed layout
        self._lane_pos = None  # rows() of bf16 panels: where each of a panel's 16 columns lies in a k step
        self.weight = None if use_packed else (weight if weight.is_contiguous() else weight.contiguous())
        held = self.packed if use_packed else self.weight
        self.nbytes = held.numel() * held.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        self.onednn = use_onednn  # rows the GEMV does not take go to oneDNN (dense weight), else F.linear
        if use_gemv is None:
            use_gemv = weight.device.type == "cpu" and weight.dtype in GEMV_DTYPES
        self._ops = cpu_kernels.get() if (use_gemv or use_packed) else None
        self._gemv = self._ops if use_gemv and not use_packed else None
        self.gemv_max_rows = GEMV_MAX_ROWS
        if self._gemv is not None and weight.dtype == torch.bfloat16 and cpu_kernels.bf16_dp():
            self.gemv_max_rows = GEMV_MAX_ROWS_BF16_DP

    @property
    def gemv(self) -> bool:
        """Whether decode-sized row counts run on the C++ GEMV kernel."""
        return self._gemv is not None

    def dense(self) -> torch.Tensor:
        """W [out, in] (a copy when packed)."""
        if self.packed is None:
            return self.weight
        if self.panels:
            return unpack_panels(self.packed, self.out_features, self.in_features)
        return unpack_pairs(self.packed, self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [len(ids), in]: an embedding lookup on the (tied) weight, whatever its layout."""
        if self.packed is None:
            return self.weight.index_select(0, ids)
        if self.packed.dtype == torch.uint8:  # code panels (a GGUF Q8_0 or Q4_1 embedding)
            return code_panels.rows(self.packed, ids, self.in_features)
        # One gather (advanced indexing on the 4-D view took 1.4 ms for 32 ids, this ~0.02 ms).
        # Column panels: element (n, c) lies at flat ((n // 16) * in + c) * 16 + n % 16 (bf16 ones: at
        # BF16_PANEL_POS[n % 16] in place of n % 16). Pair panels: at ((n // 16) * k2 + c // 2) * 32 +
        # (n % 16) * 2 + c % 2.
        if self._row_offsets is None:
            c = torch.arange(self.in_features, device=self.packed.device)
            self._row_offsets = c * PANEL if self.panels else (c // 2) * (2 * PANEL) + c % 2
            self._lane_pos = torch.tensor(BF16_PANEL_POS, device=self.packed.device)
        if self.panels:
            lane = ids % PANEL
            if self.packed.dtype == torch.bfloat16:
                lane = self._lane_pos[lane]
                base = (ids // PANEL) * (self.in_features * PANEL) + lane
                return torch.take(self.packed, base[:, None] + self._row_offsets[None, :]).float()
            base = (ids // PANEL) * (self.in_features * PANEL) + lane
        else:
            base = (ids // PANEL) * (self.packed.shape[1] * 2 * PANEL) + (ids % PANEL) * 2
        return torch.take(self.packed, base[:, None] + self._row_offsets[None, :])

    def fp32(self, x: torch.Tensor, out: OutputBuffer | None = None) -> torch.Tensor:
        """y in fp32, for the LM head's logits: the packed bf16 kernel returns its fp32 accumulators
        unrounded (a bf16 rounding of SmolLM2's logits turned a 0.08 lead into an exact tie). out: the
        packed kernels write y into its rows (valid until the next call with it), else a new tensor."""
        if self.packed is None or x.dim() != 2:
            return self(x).float()
        x = x if x.stride(-1) == 1 else x.contiguous()
        y = out.rows(x.shape[0]) if out is not None else None
        if y is None and self.panels:
            return self(x)  # column panels give fp32 already
        if y is None:
            return self._ops.packed_linear(x, self.packed, self.out_features, self.bias, True)
        if self.panels:
            self._ops.packed_linear_f32_out(x, self.packed, self.out_features, self.bias, y)
        else:
            self._ops.packed_linear_out(x, self.packed, self.out_features, self.bias, True, y)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None:
            if x.dim() != 2:
                return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
            x = x if x.stride(-1) == 1 else x.contiguous()
            if self.panels:
                return self._ops.packed_linear_f32(x, self.packed, self.out_features, self.bias)
            return self._ops.packed_linear(x, self.packed, self.out_features, self.bias)
        if self._gemv is not None and rows <= self.gemv_max_rows and x.dim() == 2:
            return self._gemv.gemv(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)
        if self.onednn:
            if rows > EXACT_ROWS and rows % ROW_BUCKET:
                pad = ROW_BUCKET - rows % ROW_BUCKET
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
