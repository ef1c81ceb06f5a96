"""The daemon's parts without a daemon: request parsing, config, tenants, sd_notify, units, CLI without a daemon."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from gpuservd.daemon import systemd_units
from gpuservd.api import protocol, responses
from gpuservd.api.protocol import APIError
from gpuservd.serving.daemon_config import daemon_config_from_dict
from gpuservd.errors import UserError
from gpuservd.daemon.sdnotify import Notifier, listen_fds, watchdog_interval_s
from gpuservd.serving.tenants import TenantError, TenantMap

ROOT = Path(__file__).resolve().parent.parent


# ---- request parsing ---------------------------------------------------------------------------------

def test_completion_defaults_follow_openai():
    r = protocol.parse_completion({"model": "m", "prompt": "hi"})
    assert (r.max_tokens, r.temperature, r.top_p, r.stream, r.stop) == (16, 1.0, 1.0, False, [])
    assert protocol.parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert protocol.parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt_token_ids == [1, 2]
    assert protocol.parse_completion({"model": "m", "prompt": "x", "stop": "\n"}).stop == ["\n"]
    assert protocol.parse_completion({"model": "m", "prompt": "x", "top_k": -1}).top_k == 0


def test_chat_accepts_what_openai_clients_send():
    r = protocol.parse_chat({
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}], "name": "x"}],
        "max_completion_tokens": 7, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "me",
        "response_format": {"type": "text"}, "stream": True, "stream_options": {"include_usage": True}, "n": 1})
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert r.max_tokens == 7 and r.include_usage and r.stream
    assert protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).max_tokens is None


def test_echo_with_logprobs_asks_the_engine_for_the_prompt_logprobs():
    both = protocol.parse_completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 2})
    assert both.sampling_kwargs()["prompt_logprobs"] == 2 and both.sampling_kwargs()["logprobs"] == 2
    assert protocol.parse_completion({"model": "m", "prompt": "x", "logprobs": 2}).sampling_kwargs()[
        "prompt_logprobs"] is None
    assert protocol.parse_completion({"model": "m", "prompt": "x", "echo": True}).sampling_kwargs()[
        "prompt_logprobs"] is None


@pytest.mark.parametrize("body,param,message", [
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "must be in [-2.0, 2.0]"),
    ({"model": "m", "prompt": "x", "skip_special_tokens": False}, "skip_special_tokens", "neutral value"),
    ({"model": "m", "prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", "logprobs must be <= 5"),
    ({"model": "m", "prompt": "x", "n": 17}, "n", "server.max_n"),
    ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of", "must be >= n"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"model": "m", "prompt": "x", "logit_bias": {"7": 101}}, "logit_bias", "[-100, 100]"),
    ({"model": "m", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "with a schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
     "top_logprobs", "<= 20"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
     "no tools"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"model": "m", "prompt": "x", "detokenize": False, "stop": ["a"]}, "stop", "need text"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed", "seed must be an integer"),
    ({"model": "m", "prompt": "x", "priority": True}, "priority", "priority must be an integer"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "text only"),
    ({"model": 3, "prompt": "x"}, "model", "model is required"),
])
def test_bad_fields_name_the_field(body, param, message):
    parse = protocol.parse_chat if "messages" in body else protocol.parse_completion
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param and message in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_sse_framing_and_the_fast_chunk_encoder():
    assert responses.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert responses.SSE_DONE == b"data: [DONE]\n\n"
    for kind in ("chat", "completion"):
        for ids in (True, False):
            for usage in (True, False):
                enc = responses.ChunkEncoder(kind, "r1", "m", 5, ids, usage)
                for text in ('a"b\n\u00e9\\', ""):
                    for finish in (None, "stop"):
                        slow = responses.stream_chunk(kind, "r1", "m", 5, text, finish, [1, 2] if ids else None,
                                                      include_usage=usage)
                        assert enc.encode(text, finish, [1, 2]) == responses.sse(slow)


# ---- config and tenants ------------------------------------------------------------------------------

def test_server_section_defaults_and_strictness(tmp_path):
    cfg = daemon_config_from_dict({"engine": {"block_size": 8}, "server": {"socket_mode": 0o640, "tcp": "[::1]:8400"}})
    assert cfg.engine.block_size == 8 and cfg.server.mode_bits() == 0o640 and cfg.server.models == ["smollm2"]
    assert daemon_config_from_dict(None).server.max_queued_per_model == 256
    for data, message in [
        ({"server": {"socket_mod": "0600"}}, "unknown key server.'socket_mod'"),
        ({"servr": {}}, "unknown section 'servr'"),
        ({"server": {"socket_mode": 660}}, "quote it"),
        ({"server": {"tcp": "8400"}}, "HOST:PORT"),
        ({"server": {"models": "tiny"}}, "list of model names"),
        ({"server": {"drain_timeout": "soon"}}, "must be a number"),
        ({"server": {"socket_group": "no-such-group-xyz"}}, "no group named"),
    ]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            daemon_config_from_dict(data)


def test_default_socket_paths(monkeypatch, tmp_path):
    from gpuservd.paths import client_socket_path, daemon_socket_path

    for k in ("GPUSERV_SOCKET", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert daemon_socket_path() == tmp_path / "gpuserv" / "gpuserv.sock" == client_socket_path()
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/gpuserv")
    assert daemon_socket_path() == Path("/run/gpuserv/gpuserv.sock")
    monkeypatch.setenv("GPUSERV_SOCKET", str(tmp_path / "x.sock"))
    assert daemon_socket_path() == tmp_path / "x.sock" == client_socket_path()


def test_tenants_map_uids_and_guard_the_header(tmp_path):
    me = os.getuid()
    (tmp_path / "t.yaml").write_text(
        "default: {priority: 1, max_queued: 5}\n"
        f"tenants:\n  - {{name: a, users: [{me + 1}], priority: 3, max_priority: 4}}\n"
        "  - {name: b, users: [nobody-here-xyz]}\n")
    tm = TenantMap.load(tmp_path / "t.yaml")
    assert tm.resolve(me + 1, None).name == "a" and tm.resolve(me + 2, None).name == "default"
    assert tm.resolve(None, None).name == "default"
    a = tm.tenants["a"]
    assert (a.effective_priority(None), a.effective_priority(10), a.effective_priority(-2)) == (3, 4, -2)
    assert tm.resolve(me + 2, "a", trusted=True).name == "a"
    assert tm.resolve(me, "a").name == "a"  # the daemon's own user may name any tenant
    with pytest.raises(TenantError) as e:
        tm.resolve(me + 2, "a")
    assert e.value.status == 403
    with pytest.raises(TenantError) as e:
        tm.resolve(me + 1, "zzz")
    assert e.value.status == 400 and "known: a, b, default" in str(e.value)
    (tmp_path / "bad.yaml").write_text("tenants:\n  - {name: x, max_in_flight: -1}\n")
    with pytest.raises(UserError, match="max_in_flight must be >= 0"):
        TenantMap.load(tmp_path / "bad.yaml")
    assert TenantMap.load(ROOT / "profiles" / "tenants.yaml").names() == ["batch", "default", "ops"]


# ---- systemd protocols -------------------------------------------------------------------------------

def test_notifier_sends_datagrams(tmp_path, monkeypatch):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "n.sock"))
    listener.settimeout(5)
    n = Notifier(str(tmp_path / "n.sock"))
    assert n.ready("up") and n.watchdog() and n.stopping("bye")
    got = [listener.recv(1024).decode() for _ in range(3)]
    assert got[0].splitlines()[:2] == ["READY=1", "STATUS=up"] and got[1] == "WATCHDOG=1"
    assert got[2] == "STOPPING=1\nSTATUS=bye"
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier().enabled and Notifier().send(READY=1) is False
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"gpuserv-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract.bind("\0" + name)
    abstract.settimeout(5)
    assert Notifier("@" + name).watchdog() and abstract.recv(64) == b"WATCHDOG=1"
    # a receiver that stops reading must never block the daemon's event loop
    t0 = time.monotonic()
    sent = [n.watchdog() for _ in range(5000)]
    assert time.monotonic() - t0 < 5 and not all(sent)


def _fill(n: Notifier) -> int:
    """Watchdog pings until the receiver's queue has no room; returns how many went in."""
    count = 0
    while n.watchdog():
        count += 1
    return count


