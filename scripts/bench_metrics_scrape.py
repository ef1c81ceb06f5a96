#!/usr/bin/env python3
"""How long GET /metrics takes on a daemon that is serving, scraped the way an endpoint picker scrapes it.

    python scripts/bench_metrics_scrape.py [--socket PATH | --url http://box:8400] [--token-file F]
                                           [--models a,b] [--rate 20] [--seconds 20] [--clients 4]
                                           [--max-tokens 64] [--scraper raw|httpx] [--idle-scrapes 200]
                                           [--out DIR]

--clients streaming completions run back to back, spread over --models (default: every model the daemon
lists), while one scraper GETs /metrics --rate times a second for --seconds. Reports P50/P99/max of the
scrape latency (request sent -> body read), the body's size and series count, the scrapes that failed,
and the tokens the clients received meanwhile. Each scrape is followed by a GET /health, timed the same
way: the HTTP round trip without the rendering, i.e. what the machine and the event loop cost by
themselves. Writes result.json under --out when given.

It starts only once every model in --models is ready and has answered one request (a model still
loading would take the CPU and leave its clients waiting inside the measured window). The streaming
clients run in a process of their own, so that their parsing does not hold the scraper's GIL and add to
the latencies it times; tokens are counted from the token ids each chunk carries (a chunk may carry
several). The daemon's CPU over the window (/admin/status `process`) is reported per token received.

--scraper raw (the default) scrapes over one keep-alive HTTP/1.1 connection with a plain socket, as an
endpoint picker's Go client does; --scraper httpx uses httpx, whose own Python (about 1.5 ms a scrape on
a 2-core box under load) is then inside every latency. Before the streams start, --idle-scrapes
back-to-back GETs of /metrics and of /health are counted against the daemon's event-loop CPU
(/admin/status `process.loop_cpu_s`): what one scrape costs the loop, in CPU time, which a loaded
machine does not distort the way it distorts wall time.

`decomposition` splits the slowest 5% of the scrapes (and all of them) into the event loop thread's wait
for a core (its schedstat run delay over the scrape: the daemon's pid comes from the Unix socket's peer),
its CPU, the render's CPU (the response's Server-Timing header) and the rest, when the thread was asleep:
waiting for the GIL. `rendered_ahead_share`: the scrapes the daemon answered with a body it had rendered
ahead (its Server-Timing `age`; server.metrics_max_age_ms), with those bodies' mean and largest age.
`slowest`: the ten slowest scrapes one by one (their index in the run, parts in ms, the body's age when it
was rendered ahead), to tell a few scrapes that rendered from many that waited.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuservd.paths import client_socket_path  # noqa: E402  (after the path: runs from a checkout)


def _client(args) -> httpx.Client:
    headers = {}
    if args.token_file:
        headers["Authorization"] = f"Bearer {Path(args.token_file).read_text().strip()}"
    if args.url:
        return httpx.Client(base_url=args.url, headers=headers, timeout=30)
    sock = args.socket or client_socket_path()
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://gpuserv", headers=headers,
                        timeout=30)


class RawScraper:
    """GET over one keep-alive HTTP/1.1 connection (Unix socket or TCP), reading Content-Length bodies."""

    def __init__(self, args):
        self.token = Path(args.token_file).read_text().strip() if args.token_file else None
        if args.url:
            u = urlsplit(args.url)
            self.sock = socket.create_connection((u.hostname, u.port or 80))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(str(args.socket or client_socket_path()))

    def get(self, path: str) -> tuple[int, bytes]:
        auth = f"authorization: Bearer {self.token}\r\n" if self.token else ""
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nhost: gpuserv\r\n{auth}\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        self.headers = {k.strip().lower().decode(): v.strip().decode()
                        for k, _, v in (line.partition(b":") for line in lines[1:])}
        length = int(self.headers["content-length"])
        while len(body) < length:
            body += self.sock.recv(max(65536, length - len(body)))
        return int(lines[0].split()[1]), body

    def peer_pid(self) -> int | None:
        """The daemon's pid when it is on this machine (a Unix socket), for its event loop's schedstat."""
        if self.sock.family != socket.AF_UNIX:
            return None
        cred = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", cred)[0] or None

    def close(self) -> None:
        self.sock.close()


class HttpxScraper:
    def __init__(self, args):
        self.client = _client(args)
        self.headers = {}

    def get(self, path: str) -> tuple[int, bytes]:
        r = self.client.get(path)
        self.headers = r.headers
        return r.status_code, r.content

    def peer_pid(self) -> int | None:
        return None

    def close(self) -> None:
        self.client.close()


def _idle_cost(args, scraper) -> dict:
    """The daemon event loop's CPU per /metrics and per /health, back to back before the streams start."""
    out = {}
    with _client(args) as c:
        for path in ("/metrics", "/health"):
            before = _cpu(c).get("loop_cpu_s")
            for _ in range(args.idle_scrapes):
                scraper.get(path)
            after = _cpu(c).get("loop_cpu_s")
            if before is not None and after is not None:
                out[f"idle_{path[1:]}_loop_cpu_ms"] = round((after - before) * 1e3 / args.idle_scrapes, 3)
    return out


