"""What every HTTP peer of `gpuserv bench` is asked to match, and where peers are installed.

`PeerJob` carries the settings gpuserv ran with (model, dtype, threads, batch
limit, the longest request) so each peer's server is started to match them.
Peers live in a cache under `$GPUSERV_HOME/peers/<name>-<pinned version>/`,
installed on first use; every install step writes its log there.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpuservd.paths import gpuserv_home

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or started here; the message is the reason the report shows."""


def peers_root() -> Path:
    """The cache of installed peers: $GPUSERV_HOME/peers."""
    return gpuserv_home() / "peers"


@dataclass
class PeerJob:
    """The run a peer must match."""

    model_name: str  # the store's name, and the name each server answers to
    model_dir: Path  # the store's directory (safetensors, config.json, tokenizer)
    dtype: str  # float32 | float16 | bfloat16: what gpuserv ran
    threads: int  # gpuserv's compute threads
    max_num_seqs: int  # gpuserv's running-sequence limit (a peer's slots / max_num_seqs)
    max_num_batched_tokens: int  # gpuserv's tokens per step
    longest_tokens: int  # the longest prompt + output in the workload
    isa: str = "native"  # native | avx2 (GPUSERV_CPU_ISA)

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, at the run's dtype."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(self.dtype, 4)

    def slot_tokens(self, round_to: int = 256) -> int:
        """Context per slot: the longest request, rounded up (with a little room for BOS/templates)."""
        return math.ceil((self.longest_tokens + 16) / round_to) * round_to

    def kv_gib_for_all_slots(self) -> int:
        """Whole GiB of KV that hold max_num_seqs requests of the longest length at once."""
        return max(1, math.ceil(self.max_num_seqs * self.slot_tokens() * self.kv_bytes_per_token() / 2**30))


def run_logged(cmd: list[str], log_path: Path, what: str, env: dict | None = None, cwd: Path | None = None,
               timeout_s: float = 3600.0) -> None:
    """Run an install step with its output appended to `log_path`; PeerUnavailable when it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, timeout=timeout_s).returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerUnavailable(f"{what} failed: {exc} (log: {log_path})") from None
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise PeerUnavailable(f"{what} failed with exit code {rc}: {tail[0][:300]} (log: {log_path})")
