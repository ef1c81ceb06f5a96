"""Files a hostile local user can plant or a mistake can hit: the runtime directory, the socket path,
imports through symlinks, damaged store entries, full disks. Each test runs the real daemon or the
real CLI; the other user's side runs as uid 65534 (tests/hostile.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cli_invoke import invoke  # noqa: E402
from daemon_harness import DaemonProcess, make_home  # noqa: E402
from hostile import NOBODY, as_user, open_dir, remove, require_root  # noqa: E402

from gpuservd.api.client import Client  # noqa: E402
from gpuservd.daemon.run import bind_unix  # noqa: E402
from gpuservd.errors import StoreCorrupt, UserError  # noqa: E402
from gpuservd.paths import daemon_socket_path  # noqa: E402
from gpuservd.store.layout import read_safetensors_header  # noqa: E402
from gpuservd.store.store import ModelStore  # noqa: E402


def _daemon_exits(tmp: Path, home: Path, **kw) -> tuple[int, str]:
    d = DaemonProcess(tmp, home, notify=False, **kw)
    try:
        code = d.proc.wait(60)
    finally:
        d.stop()
    return code, d.log


@pytest.fixture()
def home(tmp_path, tiny_model_dir) -> Path:
    return make_home(tmp_path, tiny_model_dir)


def test_runtime_dir_planted_by_another_user_is_refused(tmp_path, home, monkeypatch):
    require_root()
    xdg = open_dir("gs-xdg-")
    try:
        xdg.chmod(0o1777)  # like /tmp: anyone may create entries

        def plant():  # the other user gets there first, with a socket of their own inside
            d = xdg / "gpuserv"
            d.mkdir()
            d.chmod(0o777)
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(d / "gpuserv.sock"))
            return os.lstat(d / "gpuserv.sock").st_ino

        inode = as_user(plant)
        code, log = _daemon_exits(tmp_path, home, socket_path=False, env={"XDG_RUNTIME_DIR": str(xdg)})
        assert code == 2, log
        assert "belongs to uid 65534" in log and "Traceback" not in log
        assert os.lstat(xdg / "gpuserv" / "gpuserv.sock").st_ino == inode  # theirs, untouched
        # A client does not send its prompt there either.
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        monkeypatch.delenv("GPUSERV_SOCKET", raising=False)
        with pytest.raises(UserError, match="belongs to uid 65534"):
            Client()
    finally:
        remove(xdg)


VICTIM = 4343  # a uid with no account here: the user whose default runtime directory is planted


def test_default_tmp_runtime_dir_planted_by_another_user_is_refused():
    """Without XDG_RUNTIME_DIR the socket lives in /tmp/gpuserv-UID, a name anyone can predict and make
    first. Here uid 65534 owns that directory (mode 0777) with a live socket inside; the victim, a real
    second uid, neither listens there nor sends its prompt there."""
    require_root()
    planted = Path(f"/tmp/gpuserv-{VICTIM}")
    remove(planted)
    planted.mkdir()
    trap = socket.socket(socket.AF_UNIX)
    try:
        trap.bind(str(planted / "gpuserv.sock"))
        trap.listen(8)
        trap.setblocking(False)
        for p in (planted, planted / "gpuserv.sock"):
            os.chmod(p, 0o777)
            os.chown(p, NOBODY, NOBODY)

        def victim():
            for var in ("XDG_RUNTIME_DIR", "GPUSERV_SOCKET", "RUNTIME_DIRECTORY"):
                os.environ.pop(var, None)
            path = daemon_socket_path()

            def ask():
                with Client() as c:
                    c.request("POST", "/v1/completions", {"model": "tiny", "prompt": "my secret"}, timeout=2)

            answers = [str(path)]
            for attempt in (lambda: bind_unix(path, 0o600, None, 8), ask):
                try:
                    attempt()
                    answers.append("accepted")
                except UserError as exc:
                    answers.append(str(exc))
                except Exception as exc:  # noqa: BLE001 - e.g. the trap never answering
                    answers.append(f"went ahead: {type(exc).__name__}")
            return answers

        where, daemon_says, client_says = as_user(victim, VICTIM, VICTIM)
        assert where == str(planted / "gpuserv.sock")
        for said in (daemon_says, client_says):
            assert f"{planted} belongs to uid 65534, not to you (uid {VICTIM})" in said, said
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody connected to the planted socket
    finally:
        trap.close()
        remove(planted)


def test_runtime_dir_is_made_private_and_a_writable_one_refused(tmp_path, home):
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    d = DaemonProcess(tmp_path, home, socket_path=False, env={"XDG_RUNTIME_DIR": str(xdg)})
    try:
        d.notify.wait_for("READY=1", 90)
        assert stat.S_IMODE(os.stat(xdg / "gpuserv").st_mode) == 0o700
    finally:
        assert d.stop() == 0
    (xdg / "gpuserv").chmod(0o777)
    code, log = _daemon_exits(tmp_path, home, socket_path=False, env={"XDG_RUNTIME_DIR": str(xdg)})
    assert code == 2 and "chmod 700" in log and "writable by others" in log, log


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_socket_path_that_is_not_a_socket_is_never_replaced(tmp_path, home, kind):
    target = tmp_path / "precious"
    if kind == "file":
        target.write_text("someone's data")
    else:
        target.mkdir()
        (target / "inside").write_text("x")
    code, log = _daemon_exits(tmp_path, home, socket_path=target)
    assert code == 2
    assert f"it exists and is {'a directory' if kind == 'directory' else 'a file that is not a socket'}" in log
    assert "Traceback" not in log
    assert [line for line in log.splitlines() if "error" in line.lower()] == \
        [line for line in log.splitlines() if line.startswith("gpuservd: error:")]
    if kind == "file":
        assert target.read_text() == "someone's data"
    else:
        assert (target / "inside").read_text() == "x"


@pytest.fixture()
def src(tmp_path, tiny_model_dir) -> Path:
    s = tmp_path / "src"
    shutil.copytree(tiny_model_dir, s)
    return s


def test_import_refuses_a_symlink_out_of_the_source(tmp_path, src, monkeypatch, capsys):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    secret = tmp_path / "shadow"
    secret.write_text("root:TOPSECRET")
    secret.chmod(0o600)
    (src / "README.md").symlink_to(secret)
    assert invoke("models", "import", str(src), "--name", "evil") == 2
    err = capsys.readouterr().err
    assert "README.md is a symlink to" in err and "outside" in err and len(err.strip().splitlines()) == 1
    store = ModelStore()
    assert store.names() == []
    assert not any("TOPSECRET" in p.read_text(errors="replace") for p in store.root.rglob("*") if p.is_file())


def test_import_copies_links_inside_and_never_widens_modes(tmp_path, src, monkeypatch):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    (src / "notes.txt").write_text("private notes")
    (src / "notes.txt").chmod(0o600)
    (src / "alias.json").symlink_to(src / "config.json")
    (src / "script.sh").write_text("#!/bin/sh\n")
    (src / "script.sh").chmod(0o755)
    info = ModelStore().import_dir(src, "ok")
    out = Path(info.path)
    assert stat.S_IMODE((out / "notes.txt").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "script.sh").stat().st_mode) <= 0o755
    assert not (out / "alias.json").is_symlink()
    assert (out / "alias.json").read_text() == (src / "config.json").read_text()


def _hand_placed(store_root: Path, src: Path, name: str, **config_changes) -> Path:
    entry = store_root / name
    shutil.copytree(src, entry)
    cfg = json.loads((entry / "config.json").read_text())
    cfg.update(config_changes)
    (entry / "config.json").write_text(json.dumps(cfg))
    return entry


def test_one_bad_config_does_not_break_models_ls(tmp_path, src, monkeypatch, capsys):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    store = ModelStore()
    store.import_dir(src, "good")
    _hand_placed(store.root, src, "bad", num_hidden_layers="abc")
    assert invoke("models", "ls", "--json") == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["good"]["error"] is None
    assert "num_hidden_layers must be an integer" in rows["bad"]["error"]
    assert invoke("models", "ls") == 0
    assert "DAMAGED" in capsys.readouterr().out


def test_config_sizes_are_bounded_before_anything_is_allocated(tmp_path, src, monkeypatch):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    store = ModelStore()
    store.root.mkdir(parents=True)
    _hand_placed(store.root, src, "huge", num_hidden_layers=1e8)
    with pytest.raises(StoreCorrupt, match=r"num_hidden_layers = 100000000 is out of bounds"):
        store.check("huge")
    from gpuservd.config import EngineConfig
    from gpuservd.runner.model_config import load_arch

    with pytest.raises(StoreCorrupt, match="num_hidden_layers"):  # the runner's own read, too
        load_arch(store.root / "huge")
    from gpuservd.engine.engine import LLMEngine

    with pytest.raises(StoreCorrupt, match="num_hidden_layers"):
        LLMEngine(  # straight to the runner, no store check in front: still refused before allocating
            "huge", store.root / "huge", EngineConfig(model="huge", kv_cache_bytes=1 << 20, num_threads=1))


def _safetensors(path: Path, entries: dict, data: bytes) -> None:
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("offsets,shape,why", [
    ([-8, 8], [4], "negative or reversed"),
    ([8, 0], [4], "negative or reversed"),
    ([0, 2 ** 64 + 16], [4], "needs 16 bytes but data_offsets span"),
    ([0, 16], [-4], "non-negative"),
    ([16, 32], [4], "past the file"),
    ([0, 8], [4], "needs 16 bytes"),
])
def test_check_validates_safetensors_offsets(tmp_path, offsets, shape, why):
    f = tmp_path / "model.safetensors"
    _safetensors(f, {"w": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}, b"\0" * 16)
    with pytest.raises(StoreCorrupt, match=why):
        read_safetensors_header(f)


def test_models_show_reports_bad_offsets_as_damaged(tmp_path, src, monkeypatch, capsys):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path / "home"))
    store = ModelStore()
    store.import_dir(src, "tiny")
    shard = store.root / "tiny" / "model.safetensors"
    raw = shard.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [-4, end - begin - 4]  # negative, same span
    new = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(new) == size
    shard.write_bytes(raw[:8] + new + raw[8 + size:])
    assert invoke("models", "show", "tiny", "--json") == 0
    assert "negative or reversed" in json.loads(capsys.readouterr().out)["check"]


def test_a_full_disk_is_one_line(tmp_path, src, capsys, monkeypatch):
    require_root()
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        monkeypatch.setenv("GPUSERV_HOME", str(mnt))
        assert invoke("models", "import", str(src), "--name", "tiny") == 2
        err = capsys.readouterr().err.strip()
        assert "No space left on device" in err and "nothing was published" in err
        assert len(err.splitlines()) == 1, err
        assert [p.name for p in (mnt / "models").iterdir()] == []  # no half model, no temp dir
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_store_the_user_may_not_write_is_one_line(tmp_path, src):
    require_root()
    shared = open_dir("gs-perm-")
    try:
        shutil.copytree(src, shared / "src")
        (shared / "src").chmod(0o755)
        for p in (shared / "src").rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (shared / "home" / "models").mkdir(parents=True)  # root's, 0755: nobody may not write it
        env = {**os.environ, "GPUSERV_HOME": str(shared / "home"), "PYTHONPATH": str(Path(__file__).parents[1])}
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                            "gpuservd.cli.main", "models", "import", str(shared / "src"), "--name", "x"],
                           env=env, capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 2, r.stderr
        assert "Permission denied" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        remove(shared)
