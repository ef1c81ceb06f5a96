#!/usr/bin/env python3
"""Bounded load test: N concurrent streaming clients on the daemon's Unix socket for D seconds.

    scripts/loadtest.py --tiny                      # build the tiny test model, start a daemon on it, 200 x 60 s
    scripts/loadtest.py --spawn --model smollm2     # start a daemon on a store model
    scripts/loadtest.py --socket /run/gpuserv/gpuserv.sock --model smollm2   # an already running daemon

Every client loops until the deadline: a streaming chat or completion request
with lengths drawn from skewed distributions (real workloads, never fixed lengths); some
clients hang up mid-stream on purpose (cancellation is part of the load). A
429 is intended admission control: the client waits Retry-After (capped) and
goes on. Anything else that is not a complete stream ending in `data: [DONE]`
is an error, counted by kind. At the end: the daemon's RSS growth over the
measured window (after a warm-up under the same load, so allocator and kernel
caches are full) and whether every KV block is free again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the capital of france is paris and the capital of italy is rome a quick brown fox jumps over the lazy "
         "dog while the cat sleeps serving many models on one card keeps tail latency flat under mixed traffic").split()


class Stats:
    def __init__(self):
        self.outcomes: Counter = Counter()  # ok, cancelled_by_client, http_429, http_503, errors by kind
        self.errors: list[str] = []  # first few error details
        self.ttft: list[float] = []
        self.tokens = 0

    def error(self, kind: str, detail: str) -> None:
        self.outcomes[kind] += 1
        if len(self.errors) < 20:
            self.errors.append(f"{kind}: {detail}")


def lengths(rng: random.Random, max_len: int) -> tuple[int, int]:
    """(prompt words, output tokens): lognormal, long-tailed, within the context."""
    # a word is up to ~3 tokens for a small vocabulary: keep prompt + output inside the context
    prompt = min(max(1, int(rng.lognormvariate(3.0, 0.8))), max_len // 8)
    out = min(max(1, int(rng.lognormvariate(3.2, 0.9))), max_len // 2)
    return prompt, out


async def client_loop(i: int, c: httpx.AsyncClient, model: str, deadline: float, stats: Stats, max_len: int,
                      hangup_rate: float) -> None:
    rng = random.Random(i)
    while time.monotonic() < deadline:
        n_words, out = lengths(rng, max_len)
        text = " ".join(rng.choice(WORDS) for _ in range(n_words))
        chat = rng.random() < 0.6
        body = {"model": model, "max_tokens": out, "stream": True, "stream_options": {"include_usage": True},
                "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(1 << 30)}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        hang_up_after = rng.randrange(1, 5) if rng.random() < hangup_rate else None
        t0 = time.monotonic()
        try:
            async with c.stream("POST", path, json=body) as r:
                if r.status_code == 429:
                    await r.aread()
                    stats.outcomes["http_429"] += 1
                    await asyncio.sleep(min(2.0, float(r.headers.get("retry-after", "1"))) * rng.uniform(0.5, 1.0))
                    continue
                if r.status_code != 200:
                    stats.error(f"http_{r.status_code}", (await r.aread()).decode(errors="replace")[:200])
                    continue
                chunks, done, usage, first = 0, False, None, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        stats.error("stream_error_event", str(chunk["error"])[:200])
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("choices"):
                        chunks += 1
                        if first is None:
                            first = time.monotonic() - t0
                    if hang_up_after is not None and chunks >= hang_up_after:
                        break
                if hang_up_after is not None and not done:
                    stats.outcomes["cancelled_by_client"] += 1
                    continue
                if not done or usage is None:
                    stats.error("incomplete_stream", f"chunks={chunks} done={done} usage={usage}")
                    continue
                stats.outcomes["ok"] += 1
                stats.tokens += usage["completion_tokens"]
                if first is not None:
                    stats.ttft.append(first)
        except httpx.HTTPError as exc:
            stats.error(type(exc).__name__, str(exc)[:200])
        except json.JSONDecodeError as exc:
            stats.error("bad_json", str(exc)[:200])


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def run(sock: Path, model: str, clients: int, duration: float, warmup: float, hangup_rate: float) -> dict:
    transport = httpx.AsyncHTTPTransport(uds=str(sock))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(transport=transport, base_url="http://gpuserv", timeout=httpx.Timeout(120.0),
                                 limits=limits) as c:
        status = (await c.get("/admin/status")).json()
        pid = status["pid"]
        m = next(x for x in status["models"] if x["name"] == model)
        rss_start = rss_bytes(pid)
        stats = Stats()
        start = time.monotonic()
        deadline = start + warmup + duration
        tasks = [asyncio.ensure_future(client_loop(i, c, model, deadline, stats, m["max_model_len"], hangup_rate))
                 for i in range(clients)]
        # Warm-up: the same load, outside the measured window, so that allocator and kernel caches
        # (every batch shape seen once) are filled before the RSS baseline is taken.
        await asyncio.sleep(warmup)
        rss_warm = rss_bytes(pid)
        ok_at_warm, tokens_at_warm = stats.outcomes["ok"], stats.tokens
        samples = []
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            samples.append(rss_bytes(pid))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - start - warmup
        # the daemon has answered everything; give aborts one moment to land, then look at the pool
        end_status = None
        for _ in range(50):
            end_status = (await c.get("/admin/status")).json()
            if end_status["num_in_flight"] == 0 and all(x["kv_blocks_free"] == x["kv_blocks_total"]
                                                         for x in end_status["models"]):
                break
            await asyncio.sleep(0.1)
        rss_end = rss_bytes(pid)
    me = next(x for x in end_status["models"] if x["name"] == model)
    errors = {k: v for k, v in stats.outcomes.items() if k not in ("ok", "http_429", "cancelled_by_client")}
    ttft = sorted(stats.ttft)
    return {
        "model": model, "clients": clients, "warmup_s": warmup, "duration_s": round(wall, 1),
        "requests_ok": stats.outcomes["ok"], "cancelled_by_client": stats.outcomes["cancelled_by_client"],
        "http_429": stats.outcomes["http_429"], "errors": errors, "error_samples": stats.errors,
        "tokens": stats.tokens,
        "tokens_per_s_after_warmup": round((stats.tokens - tokens_at_warm) / wall, 1),
        "requests_ok_after_warmup": stats.outcomes["ok"] - ok_at_warm,
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[int(0.99 * (len(ttft) - 1))], 3) if ttft else None,
        "rss_start_mb": round(rss_start / 1e6, 1), "rss_after_warmup_mb": round(rss_warm / 1e6, 1),
        "rss_max_mb": round(max(samples + [rss_end]) / 1e6, 1), "rss_end_mb": round(rss_end / 1e6, 1),
        "rss_growth_after_warmup_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "rss_every_5s_mb": [round(x / 1e6) for x in samples[4::5]],
        "kv_blocks_free_end": me["kv_blocks_free"], "kv_blocks_total": me["kv_blocks_total"],
        "in_flight_end": end_status["num_in_flight"], "rejected_total": end_status["num_rejected_total"],
    }


def spawn_daemon(tmp: Path, model: str, home: str | None, config: Path | None, tiny: bool,
                 log_path: Path | None) -> tuple:
    env = dict(os.environ)
    if tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from factories import make_model_dir

        from gpuservd.store.store import ModelStore

        env["GPUSERV_HOME"] = str(tmp / "home")
        ModelStore(tmp / "home" / "models").import_dir(make_model_dir(tmp / "tiny-src"), "tiny")
    elif home:
        env["GPUSERV_HOME"] = home
    sock = tmp / "gpuserv.sock"
    cmd = [sys.executable, "-m", "gpuservd.daemon", "--socket", str(sock), "--model", model, "--log-level", "warning"]
    if config:
        cmd += ["--config", str(config)]
    log_path = log_path or tmp / "daemon.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(["nice", "-n", "19"] + cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))).get("http://d/ready").status_code == 200:
                return proc, sock
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("daemon not ready after 300 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", type=Path, help="a running daemon's socket")
    p.add_argument("--spawn", action="store_true", help="start a daemon for the test (and stop it after)")
    p.add_argument("--tiny", action="store_true", help="--spawn on the tiny random test model (no download)")
    p.add_argument("--home", help="GPUSERV_HOME for --spawn (default: the usual)")
    p.add_argument("--config", type=Path, help="daemon config for --spawn")
    p.add_argument("--model", default=None, help="model name (default: tiny with --tiny, else smollm2)")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured (after the warm-up)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of the same load before the RSS baseline")
    p.add_argument("--hangup-rate", type=float, default=0.05, help="share of requests the client abandons")
    p.add_argument("--daemon-log", type=Path, help="with --spawn: keep the daemon's log in this file")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    a = p.parse_args()
    model = a.model or ("tiny" if a.tiny else "smollm2")
    proc = None
    with tempfile.TemporaryDirectory(prefix="gpuserv-load-") as tmp:
        if a.spawn or a.tiny:
            proc, sock = spawn_daemon(Path(tmp), model, a.home, a.config, a.tiny, a.daemon_log)
        else:
            from gpuservd.paths import client_socket_path

            sock = a.socket or client_socket_path()
        try:
            result = asyncio.run(run(sock, model, a.clients, a.duration, a.warmup, a.hangup_rate))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                result_code = proc.wait(60)
        if proc is not None:
            result["daemon_exit_code"] = result_code
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(json.dumps(result, indent=2))
    clean = (not result["errors"] and result["kv_blocks_free_end"] == result["kv_blocks_total"]
             and result["rss_growth_after_warmup_pct"] < 5.0)
    print("PASS" if clean else "FAIL", "- errors:", result["errors"] or "none", "| 429s:", result["http_429"],
          "| RSS growth after warm-up:", f"{result['rss_growth_after_warmup_pct']}%",
          "| KV free at end:", f"{result['kv_blocks_free_end']}/{result['kv_blocks_total']}")
    sys.exit(0 if clean else 1)


if __name__ == "__main__":
    main()
