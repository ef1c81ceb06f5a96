"""One local user cannot take every connection the daemon can hold. The real daemon over its socket,
started with a small file-descriptor limit (as a shell's 1024 is small); the flood comes from uid 65534
holding idle connections, the others are root and uid 4242 (tests/hostile.py)."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import DaemonProcess, make_home, wait_until  # noqa: E402
from hostile import as_user, open_dir, remove, require_root  # noqa: E402

LIMIT = 8  # server.max_connections_per_user here
FLOOD = 320  # connections uid 65534 tries to hold: more than the daemon's 256 file descriptors
WAVE = 40
OTHER_UID = 4242


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    require_root()
    tmp = tmp_path_factory.mktemp("security-connections")
    home = make_home(tmp, tiny_model_dir)
    shared = open_dir("gs-conn-")
    shared.chmod(0o777)  # the flood's child writes its progress here
    d = DaemonProcess(tmp, home, socket_path=shared / "gs.sock", wrapper=["prlimit", "--nofile=256:256"], config={
        "server": {"socket_mode": "0666", "max_connections_per_user": LIMIT,
                   "header_timeout_s": 600}})  # an idle connection is held for the whole test
    d.shared = shared
    try:
        with d:
            yield d
    finally:
        remove(shared)


def _flood(sock_path: str, opened: Path, release: Path) -> dict:
    """As the hostile user: open FLOOD connections that never finish a request head, in waves (a burst
    past the daemon's free descriptors would fail its accepts however they are answered), note what the
    daemon answered on each, and hold the rest open until `release` appears."""
    held, refused, codes = [], 0, set()
    for _ in range(FLOOD // WAVE):
        wave = []
        for _ in range(WAVE):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock_path)
            try:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gpuserv\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed before the head went out: the 429 is still there to read
            wave.append(s)
        # A refusal comes at once and a held connection hears nothing: wait for as many answers as the
        # limit leaves refused (bounded: without a limit none come).
        expected = WAVE - max(0, LIMIT - len(held))
        answered: set = set()
        deadline = time.monotonic() + 10.0
        while len(answered) < expected and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in wave if s not in answered], [], [], deadline - time.monotonic())
            answered.update(ready)
        for s in wave:
            if s not in answered:
                held.append(s)
                continue
            data = s.recv(65536)
            s.close()
            if data.startswith(b"HTTP/1.1 429"):
                refused += 1
                codes.add(json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"])
    opened.write_text("")
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in held:
        s.close()
    return {"refused": refused, "held": len(held), "codes": sorted(codes)}


def _ask(sock_path: str) -> int:
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock_path), base_url="http://gpuserv", timeout=30) as c:
        return c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code


def test_one_user_cannot_hold_every_connection(daemon):
    sock = str(daemon.socket)
    opened, release = daemon.shared / "opened", daemon.shared / "release"
    result: dict = {}

    def run():
        result.update(as_user(lambda: _flood(sock, opened, release), timeout=240))

    flood = threading.Thread(target=run)
    flood.start()
    try:
        wait_until(opened.exists, 180, what="the flood's connections")
        # While uid 65534 holds what it may, everyone else is still served: root, and another user.
        assert _ask(sock) == 200
        assert as_user(lambda: _ask(sock), OTHER_UID, OTHER_UID) == 200
    finally:
        release.write_text("")
        flood.join(240)
    assert result == {"refused": FLOOD - LIMIT, "held": LIMIT, "codes": ["too_many_connections"]}
    log = daemon.log
    assert log.count(f"uid 65534 has {LIMIT} connections open") == 1  # one line, not one per refusal
    assert "Too many open files" not in log and "Traceback" not in log
    # Its connections closed, the same user is served again.
    wait_until(lambda: as_user(lambda: _ask(sock)) == 200, 30, what="uid 65534 served again")


def test_the_limit_names_its_setting(daemon):
    sock = str(daemon.socket)

    def over() -> tuple[int, dict]:
        socks = [socket.socket(socket.AF_UNIX) for _ in range(LIMIT)]
        try:
            for s in socks:
                s.connect(sock)
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://gpuserv", timeout=30) as c:
                r = c.get("/health")
                return r.status_code, r.json()["error"]
        finally:
            for s in socks:
                s.close()

    status, err = as_user(over)
    assert status == 429 and err["code"] == "too_many_connections"
    assert "uid 65534 already has 8 connections open" in err["message"]
    assert "server.max_connections_per_user" in err["message"]
    assert os.path.exists(sock)
