"""Which compute dtype a device serves best in (`engine.dtype: auto`), and why.

bf16 halves the weight bytes every decode step reads, and decode is bound by
reading them. It pays where the hardware computes in bf16: every CUDA GPU that
serves (Ampere and later; tensor cores), and CPUs with AVX512_BF16 (the
`vdpbf16ps` dot product; measured 1.85x faster than fp32 at batch 1 on such a
CPU). Without AVX512_BF16 a CPU widens every bf16 element to fp32 before it
multiplies: bf16 saves bytes but adds work, and oneDNN and our kernels have no
fast bf16 path there, so fp32 is the safe default.

No torch here: the CLI reads the config, and the CPU's flags come from
/proc/cpuinfo.
"""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAG = "avx512_bf16"
# runner/cpu_isa.py validates this variable and holds the libraries to it; here it only matters that `avx2`
# makes the choice an AVX2-only CPU would make, since the AVX-512 kernels are then not built.
ISA_ENV = "GPUSERV_CPU_ISA"


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo); empty where there is none."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_dtype(device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype, why) for `engine.dtype: auto` on `device` ("cpu", "cpu:N" or "cuda:N"); `flags` are the CPU's
    feature flags (None: read them from /proc/cpuinfo)."""
    if device.startswith("cuda"):
        return "bfloat16", f"{device}: GPUs compute in bf16 (tensor cores) and it halves the bytes a step reads"
    flags = cpu_flags() if flags is None else flags
    capped = os.environ.get(ISA_ENV, "").strip().lower() == "avx2"
    if capped:
        flags = {f for f in flags if not f.startswith("avx512")}
    if BF16_FLAG in flags:
        return "bfloat16", "the CPU has AVX512_BF16: bf16 math is native and halves the bytes a step reads"
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    held = f" ({ISA_ENV}=avx2)" if capped else ""
    return "float32", (f"the CPU has no AVX512_BF16 ({simd} only{held}): bf16 would be converted to fp32 on "
                       "every multiply, slower than fp32")
