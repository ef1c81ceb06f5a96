"""CPU seconds per streamed token, from two /admin/status readings around a run (`process`, see
gpuservd/serving/cpu_time.py) and the client's own process time.

Measured every socket run: on a shared machine these stay comparable between runs where wall-clock
throughput does not, and they say where the CPU went: the engine's math, the daemon's serving path
(its event loop: HTTP, SSE framing, admission) or the client that reads the streams (which shares
the machine with the daemon it measures).
"""

from __future__ import annotations


def cpu_per_token(before: dict, after: dict, tokens: int, client_cpu_s: float | None = None) -> dict:
    """`before`/`after`: /admin/status bodies; tokens: the tokens streamed between them. Keys are
    None when the daemon reports no `process` section (an older daemon)."""
    b, a = before.get("process"), after.get("process")
    if not b or not a or tokens <= 0:
        return {"daemon_cpu_s_per_token": None, "daemon_loop_cpu_s_per_token": None,
                "client_cpu_s_per_token": None, "daemon_cpu_s": None}
    daemon = (a["cpu_s"] - b["cpu_s"]) + (a.get("workers_cpu_s", 0.0) - b.get("workers_cpu_s", 0.0))
    loop = a["loop_cpu_s"] - b["loop_cpu_s"]
    return {"daemon_cpu_s_per_token": round(daemon / tokens, 7),
            "daemon_loop_cpu_s_per_token": round(loop / tokens, 7),
            "client_cpu_s_per_token": None if client_cpu_s is None else round(client_cpu_s / tokens, 7),
            "daemon_cpu_s": round(daemon, 3)}
