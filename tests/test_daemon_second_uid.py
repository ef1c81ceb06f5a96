"""Who may talk to the daemon, with a real second user (uid 65534 through setpriv), not made-up uids:
refused by the default 0660 socket; on an open socket mapped to its tenant by tenants.yaml (by uid,
SO_PEERCRED), and unable to claim another tenant with X-Gpuserv-Tenant."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from daemon_harness import DaemonProcess, make_home
from second_uid import NOBODY, available, open_dir, request_as_nobody

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
ASK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.fixture()
def sockdir():
    d = open_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_default_0660_socket_refuses_another_user(tmp_path, tiny_model_dir, sockdir):
    d = DaemonProcess(tmp_path, make_home(tmp_path, tiny_model_dir), socket_path=sockdir / "gs.sock")
    try:
        d.wait_ready(600)
        assert oct(d.socket.stat().st_mode & 0o777) == "0o660"
        got = request_as_nobody(d.socket, "POST", "/v1/completions", ASK)
        assert got == {"error": "PermissionError", "errno": errno.EACCES, "uid": NOBODY}
        with d.http() as c:  # the owner still gets in
            assert c.post("/v1/completions", json=ASK).status_code == 200
    finally:
        d.stop(wait_exit=False)


def test_an_open_socket_maps_the_uid_to_its_tenant_and_refuses_another_tenants_header(tmp_path, tiny_model_dir,
                                                                                    sockdir):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("default: {priority: 0}\n"
                       "tenants:\n"
                       f"  - {{name: guests, users: [{NOBODY}], priority: 3}}\n"
                       "  - {name: ops, users: [root], priority: 10}\n")
    d = DaemonProcess(tmp_path, make_home(tmp_path, tiny_model_dir), socket_path=sockdir / "gs.sock",
                      config={"server": {"socket_mode": "0666", "tenants_file": str(tenants)}})
    try:
        d.wait_ready(600)
        got = request_as_nobody(d.socket, "POST", "/v1/completions", ASK)
        assert got["status"] == 200 and got["uid"] == NOBODY, got
        rid = json.loads(got["body"])["id"]
        claimed = request_as_nobody(d.socket, "POST", "/v1/completions", ASK, {"X-Gpuserv-Tenant": "ops"})
        assert claimed["status"] == 403, claimed
        assert f"uid {NOBODY} may not send requests as tenant 'ops'" in json.loads(claimed["body"])["error"]["message"]
        own = request_as_nobody(d.socket, "POST", "/v1/completions", ASK, {"X-Gpuserv-Tenant": "guests"})
        assert own["status"] == 200  # naming its own tenant is fine
        log = d.log
        # the access log line of the first request: its peer uid and the tenant tenants.yaml maps it to
        line = next(x for x in log.splitlines() if rid in x)
        assert f"uid={NOBODY}" in line and "tenant=guests" in line, line
    finally:
        d.stop(wait_exit=False)
