"""Run a request as another real user (uid/gid 65534, `nobody`) against a daemon's Unix socket.

We run as root, so `setpriv` can drop to a second uid for one child process. The child is a plain Python
with no project imports (the worktree need not be readable by that user): it speaks HTTP/1.1 over the
socket itself and prints one JSON line: the status and body, or the OS error that refused the connection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NOBODY = 65534

CHILD = r"""
import json, socket, sys
path, method, target, body, headers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
except OSError as exc:
    print(json.dumps({"error": type(exc).__name__, "errno": exc.errno, "uid": __import__("os").getuid()}))
    sys.exit(0)
head = f"{method} {target} HTTP/1.1\r\nHost: gpuserv\r\nConnection: close\r\nContent-Type: application/json\r\n"
head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + f"Content-Length: {len(body.encode())}\r\n\r\n"
s.sendall(head.encode() + body.encode())
data = b""
while chunk := s.recv(65536):
    data += chunk
status = int(data.split(b" ", 2)[1])
payload = data.split(b"\r\n\r\n", 1)[1]
if b"transfer-encoding: chunked" in data.split(b"\r\n\r\n", 1)[0].lower():  # de-chunk
    out, rest = b"", payload
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    payload = out
print(json.dumps({"status": status, "body": payload.decode(), "uid": __import__("os").getuid()}))
"""


def available() -> str | None:
    """None when a second uid can be used here, else why not."""
    if os.getuid() != 0:
        return "needs root (to drop to a second uid)"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    return None


def open_dir() -> Path:
    """A directory any user may traverse (pytest's own tmp dirs are 0700), for the socket."""
    d = Path(tempfile.mkdtemp(prefix="gpuserv-uid-", dir="/tmp"))
    d.chmod(0o755)
    return d


def request_as_nobody(socket_path: Path, method: str, target: str, body: dict | None = None,
                      headers: dict | None = None, timeout: float = 120) -> dict:
    """One HTTP request over the socket as uid/gid 65534; {"status", "body", "uid"} or {"error", "errno"}."""
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-I", "-c", CHILD,
           str(socket_path), method, target, json.dumps(body) if body is not None else "", json.dumps(headers or {})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"the second-uid child failed: {out.stderr}")
    return json.loads(out.stdout)
