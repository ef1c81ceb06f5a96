"""Where a benchmark writes, and how: one folder with result.json and result.md."""

from __future__ import annotations

import json
import time
from pathlib import Path


def run_dir(out: Path | None, label: str) -> Path:
    """`out`, or bench/runs/<time>-<label> (the default of every `gpuserv bench` command)."""
    return Path(out) if out else Path("bench/runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"


def write_result(out_dir: Path, result: dict, markdown: str) -> Path:
    """Create out_dir and write result.json (the numbers) and result.md (the table a person reads)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "result.md").write_text(markdown)
    return out
