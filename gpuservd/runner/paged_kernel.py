"""The C++ paged decode-attention kernel (csrc/paged_attention.cpp): build once, load, or fall back.

The kernel reads K/V blocks where they lie in the cache instead of gathering
them into a contiguous tensor first (see the .cpp for the work split). It is
compiled on first use with `torch.utils.cpp_extension.load` (g++ and ninja;
about 10 s on a 2-core machine) into torch's extension directory
(`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`), under a name
that hashes the source, the flags and the torch version, so a later process
finds the built library and loads it directly without importing the build
machinery. AVX2/FMA/F16C code is compiled only where the CPU reports those
flags; elsewhere the kernel's scalar loops are built.

Anything that goes wrong (no compiler, no ninja, a failed build or load) is
logged once and `get()` returns None: attention then takes the torch gather
path. `GPUSERV_PAGED_KERNEL=0` turns the kernel off.
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
ENV_SWITCH = "GPUSERV_PAGED_KERNEL"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the loaded op or None, "reason": why not, "build_s": compile seconds


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cflags() -> list[str]:
    flags = ["-O3", "-std=c++20"]
    if {"avx2", "fma", "f16c"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def _ext_name(cflags: list[str]) -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    return f"gpuserv_paged_attn_{h.hexdigest()[:12]}"


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
            return torch.ops.gpuserv.paged_decode
        except (OSError, RuntimeError) as e:  # a half-written library: rebuild below
            log.info("rebuilding %s: %s", lib, e)
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("no C++ compiler on PATH")
    # The `ninja` wheel puts its binary next to this interpreter, which need not be on PATH.
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load(name=name, sources=[str(SOURCE)], extra_cflags=cflags, build_directory=str(build_dir),
         is_python_module=False, verbose=False)
    _state["build_s"] = time.perf_counter() - t0
    log.info("built the paged attention kernel in %.1f s (%s)", _state["build_s"], build_dir)
    return torch.ops.gpuserv.paged_decode


def get():
    """The kernel op `paged_decode(q, k_cache, v_cache, block_table, ctx_lens, scale)`, or None (logged once)."""
    if "op" in _state:
        return _state["op"]
    with _lock:
        if "op" in _state:
            return _state["op"]
        op, reason = None, None
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            reason = f"{ENV_SWITCH}=0"
        else:
            try:
                op = _load()
            except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        if op is None:
            log.warning("paged attention kernel not used (%s); decode attention gathers blocks in torch", reason)
        _state["op"], _state["reason"] = op, reason
        return op


def status() -> dict:
    """Whether the kernel is in use, and if not why; for status output and benchmarks."""
    get()
    return {"loaded": _state["op"] is not None, "reason": _state["reason"], "build_s": _state.get("build_s")}
