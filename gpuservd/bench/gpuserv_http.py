"""gpuserv measured through HTTP in the same `gpuserv bench` run as its peers ("gpuserv[http]").

The bench starts a gpuservd subprocess of its own: the same code as this
process (its package directory first on PYTHONPATH), the same store
($GPUSERV_HOME), the bench's engine config with the thread count the
in-process run used, on a private Unix socket in a temporary directory, so it
never meets a daemon the user runs. The workload then goes through the shared
streaming client like every peer's (http_peers.run_server), with text out as
the peers send it, and the daemon's process tree is sampled the same way.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import yaml

import gpuservd
from gpuservd.bench.http_peers import run_server
from gpuservd.bench.records import SystemRun
from gpuservd.bench.server_process import ServerSpec
from gpuservd.bench.socket_run import gpuserv_endpoint
from gpuservd.config import read_yaml_file

SYSTEM = "gpuserv[http]"


def daemon_config(config_path: Path | None, threads: int, dtype: str) -> dict:
    """The bench's config file (or the defaults) with the in-process run's threads and resolved dtype."""
    data = dict(read_yaml_file(config_path) or {}) if config_path else {}
    engine = dict(data.get("engine") or {})
    engine["num_threads"] = threads
    engine["dtype"] = dtype
    data["engine"] = engine
    return data


def daemon_spec(tmp: Path, model: str, config: dict, ready_timeout_s: float = 600.0) -> ServerSpec:
    """The daemon's command line on a private socket under `tmp`."""
    cfg_path = tmp / "gpuserv.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    sock = tmp / "gs.sock"
    root = str(Path(gpuservd.__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gpuservd.daemon", "--config", str(cfg_path), "--socket", str(sock),
           "--model", model, "--log-level", "warning"]
    return ServerSpec(name="gpuservd", cmd=cmd, env=env, ready_path="/ready", base_url="http://gpuserv",
                      uds=str(sock), ready_timeout_s=ready_timeout_s)


def run_gpuserv_http(config_path: Path | None, model: str, requests: Sequence, threads: int, dtype: str,
                     out_dir: Path, info: dict | None = None) -> SystemRun:
    """Start a private gpuservd, replay `requests` through its socket, stop it (raises ServerFailed)."""
    config = daemon_config(config_path, threads, dtype)
    with tempfile.TemporaryDirectory(prefix="gpuserv-bench-") as tmp:
        spec = daemon_spec(Path(tmp), model, config)
        endpoint = gpuserv_endpoint(model, spec.uds)
        # Text out, as the peers send it and a user reads it (detokenizing is part of the serving path's
        # cost); the token ids too, so the lengths are counted exactly.
        endpoint.extra_body = {"return_token_ids": True}
        # Every request to the one model the daemon loaded (a --model override replaces the workload's).
        endpoint.per_request = lambda r: {"priority": r.priority}
        run = run_server(SYSTEM, spec, endpoint, requests, Path(out_dir) / "gpuservd.log",
                         {"version": gpuservd.__version__, "settings": config, "dtype": dtype,
                          "num_threads": threads, **(info or {})})
    return run
