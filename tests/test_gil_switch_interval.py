"""The daemon sets the interpreter's GIL switch interval at start (daemon/gil.py,
GPUSERV_GIL_SWITCH_INTERVAL_MS): read back from the running daemon's /admin/status, and a bad value stops
the start with a message naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemon_harness import ROOT, DaemonProcess, make_home
from gpuservd.daemon.gil import SWITCH_INTERVAL_ENV, switch_interval_ms
from gpuservd.errors import UserError


def test_the_running_daemon_uses_the_configured_switch_interval(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir)
    d = DaemonProcess(tmp_path, home, env={SWITCH_INTERVAL_ENV: "0.75"})
    try:
        d.wait_ready(600)
        assert d.status()["process"]["gil_switch_interval_s"] == pytest.approx(0.00075, rel=1e-3)
    finally:
        d.stop(wait_exit=False)


def test_unset_it_is_pythons_default(monkeypatch):
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    assert switch_interval_ms() == 5.0
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, " 1 ")
    assert switch_interval_ms() == 1.0


@pytest.mark.parametrize("raw, says", [("fast", "number of milliseconds"), ("0", "between"), ("500", "between")])
def test_a_bad_value_says_what_to_set(monkeypatch, raw, says):
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    with pytest.raises(UserError, match=says):
        switch_interval_ms()


def test_the_daemon_refuses_to_start_with_a_bad_interval(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), SWITCH_INTERVAL_ENV: "fast", "GPUSERV_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "gpuservd.daemon", "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 2 and SWITCH_INTERVAL_ENV in r.stderr, (r.returncode, r.stderr[-2000:])
