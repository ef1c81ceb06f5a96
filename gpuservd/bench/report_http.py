"""The report's part for the HTTP targets: gpuserv through HTTP against each peer's own server.

result.json gets `ratios_http` (gpuserv[http] / peer, computed like `ratios`),
`http_inprocess` (gpuserv through HTTP against gpuserv in-process, same run),
and `skipped` (peer -> why it did not run). result.md gets a table of every
HTTP target with the server's peak RSS and CPU per token (its whole process tree, and of that its front
process: gpuserv's daemon without its engine worker, vLLM's API server), the ratios, a line per
skipped peer, and a warning for any system whose outputs were not exactly the
lengths asked (its numbers do not compare).
"""

from __future__ import annotations

HTTP_OURS = "gpuserv[http]"


def _tps(s: dict | None):
    return (s or {}).get("throughput_tok_s")


def http_vs_inprocess(systems: dict) -> dict:
    """gpuserv[http]'s throughput and latency against the in-process gpuserv run ({} without both)."""
    http, inproc = systems.get(HTTP_OURS), systems.get("gpuserv")
    if not http or not inproc or not _tps(inproc):
        return {}
    return {"throughput_ratio": _tps(http) / _tps(inproc), "http_tok_s": _tps(http), "inprocess_tok_s": _tps(inproc),
            "http_server_cpu_ms_per_token": http["extra"].get("server_cpu_ms_per_token"),
            "http_daemon_cpu_ms_per_token": http["extra"].get("front_cpu_ms_per_token"),
            "http_client_cpu_ms_per_token": http["extra"].get("client_cpu_ms_per_token")}


def _fmt(x, spec="{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def _p99(s: dict, cls: str) -> str:
    return _fmt(((s["latency_s"].get(cls) or {}).get("p99")))


def http_lines(result: dict) -> list[str]:
    """Markdown for the HTTP targets, the skipped peers and any wrong-length outputs."""
    systems = result["systems"]
    http = {n: s for n, s in systems.items() if s["extra"].get("target") == "http"}
    lines: list[str] = []
    classes = result["classes"]
    if http:
        head = ["through HTTP", "tok/s"] + [f"{c} p99 s" for c in classes] + [
            "ttft p50 s", "peak RSS MiB", "server CPU ms/token", "front process CPU ms/token", "version"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, s in http.items():
            e = s["extra"]
            cells = [name, _fmt(s["throughput_tok_s"], "{:.1f}")] + [_p99(s, c) for c in classes] + [
                _fmt((s["ttft_s"].get("all") or {}).get("p50")), _fmt(e.get("peak_rss_mib"), "{:.0f}"),
                _fmt(e.get("server_cpu_ms_per_token"), "{:.2f}"), _fmt(e.get("front_cpu_ms_per_token"), "{:.3f}"),
                str(e.get("version", "-"))]
            lines.append("| " + " | ".join(cells) + " |")
        for peer, r in (result.get("ratios_http") or {}).items():
            if peer in http:
                p99 = ", ".join(f"{c} p99 {_fmt(r['latency_p99'].get(c), '{:.2f}x')}" for c in classes)
                lines.append(f"- {HTTP_OURS} / {peer}: {_fmt(r['throughput'], '{:.2f}x')} tok/s; {p99}")
        hi = result.get("http_inprocess") or {}
        if hi:
            lines.append(f"- {HTTP_OURS} / gpuserv in-process: {_fmt(hi['throughput_ratio'], '{:.3f}x')} tok/s; "
                         f"the bench's client took {_fmt(hi.get('http_client_cpu_ms_per_token'), '{:.3f}')} ms "
                         "of CPU per token beside the server; the daemon's own process (its serving path, without "
                         f"an engine worker) {_fmt(hi.get('http_daemon_cpu_ms_per_token'), '{:.3f}')} ms")
        for name, s in http.items():
            lines.append(f"- {name}: `{s['extra'].get('command', '')}`")
    for name, reason in (result.get("skipped") or {}).items():
        lines.append(f"- {name}: SKIPPED: {reason}")
    for name, s in systems.items():
        check = s["extra"].get("token_check") or {}
        if check and not check.get("ok", True):
            lines.append(f"- WARNING {name}: outputs not exactly the lengths asked ({check.get('num_wrong_length', 0)} "
                         f"wrong, {check.get('num_failed', 0)} failed; {check.get('counted')} of "
                         f"{check.get('expected')} tokens): its numbers do not compare")
    return lines