def _serve(args, model: str, stop, tokens) -> None:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "stream": True,
            "max_tokens": args.max_tokens, "ignore_eos": True, "return_token_ids": True}
    with _client(args) as c:
        while not stop.is_set():
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        n = sum(len(ch.get("token_ids") or []) for ch in json.loads(line[6:]).get("choices", []))
                        with tokens.get_lock():
                            tokens.value += n


def _streams(args, models: list[str], stop, tokens) -> None:
    """The streaming clients (a process of their own): --clients threads until `stop` is set."""
    workers = [threading.Thread(target=_serve, args=(args, models[i % len(models)], stop, tokens), daemon=True)
               for i in range(args.clients)]
    for w in workers:
        w.start()
    stop.wait()


def _wait_ready(args, models: list[str], timeout_s: float = 300.0) -> None:
    """Every model listed as ready, and each has answered one short request (its first-call costs paid)."""
    with _client(args) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if set(models) <= {m["id"] for m in c.get("/v1/models").json()["data"]}:
                    break
            except httpx.TransportError:  # the daemon is still starting
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"models not ready after {timeout_s:.0f} s: {models}")
            time.sleep(0.5)
        for m in models:
            c.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 2}).raise_for_status()


def _schedstat(pid: int | None) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for a CPU) of the daemon's main thread, which runs its event loop."""
    if pid is None:
        return None
    try:
        run, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run), int(wait)


def _server_timing(headers) -> dict[str, float]:
    """`render;dur=1.2, render-cpu;dur=1.0` -> {"render": 1.2, "render-cpu": 1.0} (ms)."""
    out = {}
    for item in (headers.get("server-timing") or "").split(","):
        name, _, params = item.strip().partition(";")
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "dur":
                out[name] = float(v)
    return out


def _decompose(rows: list[dict]) -> dict:
    """Where the slowest 5% of the scrapes (and all of them) spent their time, means in ms. `loop_runq`: the
    event loop's thread runnable but waiting for a core (wake-up delay, preemption); `loop_cpu_other`: its
    CPU besides the render (HTTP parsing and writing, and whatever else the loop ran meanwhile); `render_cpu`;
    `rest`: the thread neither running nor runnable (asleep: waiting for the GIL) plus the kernel's and the
    scraper's share. `render_off_cpu` (inside the others): the render's wall above its CPU."""
    rows = [r for r in rows if "runq" in r and "render" in r]
    if not rows:
        return {}
    rows.sort(key=lambda r: r["e2e"])
    out = {}
    for label, part in (("slowest5pct", rows[int(0.95 * len(rows)):]), ("all", rows)):
        def mean(f):
            return round(statistics.fmean(f(r) for r in part), 3)
        out[label] = {"scrapes": len(part), "e2e_ms": mean(lambda r: r["e2e"]),
                      "loop_runq_ms": mean(lambda r: r["runq"]), "render_cpu_ms": mean(lambda r: r["render_cpu"]),
                      "loop_cpu_other_ms": mean(lambda r: max(0.0, r["loop_cpu"] - r["render_cpu"])),
                      "rest_ms": mean(lambda r: max(0.0, r["e2e"] - r["runq"] - max(r["loop_cpu"], r["render_cpu"]))),
                      "render_off_cpu_ms": mean(lambda r: max(0.0, r["render"] - r["render_cpu"]))}
    return out


def _ahead(rows: list[dict]) -> dict:
    """The share of the scrapes answered with a body rendered ahead, and those bodies' mean and max age (ms)."""
    ages = [r["age"] for r in rows if "age" in r]
    if not rows or not ages:
        return {"rendered_ahead_share": 0.0}
    return {"rendered_ahead_share": round(len(ages) / len(rows), 3), "rendered_ahead_age_mean_ms":
            round(statistics.fmean(ages), 3), "rendered_ahead_age_max_ms": round(max(ages), 3)}