def _read_all(listener) -> list[str]:
    got = []
    listener.setblocking(False)
    try:
        while True:
            got.append(listener.recv(1024).decode())
    except BlockingIOError:
        return got


def test_notifier_keeps_state_messages_the_receiver_had_no_room_for(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "n.sock"))
    n = Notifier(str(tmp_path / "n.sock"))
    queued = _fill(n)
    assert queued >= 1
    assert n.stopping("bye") is False and n.reloading() is False and n.num_pending == 2
    assert n.watchdog() is False  # still full: a ping is dropped, not kept
    got = _read_all(listener)
    assert got == ["WATCHDOG=1"] * queued  # nothing got past the full queue
    assert n.flush() and n.num_pending == 0
    got = _read_all(listener)
    assert got[0] == "STOPPING=1\nSTATUS=bye" and got[1].startswith("RELOADING=1\n") and len(got) == 2

    # from the event loop: offered again on its own once the receiver reads
    async def main():
        _fill(n)
        assert n.ready("up") is False
        reader = threading.Thread(target=lambda: received.extend(_read_all(listener)))
        reader.start()
        reader.join()
        for _ in range(3000):  # the retry timer's work, however slow this machine is right now
            if not n.num_pending:
                break
            await asyncio.sleep(0.01)
        return n.num_pending

    received: list[str] = []
    assert asyncio.run(main()) == 0
    assert any(m.startswith("READY=1\nSTATUS=up") for m in received + _read_all(listener))

    # at exit (no event loop left to retry): close() offers it once more
    _fill(n)
    assert n.stopping("last") is False
    received += _read_all(listener)
    n.close()
    assert "STOPPING=1\nSTATUS=last" in received + _read_all(listener) and n.num_pending == 0


