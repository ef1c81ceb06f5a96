"""The daemon's configuration: the `server:` section of the same YAML file as `engine:`.

One file (`--config FILE`, else $GPUSERV_CONFIG, else /etc/gpuserv/gpuserv.yaml
when present, else built-in defaults) configures the engine (gpuservd.config)
and the daemon. Unknown keys are errors here too. Settings that can change
without a restart are re-read on SIGHUP (see `HOT_FIELDS`).
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpuservd.config import EngineConfig, _fill, config_from_dict, read_yaml_file
from gpuservd.errors import UserError
from gpuservd.paths import daemon_socket_path
from gpuservd.serving.routing import check_weights
from gpuservd.sharing.config import SharingConfig, sharing_from_dict
from gpuservd.weights.config import CacheConfig, apply_model_profile

SYSTEM_CONFIG = Path("/etc/gpuserv/gpuserv.yaml")
SECTIONS = ("engine", "scheduler", "preemption", "cache", "model", "sharing", "server")


@dataclass
class ServerConfig:
    """How the daemon listens, admits and stops."""

    socket: str = ""  # Unix socket path; "" = $GPUSERV_SOCKET, systemd's RuntimeDirectory, or the user's runtime dir
    socket_group: str = ""  # group that owns the socket ("" = the daemon's group); members may connect
    socket_mode: str = "0660"  # octal permission bits of the socket file
    tcp: str = ""  # "127.0.0.1:8400" also serves TCP; "" = off (the default)
    tcp_token_file: str = ""  # file holding the bearer token TCP clients must send ("" = no token)
    admin_token_file: str = ""  # file holding the token for /admin over TCP ("" = no admin over TCP)
    log_prompts: bool = True  # publish prompt text (request_prompt events) to admins who ask; false = never
    max_body_bytes: int = 4 * 1024 * 1024  # request bodies larger than this are refused (413)
    header_timeout_s: float = 10.0  # a connection must send its request head within this
    body_timeout_s: float = 30.0  # ...and its body within this after the head (a slow sender is cut off)
    max_connections_per_user: int = 256  # connections one uid may hold on the Unix socket; more -> 429; 0 = off
    metrics_public: bool = False  # true: GET /metrics over TCP needs no token (for Prometheus, endpoint pickers)
    metrics_max_age_ms: float = 25.0  # a scrape may get a body rendered ahead up to this long ago (0 = never)
    models: list = field(default_factory=lambda: ["smollm2"])  # loaded at start
    max_queued_per_model: int = 256  # admitted requests without a first token yet, per model; more -> 429
    max_queued_per_tenant: int = 128  # the same per tenant (tenants.yaml may set its own)
    max_n: int = 16  # choices one request may ask for (n, best_of); each is an engine request; more -> 400
    drain_timeout: float = 30.0  # seconds a drain waits for in-flight requests before aborting them
    admission_window_ms: float = 50.0  # an idle engine waits up to this for a burst's other requests (0 = off)
    profiles_dir: str = ""  # "" = $GPUSERV_PROFILES, /etc/gpuserv/profiles or the source tree's profiles/
    tenants_file: str = ""  # "" = <profiles_dir>/tenants.yaml
    log_level: str = "info"  # debug | info | warning | error
    log_requests: bool = True  # one log line per request (id, uid, tenant, tokens, latency)
    event_queue_size: int = 10000  # events buffered per /admin/events reader; a slower reader loses some
    backlog: int = 2048  # listen() backlog
    versions: dict = field(default_factory=dict)  # alias -> {version model: traffic weight} (canary routing)

    def validate(self) -> None:
        if not isinstance(self.models, list) or any(not isinstance(m, str) or not m for m in self.models):
            raise UserError(f"server.models must be a list of model names, got {self.models!r}")
        for name in ("max_queued_per_model", "max_queued_per_tenant", "max_n", "event_queue_size", "backlog"):
            if getattr(self, name) < 1:
                raise UserError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.metrics_max_age_ms <= 1000:
            raise UserError(f"server.metrics_max_age_ms must be in [0, 1000], got {self.metrics_max_age_ms}")
        if not 0 <= self.admission_window_ms <= 100:
            raise UserError(f"server.admission_window_ms must be in [0, 100], got {self.admission_window_ms}")
        if self.drain_timeout < 0:
            raise UserError(f"server.drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise UserError(f"server.log_level must be debug, info, warning or error, got {self.log_level!r}")
        for name in ("log_requests", "log_prompts", "metrics_public"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"server.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.max_body_bytes, int) or not 1024 <= self.max_body_bytes <= 1 << 30:
            raise UserError(f"server.max_body_bytes must be an integer in [1024, 1073741824], got "
                            f"{self.max_body_bytes!r}")
        v = self.max_connections_per_user
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"server.max_connections_per_user must be an integer >= 0 (0 = no limit), got {v!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.1 <= v <= 3600:
                raise UserError(f"server.{name} must be seconds in [0.1, 3600], got {v!r}")
        self.mode_bits()
        self.group_id()
        if self.tcp:
            parse_tcp(self.tcp)
        if not isinstance(self.versions, dict):
            raise UserError(f"server.versions must map a model name to {{version: weight}}, got {self.versions!r}")

        for alias, weights in self.versions.items():
            check_weights(alias, weights)

    def mode_bits(self) -> int:
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise UserError(f"server.socket_mode must be octal like '0660', got {self.socket_mode!r}") from None
        if not 0 <= mode <= 0o777:
            raise UserError(f"server.socket_mode must be between 0000 and 0777, got {self.socket_mode!r}")
        return mode

    def group_id(self) -> int | None:
        if not self.socket_group:
            return None
        try:
            return grp.getgrnam(self.socket_group).gr_gid
        except KeyError:
            if self.socket_group.isdigit():
                return int(self.socket_group)
            raise UserError(f"server.socket_group: no group named {self.socket_group!r}") from None

    def socket_path(self) -> Path:
        return Path(self.socket).expanduser() if self.socket else daemon_socket_path()

    def profiles_path(self) -> Path | None:
        candidates = [self.profiles_dir, os.environ.get("GPUSERV_PROFILES", ""), "/etc/gpuserv/profiles",
                      str(Path(__file__).resolve().parents[2] / "profiles")]  # the source tree's
        for c in candidates:
            if c and Path(c).expanduser().is_dir():
                return Path(c).expanduser()
        return None

    def tenants_path(self) -> Path | None:
        if self.tenants_file:
            return Path(self.tenants_file).expanduser()
        profiles = self.profiles_path()
        return profiles / "tenants.yaml" if profiles and (profiles / "tenants.yaml").exists() else None


# Re-read on SIGHUP and applied at once; the rest needs a restart (listening sockets) or
# applies at the next model load (the engine section).
HOT_FIELDS = ("max_queued_per_model", "max_queued_per_tenant", "max_n", "drain_timeout", "admission_window_ms",
              "tenants_file", "profiles_dir", "log_level", "log_requests", "models", "versions", "log_prompts",
              "max_body_bytes", "max_connections_per_user",
              "metrics_public", "metrics_max_age_ms")


def parse_tcp(addr: str) -> tuple[str, int]:
    """'127.0.0.1:8400' or '[::1]:8400' -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"tcp address must be HOST:PORT like 127.0.0.1:8400, got {addr!r}")
    return host.strip("[]"), int(port)


