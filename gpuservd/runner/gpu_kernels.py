"""The runner's Triton kernels on CUDA: import, compile once, or fall back to torch.

`get(device)` returns an op namespace with the same calls as the C++ CPU
kernels' (cpu_kernels.py) so the decoder layer has one fused path:
`rms_norm`, `add_rms_norm_`, `rope_store_kv`, `silu_mul` (triton_fused.py) and
`paged_decode` (triton_attention.py). On first use it compiles and runs every
kernel once on a tiny input of each dtype the model uses, so a kernel that
fails to compile is found at engine start, not in the middle of a step or a
graph capture; the failure is logged once (one line) and `get()` returns
None, and the runner takes its torch paths. `status()` says which path runs
and why, for /admin/status and `gpuserv doctor`. `GPUSERV_TRITON=0` turns
the kernels off.

Triton is imported lazily here, inside `get()`: it is a GPU-side dependency
(the CUDA image carries it; on a CPU machine only the test extra installs
it) and importing it costs about a second of start-up that a CPU daemon
never needs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "GPUSERV_TRITON"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops", "reason", "compile_s"


def _disabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def _load():
    from gpuservd.runner import triton_attention, triton_fused  # noqa: PLC0415 - see the module docstring

    return SimpleNamespace(
        rms_norm=triton_fused.rms_norm,
        add_rms_norm_=triton_fused.add_rms_norm_,
        rope_store_kv=triton_fused.rope_store_kv,
        silu_mul=triton_fused.silu_mul,
        paged_decode=triton_attention.paged_decode,
    )


def _smoke(ops, device: torch.device, dtype: torch.dtype) -> None:
    """Compile and run every kernel once on a tiny problem (block size 16, 2 KV heads of 2 query heads)."""
    heads, kvh, dim, bs = 4, 2, 64, 16
    h = torch.randn(2, 128, device=device, dtype=dtype)
    w = torch.ones(128, device=device, dtype=dtype)
    ops.add_rms_norm_(h, ops.rms_norm(h, w, 1e-6), w, 1e-6)
    ops.silu_mul(h)
    qkv = torch.randn(2, heads + 2 * kvh, dim, device=device, dtype=dtype)
    cos = torch.ones(2, 1, dim, device=device, dtype=dtype)
    kc = torch.zeros(2, bs, kvh, dim, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    ops.rope_store_kv(qkv, cos, cos, kc, vc, torch.tensor([0, -1], device=device), heads, kvh)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    lens = torch.tensor([1, 0], dtype=torch.int32, device=device)
    out = ops.paged_decode(qkv[:, :heads], kc, vc, table, lens, dim ** -0.5)
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("paged_decode gave non-finite values on its smoke test")


def get(device: torch.device | str = "cuda", dtype: torch.dtype | None = None):
    """The Triton op namespace for a CUDA device, or None where it cannot run (logged once)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    key = ("ops", dtype)
    if key in _state:
        return _state[key]
    with _lock:
        if key in _state:
            return _state[key]
        ops, reason = None, None
        if _disabled():
            reason = f"{ENV_SWITCH}=0"
        else:
            t0 = time.perf_counter()
            try:
                ops = _load()
                _smoke(ops, device, dtype or torch.float32)
                torch.cuda.synchronize(device)
                _state["compile_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - any import or compile failure means: the torch path
                ops, reason = None, _one_line(e)
        if ops is None:
            log.warning("Triton kernels not used (%s); the layers run on torch ops and attention gathers blocks",
                        reason)
        _state[key], _state["reason"] = ops, reason
        return ops


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def status() -> dict:
    """Whether the kernels were loaded (on this process's CUDA engines), and if not why."""
    loaded = any(v is not None for k, v in _state.items() if isinstance(k, tuple))
    return {"loaded": loaded, "reason": _state.get("reason"), "compile_s": _state.get("compile_s"),
            "disabled": _disabled()}