def test_watchdog_interval_and_listen_fds_env(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 1.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval_s() is None
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    assert listen_fds() == []
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))  # meant for another process: left alone
    assert listen_fds() == []


def test_watchdog_pings_only_while_engines_progress():
    from gpuservd.daemon.run import Daemon

    now = time.monotonic()
    loop = SimpleNamespace(alive=True, snapshot=SimpleNamespace(heartbeat=now))
    d = Daemon.__new__(Daemon)
    d.serving = SimpleNamespace(slots={"m": SimpleNamespace(loop=loop), "loading": SimpleNamespace(loop=None)})
    assert d.engines_progressing(1.0, now + 0.5)
    assert not d.engines_progressing(1.0, now + 2.0)  # stuck in a step (or deadlocked)
    loop.alive = False
    assert not d.engines_progressing(1.0, now)  # the engine thread died


# ---- unit files ---------------------------------------------------------------------------------------

def test_repo_units_are_the_rendered_ones():
    assert (ROOT / "systemd" / "gpuservd.service").read_text() == systemd_units.service()
    assert (ROOT / "systemd" / "gpuservd.socket").read_text() == systemd_units.socket_unit()
    assert (ROOT / "systemd" / "gpuserv.sysusers.conf").read_text() == systemd_units.SYSUSERS
    text = systemd_units.service()
    for line in ("Type=notify", "WatchdogSec=60s", "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "RuntimeDirectory=gpuserv", "StateDirectory=gpuserv", "User=gpuserv", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "DeviceAllow=char-nvidia* rw"):
        assert line in text.splitlines(), line
    assert "SocketMode=0660" in systemd_units.socket_unit()


@pytest.mark.parametrize("user", [False, True], ids=["system", "user"])
def test_install_writes_units_that_systemd_analyze_verifies(tmp_path, user):
    from gpuservd.cli.main import app

    dest = tmp_path / "units"
    args = ["systemd", "install", "--dest", str(dest), "--exec", sys.executable] + (["--user"] if user else [])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (dest / "gpuservd.service").read_text() == systemd_units.service(sys.executable, user)
    assert (dest / "gpuservd.socket").exists() and (dest / "gpuserv.sysusers.conf").exists() != user
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    os.chmod(tmp_path, 0o700)
    out = subprocess.run(["systemd-analyze"] + (["--user"] if user else []) +
                         ["verify", "./gpuservd.socket", "./gpuservd.service"],
                         cwd=dest, env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "Failed to initialize manager" in out.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {out.stderr.strip()}")
    # verify exits 0 even for unknown keys; any line about our files is a failure
    assert out.returncode == 0 and "gpuservd" not in out.stderr + out.stdout, out.stderr


# ---- the CLI when no daemon answers ------------------------------------------------------------------

def test_commands_say_in_one_line_that_no_daemon_answers(tmp_path):
    sock = tmp_path / "none.sock"
    env = {**os.environ, "GPUSERV_SOCKET": str(sock), "GPUSERV_HOME": str(tmp_path)}
    gpuserv = [sys.executable, "-m", "gpuservd.cli.main"]
    out = subprocess.run(gpuserv + ["status"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"error: no daemon answers at {sock}; start one with `gpuserv serve` "
                          "(or `systemctl start gpuservd`)\n")
    out = subprocess.run(gpuserv + ["generate", "hello"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "no daemon answers" in out.stderr and "--local" in out.stderr
    out = subprocess.run(gpuserv + ["models", "ls", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout) == []  # the store needs no daemon


def test_client_and_cli_do_not_import_torch():
    code = ("import sys, gpuservd.api.client, gpuservd.api.protocol, gpuservd.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'starlette', "
            "'uvicorn', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_example_config_is_the_defaults():
    from dataclasses import asdict

    from gpuservd.serving.daemon_config import load_daemon_config

    example = load_daemon_config(ROOT / "profiles" / "gpuserv.yaml")
    defaults = daemon_config_from_dict({})
    assert asdict(example.server) == asdict(defaults.server)
    assert asdict(example.engine) == asdict(defaults.engine)
