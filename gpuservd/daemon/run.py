"""gpuservd: the daemon's lifecycle (config, sockets, engines, systemd, signals, drain).

Start: read the config, take the listening sockets (from systemd socket
activation via LISTEN_FDS, else bind the Unix socket with the configured mode
and group, plus TCP only when asked), start serving at once (/health answers,
models report "loading"), load the configured models on their engine threads,
then tell systemd READY=1.

Signals: SIGTERM and SIGINT drain (stop admitting with 503, let in-flight
requests finish up to drain_timeout, abort the rest with finish reason
"abort") and exit 0; a second one aborts at once. SIGHUP reloads the config
file without dropping a request. The watchdog is pinged (WATCHDOG=1) only
while every engine loop is alive and iterating, so a wedged engine gets the
unit restarted by systemd.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import platform
import resource
import signal
import socket
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuservd.api.client import Client
from gpuservd.serving.daemon_config import HOT_FIELDS, DaemonConfig, load_daemon_config, parse_tcp
from gpuservd.errors import UserError
from gpuservd.events import EventBus
from gpuservd.events.types import Reload
from gpuservd.serving.routing import VersionRouter
from gpuservd.daemon.sdnotify import Notifier, listen_fds, watchdog_interval_s
from gpuservd.paths import make_private_dir, user_socket
from gpuservd.runner import cpu_isa
from gpuservd.runner.omp import worker_priority
from gpuservd.serving.tenants import TenantMap

log = logging.getLogger("gpuservd")


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    # journald stamps every line itself; a terminal gets the time.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    for name in ("gpuservd", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.getLogger("gpuservd").setLevel(level.upper())
    logging.getLogger("uvicorn").setLevel("WARNING")


def bind_unix(path: Path, mode: int, gid: int | None, backlog: int) -> socket.socket:
    """A listening Unix socket at path, created with `mode` (never wider) and owned by group gid.

    Only a stale socket (one nobody answers on) is replaced; any other file at the path is an error and
    is left alone, so a mistyped --socket can never delete someone's data.
    """
    try:
        if path == user_socket():
            problem = make_private_dir(path.parent)
            if problem:
                raise UserError(problem)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UserError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a file that is not a socket"
            raise UserError(f"cannot listen on {path}: it exists and is {kind}; pick another --socket "
                            "(gpuserv never replaces anything but a stale socket)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise UserError(f"a daemon already answers at {path}; stop it (gpuserv drain) or pick another --socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left behind by a daemon that died
        except PermissionError:
            raise UserError(f"cannot listen on {path}: a socket is there that you may not use; "
                            "pick another --socket") from None
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def bind_tcp(addr: str, backlog: int) -> socket.socket:
    host, port = parse_tcp(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as exc:
        raise UserError(f"cannot listen on TCP {addr}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def device_info(cfg: DaemonConfig) -> dict:
    import torch  # here: `gpuserv plan` imports this module and needs torch only for a CUDA device

    dev = cfg.engine.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            return {"backend": "cuda", "available": False, "name": "no CUDA device visible"}
        idx = int(dev.split(":")[1]) if ":" in dev else 0
        props = torch.cuda.get_device_properties(idx)
        return {"backend": "cuda", "available": True, "index": idx, "name": props.name,
                "memory_bytes": props.total_memory, "num_sms": props.multi_processor_count,
                "compute_capability": [props.major, props.minor]}
    return {"backend": "cpu", "available": True, "name": platform.processor() or platform.machine(),
            "num_threads": cfg.engine.num_threads or torch.get_num_threads(),
            "memory_budget_bytes": cfg.engine.device_memory_bytes}


def _read_token(field: str, path: str) -> str | None:
    """The token in server.<field>'s file; None when the field is empty."""
    if not path:
        return None
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise UserError(f"server.{field}: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise UserError(f"server.{field} {path} is empty")
    return token


class Daemon:
    """One run of the daemon; `run()` returns the exit code."""

    def __init__(self, config_path: Path | None = None, socket_path: str | None = None, tcp: str | None = None,
                 models: list[str] | None = None, log_level: str | None = None, demo: str | None = None):
        self.config_path = config_path
        self.overrides = {k: v for k, v in (("socket", socket_path), ("tcp", tcp), ("models", models),
                                            ("log_level", log_level)) if v}
        self.cfg = self._load()
        self.demo = demo
        self.notifier = Notifier()
        self.server = None
        self.serving = None
        self.socket_path: Path | None = None
        self._owned_socket = False  # we bound it (so we remove it), not systemd
        self._signals = 0
        self._tasks: set[asyncio.Task] = set()

    def _load(self) -> DaemonConfig:
        cfg = load_daemon_config(self.config_path)
        for key, value in self.overrides.items():
            setattr(cfg.server, key, value)
        cfg.server.validate()
        return cfg

    async def _sample_device(self) -> None:
        """Once a second: the device readings (NVML, psutil; status.device.readings and the hint rules), and
        the arbiter's events that no engine step carried out (a slice handed over by a model going idle)."""
        sharing = self.serving.sharing
        while True:
            try:
                await asyncio.to_thread(sharing.sample)
                for event in sharing.take_events():
                    self.serving.bus.publish(event)
            except Exception:
                log.exception("device sampling failed")
            await asyncio.sleep(1.0)

    # ---- sockets ----------------------------------------------------------------------------------
    def _listeners(self) -> list[socket.socket]:
        s = self.cfg.server
        sockets = listen_fds()
        unix = [x for x in sockets if x.family == socket.AF_UNIX]
        if unix:
            name = unix[0].getsockname()
            self.socket_path = Path(name) if isinstance(name, str) and name else None
            log.info("socket activation: %d socket(s) from systemd", len(sockets))
        else:
            self.socket_path = s.socket_path()
            sockets.append(bind_unix(self.socket_path, s.mode_bits(), s.group_id(), s.backlog))
            self._owned_socket = True
        if s.tcp and not any(x.family in (socket.AF_INET, socket.AF_INET6) for x in sockets):
            sockets.append(bind_tcp(s.tcp, s.backlog))
        for x in sockets:
            x.setblocking(False)
        return sockets

    def _tcp_token(self) -> str | None:
        s = self.cfg.server
        if not s.tcp_token_file and s.tcp:
            log.warning("TCP is on without server.tcp_token_file: any local process can use %s", s.tcp)
        return _read_token("tcp_token_file", s.tcp_token_file)

    # ---- run --------------------------------------------------------------------------------------
    async def run(self) -> int:
        # The serving stack (the engine, torch, the HTTP server) loads here, after the config was read and
        # checked: a bad config is a one-line error at once, and `gpuserv plan` imports this module cheaply.
        from gpuservd.api.metrics import Metrics
        from gpuservd.api.server import build_app, make_server
        from gpuservd.runner.omp import use_threads
        from gpuservd.serving.serving import Serving

        # Only engine threads own OpenMP teams (runner/omp.py): this thread and the executor's threads
        # (the host-tier copy after a load, INT8 checks) run their tensor ops serially.
        use_threads(1)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="gpuservd-io", initializer=use_threads, initargs=(1,)))

        s = self.cfg.server
        tenants = TenantMap.load(s.tenants_path())
        token = self._tcp_token()
        admin_token = _read_token("admin_token_file", s.admin_token_file)
        if admin_token is not None and admin_token == token:
            raise UserError("server.admin_token_file holds the same token as server.tcp_token_file; the admin "
                            "token must differ (every TCP client has the other one)")
        listeners = self._listeners()
        metrics = Metrics()
        self.serving = serving = Serving(self.cfg, tenants, metrics, EventBus(s.event_queue_size),
                                         device_info(self.cfg))
        metrics.serving = serving
        serving.socket = str(self.socket_path) if self.socket_path else None
        serving.tcp = s.tcp or None
        self.server = make_server(build_app(serving, metrics, self, token, admin_token), s)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload()))
        serve = asyncio.ensure_future(self.server.serve(sockets=listeners))
        while not self.server.started and not serve.done():
            await asyncio.sleep(0.01)
        log.info("listening on %s%s (tenants: %s)", self.socket_path or "activated socket",
                 f" and tcp {s.tcp}" if s.tcp else "", tenants.path or "built-in default")
        self.notifier.status(f"loading {', '.join(s.models)}")
        await asyncio.to_thread(serving.sharing.prepare, s.models)  # SM partitions before any engine binds to one
        await self._load_models(s.models)
        if serving.state == "starting":
            serving.state = "serving"
        self.notifier.ready(self._status_line())
        log.info("ready: %s", self._status_line())
        self._spawn(self._watchdog())
        self._spawn(serving.hints.run(serving))
        self._spawn(serving.models.keep_alive_loop())  # idle models leave the device after their keep_alive
        self._spawn(self._sample_device())
        if self.demo:
            threading.Thread(target=self._run_demo, daemon=True).start()
        try:
            await serve
        finally:
            serving.bus.close()
            await serving.stop_engines()
            if self._owned_socket and self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)
            self.notifier.close()
        log.info("stopped")
        return 0

    async def _load_models(self, names: list[str]) -> None:
        for name in names:
            if name in self.serving.slots:
                continue
            try:
                await self.serving.load(name)
            except Exception:  # logged by Serving.load; the model shows as failed, the daemon serves the rest
                pass

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _status_line(self) -> str:
        sv = self.serving
        models = ", ".join(f"{n} {s.state}" for n, s in sorted(sv.slots.items())) or "no models"
        return f"{sv.state}: {models}; {len(sv.active)} in flight; socket {self.socket_path}"

    def _on_stop_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: draining (again to stop at once)", signal.Signals(sig).name)
            self._spawn(self.drain(None, exit_after=True))
        else:
            log.warning("%s again: aborting %d requests and stopping now", signal.Signals(sig).name,
                        len(self.serving.active))
            self.serving.abort_all()
            self.serving.bus.close()
            self.server.should_exit = True

    async def drain(self, timeout: float | None, exit_after: bool = True) -> dict:
        """Drain (see Serving.drain); with exit_after the daemon then stops and exits 0."""
        if exit_after:
            self.notifier.stopping(f"draining {len(self.serving.active)} requests")
        result = await self.serving.drain(timeout)
        log.info("drained: %d finished, %d aborted", result["num_finished"], result["num_aborted"])
        if exit_after:
            self.serving.bus.close()
            self.server.should_exit = True
        return result

    async def reload(self) -> dict:
        """SIGHUP / POST /admin/reload: re-read the config file and tenants; in-flight requests are untouched."""
        self.notifier.reloading()
        try:
            new = self._load()
            tenants = TenantMap.load(new.server.tenants_path())
        except UserError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self.notifier.ready(self._status_line())
            return {"reloaded": False, "error": str(exc)}
        old = self.cfg.server
        changed = {f: getattr(new.server, f) for f in HOT_FIELDS if getattr(new.server, f) != getattr(old, f)}
        restart = sorted(f for f in ("socket", "socket_group", "socket_mode", "tcp", "tcp_token_file", "backlog",
                                     "event_queue_size", "admin_token_file", "header_timeout_s", "body_timeout_s")
                         if getattr(new.server, f) != getattr(old, f))
        for f, v in changed.items():
            setattr(old, f, v)
        engine_changed = new.engine != self.cfg.engine
        if (new.engine.devices or self.cfg.engine.devices) and new.engine.device_names() != self.serving.devices:
            # the per-device weight tiers are built at start
            restart.append("engine.devices")
            new.engine.devices = list(self.cfg.engine.devices)
        self.cfg.engine = new.engine  # applies at the next model load

        def on_engine(model: str, fn) -> None:
            slot = self.serving.slots.get(model)
            if slot is not None and slot.loop is not None:
                slot.loop.call(fn)

        restart += self.serving.sharing.reconfigure(new.sharing, on_engine)  # shares, classes, quotas: now
        self.serving.set_tenants(tenants)
        if "versions" in changed:  # the file's version tables replace the run-time ones
            self.serving.models.router = VersionRouter(old.versions)
        for slot in self.serving.slots.values():
            if slot.loop is not None:
                slot.loop.admission_window_s = old.admission_window_ms / 1000
        logging.getLogger("gpuservd").setLevel(old.log_level.upper())
        if "models" in changed:
            self._spawn(self._load_models(old.models))
        result = {"reloaded": True, "changed": changed, "engine_changed": engine_changed,
                  "needs_restart": restart, "tenants": tenants.names()}
        log.info("reloaded %s: %s", self.config_path or "defaults", result)
        self.serving.bus.publish(Reload(**result))
        self.notifier.ready(self._status_line())
        return result

    async def _watchdog(self) -> None:
        """WATCHDOG=1 every half WatchdogSec while every engine loop iterates; STATUS= every 5 s."""
        interval = watchdog_interval_s()
        period = min(interval, 5.0) if interval else 5.0
        last_status = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if interval and self.engines_progressing(2 * interval, now):
                self.notifier.watchdog()
            if now - last_status >= 5.0:
                self.notifier.status(self._status_line())
                last_status = now

    def engines_progressing(self, window_s: float, now: float | None = None) -> bool:
        """True when every loaded model's engine thread is alive and iterated within window_s."""
        now = time.monotonic() if now is None else now
        for slot in self.serving.slots.values():
            if slot.loop is None:
                continue
            if not slot.loop.alive or now - slot.loop.snapshot.heartbeat > window_s:
                return False
        return True

    def _run_demo(self) -> None:
        """`--demo PROMPT`: one request through our own socket, as any client sends it (make run)."""
        model = self.serving.model_names()[0] if self.serving.model_names() else None
        if model is None:
            print("demo: no model is ready; nothing to ask", file=sys.stderr, flush=True)
            return
        print(f"demo: asking {model} through {self.socket_path}: {self.demo}", flush=True)
        try:
            with Client(self.socket_path) as client:
                usage = None
                text = []
                for delta in client.chat_stream(model, [{"role": "user", "content": self.demo}], max_tokens=64,
                                                temperature=0.0):
                    text.append(delta.text or "")
                    usage = delta.usage or usage
            tokens = usage["completion_tokens"] if usage else "?"
            # The reply in one write, whole lines only: the access log (stderr, the server's thread) is
            # written when the request ends and would otherwise land in the middle of the reply's line.
            sys.stdout.write(f"{''.join(text)}\ndemo: {tokens} tokens served through the socket; the daemon "
                             "keeps serving (Ctrl-C drains and stops)\n")
            sys.stdout.flush()
        except UserError as exc:
            print(f"demo: {exc}", file=sys.stderr, flush=True)


