#!/usr/bin/env python3
"""How much a running daemon's memory grows when a client sends requests naming huge bogus models.

    python scripts/bogus_names_rss.py [--socket PATH] [--count 200] [--name-mib 1] [--warm 20] [--json]

Sends --warm requests first (the allocator's first arenas and the connection settle), reads the
daemon's RSS, sends --count POST /v1/completions whose "model" is --name-mib MiB of "m", and reads the
RSS again. The daemon's pid comes from the socket itself (SO_PEERCRED of the connection), so it
measures whatever daemon listens there, run as any user, and needs read access to /proc/PID/status
(the same user, or root). Every answer is expected to be a 400 naming `model`; the status codes seen
are printed beside the RSS before, after and grown, in MiB.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuservd.bench.proc_tree import rss_bytes  # noqa: E402  (after the path: runs from a checkout)
from gpuservd.paths import client_socket_path  # noqa: E402


def daemon_pid(path: str) -> int:
    """The pid of the process listening on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid


def rss_mib(pid: int) -> float:
    return rss_bytes([pid]) / 2**20


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--socket", default=str(client_socket_path()))
    a.add_argument("--count", type=int, default=200)
    a.add_argument("--name-mib", type=float, default=1.0)
    a.add_argument("--warm", type=int, default=20)
    a.add_argument("--json", action="store_true", help="one JSON object instead of a line of text")
    args = a.parse_args()
    pid = daemon_pid(args.socket)
    name = "m" * int(args.name_mib * 1024 * 1024)
    codes: dict[int, int] = {}
    with httpx.Client(transport=httpx.HTTPTransport(uds=args.socket), base_url="http://gpuserv", timeout=120) as c:
        def burst(n: int) -> None:
            for _ in range(n):
                r = c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
                codes[r.status_code] = codes.get(r.status_code, 0) + 1

        burst(args.warm)
        before = rss_mib(pid)
        codes.clear()
        burst(args.count)
        after = rss_mib(pid)
    out = {"pid": pid, "requests": args.count, "name_mib": args.name_mib, "statuses": codes,
           "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1), "grown_mib": round(after - before, 1)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"daemon pid {pid}: {args.count} requests with {args.name_mib:g} MiB model names, statuses {codes}; "
              f"RSS {before:.1f} -> {after:.1f} MiB (grown {after - before:+.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
