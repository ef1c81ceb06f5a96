"""The admin role: /admin/* for root, the daemon's user, tenants marked admin (over TCP: the admin
token); prompt text in events for admins only and only while server.log_prompts allows. The real
daemon over its socket, the other users as uids 65534 (nobody) and 4242 (listed in an admin tenant)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import DaemonProcess, make_home, wait_until, free_port  # noqa: E402
from hostile import NOBODY, as_user, open_dir, remove  # noqa: E402

OPS_UID = 4242
TOKEN, ADMIN_TOKEN = "user-token-1", "admin-token-2"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("security-roles")
    home = make_home(tmp, tiny_model_dir)
    (tmp / "tenants.yaml").write_text(
        "tenants:\n"
        f"  - {{name: ops, users: [{OPS_UID}], admin: true}}\n"
        f"  - {{name: team, users: [{NOBODY}]}}\n")
    (tmp / "token").write_text(TOKEN)
    (tmp / "admin-token").write_text(ADMIN_TOKEN)
    sockdir = open_dir("gs-roles-")
    port = free_port()
    d = DaemonProcess(tmp, home, socket_path=sockdir / "gs.sock", config={"server": {
        "socket_mode": "0666", "tenants_file": str(tmp / "tenants.yaml"), "tcp": f"127.0.0.1:{port}",
        "tcp_token_file": str(tmp / "token"), "admin_token_file": str(tmp / "admin-token")}})
    d.port = port
    try:
        with d:
            yield d
    finally:
        remove(sockdir)


def _admin_requests() -> list[tuple[str, str]]:
    """(method, path) of every /admin route in the app's own route table, path parameters filled in."""
    from gpuservd.api.server import build_app

    app = build_app(None, None, None)
    out = []
    for route in app.routes:
        if not route.path.startswith("/admin"):
            continue
        path = route.path
        for name in route.param_convertors:
            path = path.replace("{" + name + "}", "x").replace("{" + name + ":path}", "x")
        for method in sorted(route.methods):  # HEAD too: Starlette answers it for every GET route
            out.append((method, path))
    return out


def _as(uid: int, daemon, calls: list[tuple[str, str]]) -> list[tuple[int, dict | None]]:
    sock = str(daemon.socket)

    def run():
        answers = []
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://gpuserv", timeout=30) as c:
            for method, path in calls:
                r = c.request(method, path, json={} if method == "POST" else None)
                answers.append((r.status_code, r.json() if r.content and r.headers.get(
                    "content-type", "").startswith("application/json") else None))
        return answers

    return as_user(run, uid, uid)


def test_a_non_admin_gets_403_from_every_admin_route(daemon):
    calls = _admin_requests()
    assert len(calls) >= 11 and ("POST", "/admin/drain") in calls and ("HEAD", "/admin/events") in calls
    calls.append(("GET", "/admin/not-a-route-yet"))  # guarded by its prefix, not by a list
    answers = _as(NOBODY, daemon, calls)
    assert len(answers) == len(calls)
    for (method, path), (status, body) in zip(calls, answers):
        assert status == 403, (method, path, status, body)
        if method == "HEAD":  # no body to read the reason from
            continue
        assert body["error"]["code"] == "admin_required" and "uid 65534 is not an admin" in body["error"]["message"]
    # Nothing happened: the daemon still serves, every model still loaded.
    assert daemon.status()["state"] == "serving"


def test_public_and_v1_routes_are_unchanged_for_any_user(daemon):
    calls = [("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models")]
    assert [s for s, _ in _as(NOBODY, daemon, calls)] == [200, 200, 200, 200]


def test_admins_are_root_the_daemon_user_and_admin_tenants(daemon):
    calls = [("GET", "/admin/status"), ("GET", "/admin/requests"), ("GET", "/admin/not-a-route-yet")]
    assert [s for s, _ in _as(OPS_UID, daemon, calls)] == [200, 200, 404]
    with daemon.http() as c:  # root, also the daemon's own user here
        assert c.get("/admin/status").status_code == 200


def test_tcp_admin_needs_the_admin_token(daemon):
    base = f"http://127.0.0.1:{daemon.port}"

    def auth(t):
        return {"Authorization": f"Bearer {t}"}

    r = httpx.get(base + "/admin/status", headers=auth(TOKEN))
    assert r.status_code == 403 and "admin token" in r.json()["error"]["message"]
    assert httpx.get(base + "/admin/status").status_code == 403
    assert httpx.get(base + "/admin/status", headers=auth(ADMIN_TOKEN)).status_code == 200
    assert httpx.get(base + "/v1/models", headers=auth(TOKEN)).status_code == 200
    assert httpx.get(base + "/v1/models", headers=auth(ADMIN_TOKEN)).status_code == 200
    assert httpx.get(base + "/v1/models").status_code == 401


def _read_events(daemon, out: list, ready: threading.Event, stop: threading.Event) -> None:
    with daemon.http(60) as c, c.stream("GET", "/admin/events?types=request_prompt") as r:
        ready.set()
        for line in r.iter_lines():
            if line:
                out.append(json.loads(line))
            if stop.is_set():
                return


def test_prompts_reach_admins_only_and_only_when_log_prompts_allows(daemon):
    calls = [("GET", "/admin/events?types=request_prompt")]
    assert _as(NOBODY, daemon, calls)[0][0] == 403
    events: list = []
    ready, stop = threading.Event(), threading.Event()
    reader = threading.Thread(target=_read_events, args=(daemon, events, ready, stop), daemon=True)
    reader.start()
    assert ready.wait(30)
    time.sleep(0.2)  # the subscription is registered when the first line (hello) is out
    sock = str(daemon.socket)

    def ask():
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://gpuserv", timeout=60) as c:
            return c.post("/v1/completions", json={"model": "tiny", "prompt": "my secret words",
                                                   "max_tokens": 2}).status_code

    assert as_user(ask) == 200
    wait_until(lambda: any(e.get("prompt") == "my secret words" for e in events), 30, what=lambda: events)
    stop.set()
    # Switched off: the daemon neither publishes prompt text nor accepts a reader for it.
    daemon.write_config({"server": {**daemon.config["server"], "log_prompts": False}})
    with daemon.http() as c:
        assert c.post("/admin/reload").json()["reloaded"] is True
        r = c.get("/admin/events?types=request_prompt")
        assert r.status_code == 403 and "log_prompts" in r.json()["error"]["message"]
