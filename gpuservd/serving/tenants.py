"""Tenants: who sent a request decides its priority and its queue limits.

A request over the Unix socket carries its peer's uid (SO_PEERCRED), which maps
to a tenant through `profiles/tenants.yaml`; anyone unlisted is the `default`
tenant. A client may name a tenant in the X-Gpuserv-Tenant header only if
that tenant lists its user, or it is trusted (root, the daemon's own user, or
a TCP client that presented the bearer token).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuservd.config import _fill
from gpuservd.engine.quota import TenantQuota
from gpuservd.errors import UserError


@dataclass
class Tenant:
    """One tenant's identity and limits."""

    name: str = "default"
    users: list = field(default_factory=list)  # user names or numeric uids mapped to this tenant
    priority: int = 0  # its requests' priority unless they ask for another (higher runs first)
    max_priority: int | None = None  # the highest priority its requests may ask for (None = priority)
    max_queued: int | None = None  # its requests waiting for a first token (None = server.max_queued_per_tenant)
    max_in_flight: int = 0  # its unfinished requests at most (0 = no limit)
    weight: float = 1.0  # share of each model's batch among tenants of equal priority
    max_running_seqs: int = 0  # its sequences in a model's running batch at most (0 = no limit)
    max_kv_blocks: int = 0  # KV blocks its requests may hold in a model's pool (0 = no limit)
    admin: bool = False  # its users may call /admin/* (see api/auth.py); the default tenant never is

    def quota(self):
        return TenantQuota(self.weight, self.max_running_seqs, self.max_kv_blocks)

    def effective_priority(self, asked: int | None) -> int:
        """The request's priority: what it asked for, capped at max_priority."""
        cap = self.priority if self.max_priority is None else self.max_priority
        return self.priority if asked is None else min(asked, cap)


class TenantError(UserError):
    """A request named a tenant it may not use (the API answers 403 or 400)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _uid(user, where: str) -> int:
    if isinstance(user, int) and not isinstance(user, bool):
        return user
    if isinstance(user, str):
        if user.isdigit():
            return int(user)
        try:
            return pwd.getpwnam(user).pw_uid
        except KeyError:
            return -1  # a user that does not exist on this host matches nobody
    raise UserError(f"{where}: users must be user names or uids, got {user!r}")


def _check(t: Tenant, where: str) -> None:
    for name in ("priority", "max_priority", "max_queued", "max_in_flight"):
        v = getattr(t, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise UserError(f"{where}.{name} must be an integer, got {v!r}")
    if t.max_queued is not None and t.max_queued < 1:
        raise UserError(f"{where}.max_queued must be >= 1, got {t.max_queued}")
    if t.max_in_flight < 0:
        raise UserError(f"{where}.max_in_flight must be >= 0 (0 = no limit), got {t.max_in_flight}")
    if not isinstance(t.weight, (int, float)) or isinstance(t.weight, bool) or t.weight <= 0:
        raise UserError(f"{where}.weight must be a number > 0, got {t.weight!r}")
    if not isinstance(t.admin, bool):
        raise UserError(f"{where}.admin must be true or false, got {t.admin!r}")
    for name in ("max_running_seqs", "max_kv_blocks"):
        if getattr(t, name) < 0:
            raise UserError(f"{where}.{name} must be >= 0 (0 = no limit), got {getattr(t, name)}")


class TenantMap:
    """uid -> Tenant, from tenants.yaml (or just the default tenant)."""

    def __init__(self, default: Tenant | None = None, tenants: list[Tenant] | None = None, path: Path | None = None):
        self.default = default or Tenant()
        self.tenants = {t.name: t for t in tenants or []}
        self.tenants.setdefault(self.default.name, self.default)
        self.path = path
        self.uid_to_tenant: dict[int, Tenant] = {}
        for t in tenants or []:
            for user in t.users:
                self.uid_to_tenant.setdefault(_uid(user, f"{path}: tenant {t.name}"), t)

    @classmethod
    def load(cls, path: Path | None) -> "TenantMap":
        if path is None:
            return cls()

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise UserError(f"tenants file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict) or set(data) - {"default", "tenants"}:
            raise UserError(f"{path}: expected a mapping with 'default:' and 'tenants:' sections")
        default = Tenant()
        _fill(default, data.get("default") or {}, str(path), "default.")
        default.name = "default"
        _check(default, f"{path}: default")
        if default.admin:
            raise UserError(f"{path}: default.admin cannot be true (it would make every local user an admin); "
                            "list the admin users in a tenant of their own")
        tenants = []
        for i, entry in enumerate(data.get("tenants") or []):
            t = Tenant(name="")
            _fill(t, entry, str(path), f"tenants[{i}].")
            if not t.name or not isinstance(t.name, str):
                raise UserError(f"{path}: tenants[{i}].name is required")
            if not isinstance(t.users, list):
                raise UserError(f"{path}: tenants[{i}].users must be a list of user names or uids")
            _check(t, f"{path}: tenants[{i}]")
            tenants.append(t)
        return cls(default, tenants, Path(path))

    def quotas(self) -> dict:
        """name -> TenantQuota, for every model's engine."""
        return {name: t.quota() for name, t in self.tenants.items()}

    def names(self) -> list[str]:
        return sorted(self.tenants)

    def resolve(self, uid: int | None, asked: str | None, trusted: bool = False) -> Tenant:
        """The tenant for a peer uid (None over TCP) and an optional X-Gpuserv-Tenant header."""
        own = self.uid_to_tenant.get(uid, self.default) if uid is not None else self.default
        if not asked or asked == own.name:
            return own
        tenant = self.tenants.get(asked)
        if tenant is None:
            raise TenantError(f"unknown tenant {asked!r} in X-Gpuserv-Tenant; known: {', '.join(self.names())}", 400)
        if trusted or uid in (0, os.getuid()) or (uid is not None and uid in {
                _uid(u, "tenants") for u in tenant.users}):
            return tenant
        raise TenantError(f"uid {uid} may not send requests as tenant {asked!r} (tenants.yaml does not list it)", 403)
