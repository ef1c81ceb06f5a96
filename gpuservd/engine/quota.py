"""Per-tenant limits inside one engine: a tenant over a limit waits without blocking others."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantQuota:
    weight: float = 1.0  # share of the batch among tenants of equal priority (admission order)
    max_running_seqs: int = 0  # its sequences in the running batch at most (0 = no limit)
    max_kv_blocks: int = 0  # device KV blocks its requests may hold at most (0 = no limit)


UNLIMITED = TenantQuota()