# Open files the daemon asks for: every client connection is one, and a shell's soft limit (often 1024)
# is spent by one burst of connections; the hard limit is the ceiling the administrator set.
FD_LIMIT = 65536


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit (at most FD_LIMIT); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # a sandbox may refuse; the daemon runs with what it has
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
        return soft
    return want


def run_daemon(config: Path | None = None, socket_path: str | None = None, tcp: str | None = None,
               models: list[str] | None = None, log_level: str | None = None, demo: str | None = None) -> int:
    """Build and run the daemon in this process; returns its exit code (raises UserError on bad config)."""
    cpu_isa.apply()  # before the first tensor op: the libraries read their ISA variables on first use
    worker_priority()  # a bad GPUSERV_OMP_WORKER_PRIORITY stops the start, not each engine thread later
    raise_fd_limit()
    daemon = Daemon(config, socket_path, tcp, models, log_level, demo)
    setup_logging(daemon.cfg.server.log_level)
    return asyncio.run(daemon.run())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gpuservd", description="gpuserv model-serving daemon")
    p.add_argument("--config", "-c", type=Path, help="YAML config (default: $GPUSERV_CONFIG, "
                                                      "/etc/gpuserv/gpuserv.yaml when present, else defaults)")
    p.add_argument("--socket", help="Unix socket path (default: $GPUSERV_SOCKET, /run/gpuserv/gpuserv.sock under "
                                    "systemd, else $XDG_RUNTIME_DIR/gpuserv/gpuserv.sock)")
    p.add_argument("--tcp", help="also serve TCP on HOST:PORT, e.g. 127.0.0.1:8400 (off by default)")
    p.add_argument("--model", "-m", action="append", dest="models", help="model to load (repeatable; "
                                                                          "default: server.models)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--demo", metavar="PROMPT", help="once ready, send PROMPT through the socket and print the reply")
    a = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 PID`: every thread's stack to the log
    try:
        code = run_daemon(a.config, a.socket, a.tcp, a.models, a.log_level, a.demo)
    except UserError as exc:
        print(f"gpuservd: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