@dataclass
class DaemonConfig:
    """The whole file: engine settings (shared by every model) and server settings."""

    engine: EngineConfig
    server: ServerConfig
    path: Path | None  # the file it came from (None = built-in defaults)
    cache: "CacheConfig" = None  # the weight cache (weights/config.py); defaults when None
    sharing: "SharingConfig" = None  # models sharing the device (sharing/config.py); defaults when None

    def __post_init__(self):
        if self.cache is None:
            self.cache = CacheConfig()
        if self.sharing is None:
            self.sharing = SharingConfig()


def daemon_config_from_dict(data: dict | None, where: str = "config") -> DaemonConfig:
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: the top level must be a mapping with engine:, scheduler:, preemption:, cache: and server: sections")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise UserError(f"{where}: unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}")
    engine = config_from_dict({k: v for k, v in data.items() if k in ("engine", "scheduler", "preemption")}, where)

    cache_raw = dict(data.get("cache") or {})
    profile_model = None
    if "model" in data:
        profile_model, _ = apply_model_profile(data["model"], cache_raw, where)
    cache = CacheConfig()
    _fill(cache, cache_raw, where, "cache.")
    cache.validate()
    server = ServerConfig()
    raw = dict(data.get("server") or {})
    mode = raw.get("socket_mode")
    if isinstance(mode, int) and not isinstance(mode, bool):
        # YAML reads 0660 as the octal number 432; a plain 660 is ambiguous.
        if not 0 <= mode <= 0o777:
            raise UserError(f"{where}: server.socket_mode {mode} is not a mode; quote it: socket_mode: '0660'")
        raw["socket_mode"] = f"{mode:04o}"
    _fill(server, raw, where, "server.")
    if profile_model and profile_model not in server.models:
        server.models = list(server.models) + [profile_model]
    server.validate()

    sharing = sharing_from_dict(data.get("sharing"), where)
    return DaemonConfig(engine, server, None, cache, sharing)


def resolve_config_path(path: Path | str | None) -> Path | None:
    """--config, else $GPUSERV_CONFIG, else /etc/gpuserv/gpuserv.yaml when present, else None (defaults)."""
    if path:
        return Path(path)
    if os.environ.get("GPUSERV_CONFIG"):
        return Path(os.environ["GPUSERV_CONFIG"])
    return SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else None


def load_daemon_config(path: Path | str | None) -> DaemonConfig:
    """Read the daemon's YAML file (see resolve_config_path); None gives the defaults."""
    p = resolve_config_path(path)
    if p is None:
        return daemon_config_from_dict({}, "defaults")
    cfg = daemon_config_from_dict(read_yaml_file(p), str(p))
    cfg.path = p
    return cfg
