"""The batch-size sweep results the daemon's hints compare live batches against.

`gpuserv bench sweep` keeps its latest result per model at
`$GPUSERV_HOME/sweeps/<model>.json` (it writes there through `sweep_path`); the
`batch_past_plateau` hint reads it back here. The reader lives with the hints,
not with the benchmark, because the running daemon must not import benchmark code.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuservd.paths import gpuserv_home


def sweep_path(model: str) -> Path:
    return gpuserv_home() / "sweeps" / f"{model}.json"


_cache: dict[str, tuple[float, dict]] = {}  # model -> (mtime, result): the daemon reads it once a second


def latest_sweep(model: str) -> dict | None:
    """The model's latest sweep result, or None when it has never been swept here."""
    path = sweep_path(model)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _cache.get(model)
    if hit is None or hit[0] != mtime:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        data["path"] = str(path)
        _cache[model] = hit = (mtime, data)
    return hit[1]