def _slowest(rows: list[dict], n: int = 10) -> list[dict]:
    """The n slowest scrapes, each with its parts (ms, rounded)."""
    return [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
            for r in sorted(rows, key=lambda r: r["e2e"], reverse=True)[:n]]


def _cpu(c) -> dict:
    return c.get("/admin/status").json().get("process") or {}


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--socket", default=None)
    a.add_argument("--url", default=None)
    a.add_argument("--token-file", default=None)
    a.add_argument("--models", default="")
    a.add_argument("--rate", type=float, default=20.0)
    a.add_argument("--seconds", type=float, default=20.0)
    a.add_argument("--clients", type=int, default=4)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--scraper", choices=("raw", "httpx"), default="raw")
    a.add_argument("--idle-scrapes", type=int, default=200, help="back-to-back scrapes for the CPU cost (0: none)")
    a.add_argument("--out", type=Path, default=None)
    args = a.parse_args()
    models = [m for m in args.models.split(",") if m]
    if not models:
        with _client(args) as c:
            models = [m["id"] for m in c.get("/v1/models").json()["data"]]
    if not models:
        print("the daemon serves no model", file=sys.stderr)
        return 2
    _wait_ready(args, models)
    scraper = RawScraper(args) if args.scraper == "raw" else HttpxScraper(args)
    idle = _idle_cost(args, scraper) if args.idle_scrapes > 0 else {}
    ctx = multiprocessing.get_context("spawn")
    stop, tokens = ctx.Event(), ctx.Value("q", 0)
    streams = ctx.Process(target=_streams, args=(args, models, stop, tokens), daemon=True)
    streams.start()
    time.sleep(2.0)  # the streams are under way before the first scrape
    latencies, health, failed, size, series, parts = [], [], 0, 0, 0, []
    pid = scraper.peer_pid()
    with _client(args) as c:
        cpu_before = _cpu(c)
        period, t_next, end = 1.0 / args.rate, time.monotonic(), time.monotonic() + args.seconds
        start_tokens = tokens.value
        while time.monotonic() < end:
            s0 = _schedstat(pid)
            t0 = time.perf_counter()
            status, body = scraper.get("/metrics")
            latencies.append(time.perf_counter() - t0)
            s1 = _schedstat(pid)
            row = {"i": len(parts), "e2e": latencies[-1] * 1e3}
            timing = _server_timing(scraper.headers)
            if "render" in timing and "render-cpu" in timing:
                row.update(render=timing["render"], render_cpu=timing["render-cpu"])
            if "age" in timing:  # the body was rendered ahead that long ago (the daemon's scrape cache)
                row["age"] = timing["age"]
            if s0 and s1:
                row.update(loop_cpu=(s1[0] - s0[0]) / 1e6, runq=(s1[1] - s0[1]) / 1e6)
            parts.append(row)
            if status != 200:
                failed += 1
            size = len(body)
            series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
            t0 = time.perf_counter()
            scraper.get("/health")
            health.append(time.perf_counter() - t0)
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))
        received = tokens.value - start_tokens
        cpu_after = _cpu(c)
    scraper.close()
    stop.set()
    streams.join(10)
    ms, hs = sorted(x * 1000 for x in latencies), sorted(x * 1000 for x in health)

    def p99(xs):
        return round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)

    result = {"models": models, "scraper": args.scraper, "scrapes": len(ms), "failed": failed, "rate_per_s": args.rate,
              "p50_ms": round(statistics.median(ms), 3), "p99_ms": p99(ms), "max_ms": round(ms[-1], 3),
              "health_p50_ms": round(statistics.median(hs), 3), "health_p99_ms": p99(hs),
              "body_bytes": size, "series": series, "clients": args.clients,
              "tokens_per_s_meanwhile": round(received / args.seconds, 1), **idle,
              "decomposition": _decompose(parts), **_ahead(parts), "slowest": _slowest(parts)}
    if cpu_before and cpu_after and received:
        for key in ("cpu_s", "loop_cpu_s"):
            result[f"daemon_{key}_per_token"] = round((cpu_after[key] - cpu_before[key]) / received, 6)
        result["daemon_loop_cpu_share"] = round((cpu_after["loop_cpu_s"] - cpu_before["loop_cpu_s"]) / args.seconds, 4)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
