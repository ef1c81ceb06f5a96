"""GPUSERV_CPU_ISA: run the CPU code paths with AVX2 kernels on a CPU that also has AVX-512.

Measurements meant for an AVX2-only machine can then be taken on a newer one.
`avx2` caps every library gpuserv's CPU path runs on: torch's own kernels
(ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL's BLAS
(MKL_ENABLE_INSTRUCTIONS), and gpuserv's C++ kernels, which are then compiled
without the AVX-512 flags (runner/cpu_kernels.py). `native` (the default)
leaves every library to pick the best the CPU has.

The libraries read their variables on first use, not at import, so `apply()`
must run before the first tensor operation: the daemon and the CLI call it at
start-up, and cpu_kernels calls it before it builds. A variable the user has
already set is left alone. Benchmark subprocesses (the daemon under
`gpuserv bench`, the peers) inherit the environment.
"""

from __future__ import annotations

import os

from gpuservd.dtypes import ISA_ENV as ENV
from gpuservd.errors import UserError

CHOICES = ("native", "avx2")

_LIBRARY_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                         "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def requested() -> str:
    """The ISA asked for in $GPUSERV_CPU_ISA ("native" when unset); a UserError on anything else."""
    value = os.environ.get(ENV, "").strip().lower() or "native"
    if value not in CHOICES:
        raise UserError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value


def library_env(isa: str) -> dict[str, str]:
    """The variables that hold torch, oneDNN and MKL to `isa`."""
    return dict(_LIBRARY_ENV.get(isa, {}))


def apply() -> str:
    """Set the library variables for the requested ISA (before any tensor op); returns the ISA."""
    isa = requested()
    for key, value in library_env(isa).items():
        os.environ.setdefault(key, value)
    return isa
