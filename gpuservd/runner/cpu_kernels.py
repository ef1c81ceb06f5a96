"""The runner's C++ CPU kernels (csrc/): build once, load, or fall back to torch.

- `paged_decode`: decode attention that reads K/V blocks where they lie in the
  cache instead of gathering them into a contiguous tensor first
  (paged_attention.cpp has the work split).
- `rms_norm`, `add_rms_norm_`, `silu_mul`, `rope_store_kv`: the decoder
  layer's elementwise steps fused one op each (fused_ops.cpp), because at
  decode batch sizes torch's dispatch and allocations cost more than the math.
- `decoder_stack`: every decoder layer of a forward in one call, the ops
  above and the packed linears below in the layer loop's order (llama.py
  says when a forward can take it).
- `gemv`: y = x @ W^T + b for decode-sized row counts on the dense weight,
  streamed once at close to memory bandwidth (gemv.cpp; Linear routes rows).
- `packed_linear`: y = x @ W^T + b in bf16 for every row count, W repacked in
  pair panels for vdpbf16ps outer products (packed_gemm.cpp; AVX512_BF16 only,
  `packed_available()` says whether this CPU and build have it).

They are compiled on first use with `torch.utils.cpp_extension.load` (g++ and ninja;
about 10 s on a 2-core machine) into torch's extension directory
(`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), under a name
that hashes the source, the flags and the torch version, so a later process
finds the built library and loads it directly without importing the build
machinery. AVX2/FMA/F16C code is compiled only where the CPU reports those
flags; elsewhere the kernel's scalar loops are built. Where it also has
AVX-512F/VL the same 256-bit code is compiled with EVEX encoding, which gives
gemv 32 vector registers for its register blocks (1.3x at 16-32 rows). Where it
also has AVX512_BF16 (and BW), gemv's bf16 dot-product kernel is compiled in
(-mavx512bf16); the library checks the CPU again before using it
(`ops.bf16_dp_available()`), so a library built elsewhere never runs an
instruction the CPU lacks.

Anything that goes wrong (no compiler, no ninja, a failed build or load) is
logged once and `get()` returns None: the runner then takes its torch paths.
`GPUSERV_CPU_KERNELS=0` turns the kernels off. `GPUSERV_CPU_ISA=avx2` builds them
without the AVX-512 flags even where the CPU has them (runner/cpu_isa.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from gpuservd.dtypes import cpu_flags as _cpu_flags  # a module name of its own: tests stand in another CPU
from gpuservd.runner import cpu_isa

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "fused_ops.cpp", CSRC / "gemv.cpp", CSRC / "packed_gemm.cpp",
           CSRC / "packed_gemm_f32.cpp", CSRC / "packed_panels_f32.cpp", CSRC / "decoder_stack.cpp",
           CSRC / "q4_panels.cpp", CSRC / "q8_panels.cpp"]
HEADERS = sorted(CSRC.glob("*.h"))  # included by the sources: part of the build hash
ENV_SWITCH = "GPUSERV_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": torch.ops.gpuserv or None, "reason": why not, "build_s": compile seconds


def _cflags() -> list[str]:
    # -fopenmp: at::parallel_for is a header template that only forks when the
    # including file is compiled with OpenMP; without it every kernel ran on one
    # thread. The extension links libgomp.so.1, which resolves to the copy torch
    # has already loaded (same soname), so there is one OpenMP thread pool.
    flags = ["-O3", "-std=c++20", "-fopenmp"]
    cpu = _cpu_flags()
    avx512 = cpu_isa.apply() == "native"  # avx2: the same kernels as on an AVX2-only CPU
    if {"avx2", "fma", "f16c"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if avx512 and {"avx512f", "avx512vl"} <= cpu:  # 32 vector registers for gemv's register blocks; 256-bit math
            flags += ["-mavx512f", "-mavx512vl", "-mprefer-vector-width=256"]
            if {"avx512bw", "avx512_bf16"} <= cpu:  # gemv's bf16 dot-product kernel (vdpbf16ps, 512-bit)
                flags += ["-mavx512bw", "-mavx512bf16"]
    return flags


def _ext_name(cflags: list[str]) -> str:
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    return f"gpuserv_cpu_kernels_{h.hexdigest()[:12]}"


def _build_root() -> Path:
    from_env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if from_env:
        return Path(from_env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return base / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"


def _load() -> object:
    cflags = _cflags()
    name = _ext_name(cflags)
    build_dir = _build_root() / name
    lib = build_dir / f"{name}.so"
    if lib.exists():
        try:
            torch.ops.load_library(str(lib))
            return torch.ops.gpuserv
        except (OSError, RuntimeError) as e:  # a half-written library: rebuild below
            log.info("rebuilding %s: %s", lib, e)
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("no C++ compiler on PATH")
    # The `ninja` wheel puts its binary next to this interpreter, which need not be on PATH.
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load  # only to build: a built library loads without it

    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
         build_directory=str(build_dir), is_python_module=False, verbose=False)
    _state["build_s"] = time.perf_counter() - t0
    log.info("built the CPU kernels in %.1f s (%s)", _state["build_s"], build_dir)
    return torch.ops.gpuserv


def _one_line(e: Exception) -> str:
    """The telling line of a build failure: the compiler's first error, else the message's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and "build stopped" not in ln]
    return f"{type(e).__name__}: {(errors or lines or [''])[0 if errors else -1]}"


def get():
    """The kernels' op namespace (`torch.ops.gpuserv`), or None when they cannot be used (logged once)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, reason = None, None
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            reason = f"{ENV_SWITCH}=0"
        else:
            try:
                ops = _load()
            except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
                reason = _one_line(e)
        if ops is None:
            log.warning("C++ CPU kernels not used (%s); attention gathers KV blocks and layers run on torch ops", reason)
        _state["ops"], _state["reason"] = ops, reason
        return ops


def bf16_dp() -> bool:
    """Whether gemv multiplies bf16 with the AVX512_BF16 dot-product kernel (built in, and this CPU has it)."""
    if "bf16_dp" not in _state:
        ops = get()
        _state["bf16_dp"] = bool(ops is not None and hasattr(ops, "bf16_dp_available") and ops.bf16_dp_available())
    return _state["bf16_dp"]


def status() -> dict:
    """Whether the kernels are in use, and if not why; for status output and benchmarks."""
    get()
    return {"loaded": _state["ops"] is not None, "reason": _state["reason"], "build_s": _state.get("build_s")}
