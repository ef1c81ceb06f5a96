"""The benchmark report: result.json, result.md and latency_cdf.png in one folder.

Every system's numbers are computed here, from its `SystemRun`, the same way:
throughput = generated tokens / wall; latency = finish - arrival; ttft = first
token - arrival; percentiles are numpy's linear interpolation. Ratios are
gpuserv / peer, so a throughput ratio above 1 and latency ratios below 1 mean
gpuserv is ahead.

No torch here (the report must be cheap to import); matplotlib is imported
only when the plot is drawn.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from importlib import metadata
from pathlib import Path

import numpy as np

from gpuservd.bench.compute_floor import floor_lines
from gpuservd.bench.records import SystemRun
from gpuservd.bench.report_http import HTTP_OURS, http_lines, http_vs_inprocess

PERCENTILES = (50, 90, 99)
OURS = "gpuserv"


def percentiles(values) -> dict | None:
    """{p50, p90, p99} of `values` (numpy linear interpolation); None when there are none."""
    if len(values) == 0:
        return None
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q, method="linear")) for q in PERCENTILES}


def _class_names(workload, runs: list[SystemRun]) -> list[str]:
    names = list(workload.class_names()) if workload is not None else []
    for run in runs:
        for r in run.requests:
            if r.cls not in names:
                names.append(r.cls)
    return names


def system_summary(run: SystemRun, classes: list[str]) -> dict:
    """One system's numbers: throughput, latency and ttft percentiles for all requests and per class."""
    def by_class(metric) -> dict:
        out = {"all": percentiles([metric(r) for r in run.requests])}
        for c in classes:
            out[c] = percentiles([metric(r) for r in run.requests if r.cls == c])
        return out

    tokens = run.generated_tokens
    return {
        "throughput_tok_s": tokens / run.wall_s if run.wall_s > 0 else None,
        "latency_s": by_class(lambda r: r.latency_s),
        "ttft_s": by_class(lambda r: r.ttft_s),
        "num_requests": len(run.requests),
        "generated_tokens": tokens,
        "wall_s": run.wall_s,
        "extra": run.extra,
        "requests": [vars(r) for r in run.requests],
    }


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def ratios(systems: dict, classes: list[str], ours_name: str = OURS) -> dict:
    """gpuserv / peer for throughput, latency p50/p99 and ttft p50/p99, per class; {} without gpuserv.
    `ours_name` picks which gpuserv run is compared (the in-process one, or "gpuserv[http]")."""
    ours = systems.get(ours_name)
    if ours is None:
        return {}
    out = {}
    for name, peer in systems.items():
        if _ours(name):
            continue
        entry = {"throughput": _ratio(ours["throughput_tok_s"], peer["throughput_tok_s"])}
        for metric, short in (("latency_s", "latency"), ("ttft_s", "ttft")):
            for p in ("p50", "p99"):
                entry[f"{short}_{p}"] = {
                    c: _ratio((ours[metric].get(c) or {}).get(p), (peer[metric].get(c) or {}).get(p))
                    for c in ["all", *classes]
                }
        out[name] = entry
    return out


def _ours(name: str) -> bool:
    return name == OURS or name.startswith(OURS + "[")


def variants(systems: dict, classes: list[str]) -> dict:
    """Each gpuserv variant (a --compare config) against the first config ("gpuserv"): throughput
    and per-class latency p50 / p99 ratios (variant / base)."""
    base = systems.get(OURS)
    out = {}
    for name, s in systems.items():
        if name == OURS or not _ours(name) or base is None or name == f"{OURS}[alone]":
            continue
        entry = {"throughput": _ratio(s["throughput_tok_s"], base["throughput_tok_s"])}
        for p in ("p50", "p99"):
            entry[f"latency_{p}"] = {c: _ratio((s["latency_s"].get(c) or {}).get(p),
                                               (base["latency_s"].get(c) or {}).get(p)) for c in ["all", *classes]}
        entry["ttft_p50"] = _ratio((s["ttft_s"].get("all") or {}).get("p50"), (base["ttft_s"].get("all") or {}).get("p50"))
        out[name] = entry
    return out


def drag(runs: list[SystemRun]) -> dict:
    """With a gpuserv[alone] run (the workload without one class): for every other gpuserv run, each
    class's mean latency divided by its mean latency alone (1.0 = the extra class cost nothing)."""
    alone = next((r for r in runs if r.system == f"{OURS}[alone]"), None)
    if alone is None:
        return {}
    classes = sorted({r.cls for r in alone.requests})

    def mean(run, c):
        vals = [r.finish_s - r.arrival_s for r in run.requests if r.cls == c]
        return sum(vals) / len(vals) if vals else None

    return {run.system: {c: _ratio(mean(run, c), mean(alone, c)) for c in classes}
            for run in runs if _ours(run.system) and run is not alone}


def longest_request(runs: list[SystemRun]) -> dict | None:
    """The workload's longest request (most output tokens, then prompt tokens; the same request in every
    system) and its completion time (finish - arrival) in each: what starvation would show in first.
    gpuserv_over: gpuserv's completion over each other system's (with `--config srf --compare fcfs`,
    gpuserv / gpuserv[fcfs] is SRF's cost to the longest request against arrival order)."""
    ours = next((r for r in runs if r.system == OURS), runs[0] if runs else None)
    if ours is None or not ours.requests:
        return None
    top = max(ours.requests, key=lambda r: (r.output_tokens, r.prompt_tokens))
    completion = {run.system: next((r.latency_s for r in run.requests if r.request_id == top.request_id), None)
                  for run in runs}
    return {"request_id": top.request_id, "cls": top.cls, "prompt_tokens": top.prompt_tokens,
            "output_tokens": top.output_tokens, "completion_s": completion,
            "gpuserv_over": {name: _ratio(completion.get(OURS), c) for name, c in completion.items() if name != OURS}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def meta(workload, runs: list[SystemRun], config: dict) -> dict:
    """Where and how the numbers were taken. dtype and threads come from `config`
    ("dtype", "num_threads" or "threads"), else from the first run that recorded them."""
    def from_runs(key):
        return next((r.extra.get(key) for r in runs if r.extra.get(key) is not None), None)

    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpu": _cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
                 "node": platform.node(), "python": platform.python_version()},
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "dtype": config.get("dtype") or from_runs("dtype"),
        "dtype_reason": config.get("dtype_reason"),  # engine.dtype auto: what it chose on this machine and why
        "threads": config.get("num_threads") or config.get("threads") or from_runs("num_threads"),
        "workload": {"name": getattr(workload, "name", None),
                     "file": str(workload.path) if getattr(workload, "path", None) else None},
        "config": config,
    }


def write_report(out_dir, workload, runs: list[SystemRun], floor: dict | None, config: dict,
                 skipped: dict | None = None) -> dict:
    """Write out_dir/result.json, result.md and latency_cdf.png for `runs` (one or more systems;
    gpuserv's run is the one named "gpuserv") and return the result dict. `skipped` maps each peer
    that could not run to the reason."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    classes = _class_names(workload, runs)
    systems = {run.system: system_summary(run, classes) for run in runs}
    result = {
        "systems": systems,
        "classes": classes,
        "ratios": ratios(systems, classes),
        "variants": variants(systems, classes),
        "drag": drag(runs),
        "longest_request": longest_request(runs),
        "floor": floor,
        "meta": meta(workload, runs, config or {}),
        "skipped": dict(skipped or {}),
        "ratios_http": ratios(systems, classes, HTTP_OURS),  # gpuserv through HTTP / each peer
        "http_inprocess": http_vs_inprocess(systems),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "result.md").write_text(markdown(result))
    plot_latency_cdf(out / "latency_cdf.png", runs, classes)
    return result


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _p(stats: dict | None, key: str) -> str:
    return "-" if not stats else _f(stats.get(key))


def markdown(result: dict) -> str:
    """A short Markdown summary: one row per system, one row per gpuserv/peer ratio, the floor."""
    classes = result["classes"]
    groups = ["all", *classes] if len(classes) > 1 else ["all"]
    head = ["system", "tok/s", "wall s"] + [f"latency {g} p50 / p99 s" for g in groups] + ["ttft p50 s"]
    lines = [f"# {result['meta']['workload']['name'] or 'benchmark'}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in result["systems"].items():
        cells = [name, _f(s["throughput_tok_s"], "{:.1f}"), _f(s["wall_s"])]
        cells += [f"{_p(s['latency_s'].get(g), 'p50')} / {_p(s['latency_s'].get(g), 'p99')}" for g in groups]
        cells.append(_p(s["ttft_s"]["all"], "p50"))
        lines.append("| " + " | ".join(cells) + " |")
    for peer, r in result["ratios"].items():
        cells = [f"{OURS} / {peer}", _f(r["throughput"], "{:.2f}x"), ""]
        cells += [f"{_f(r['latency_p50'].get(g), '{:.2f}x')} / {_f(r['latency_p99'].get(g), '{:.2f}x')}"
                  for g in groups]
        cells.append(_f(r["ttft_p50"].get("all"), "{:.2f}x"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += http_lines(result)
    lines += _longest_lines(result.get("longest_request"))
    lines += _preemption_lines(result, groups)
    lines += _prefix_cache_lines(result)
    fl = result.get("floor")
    if fl:
        verdict = (f"the probe was wrong: {fl['note']}" if fl.get("probe_wrong")
                   else f"ratio {_f(fl.get('ratio'), '{:.2f}')}")
        lines += ["", f"Batch-1 decode floor: {_f(fl.get('floor_step_ms'), '{:.1f}')} ms "
                      f"({_f(fl.get('weight_bytes') and fl['weight_bytes'] / 1e6, '{:.0f}')} MB of weights"
                      + (f" as gpuserv holds them ({fl['checkpoint_weight_bytes'] / 1e6:.0f} MB at the dtype)"
                         if fl.get("checkpoint_weight_bytes", 0) > fl.get("weight_bytes", 0) else "") + " at "
                      f"{_f(fl.get('read_bandwidth_gbs'), '{:.1f}')} GB/s, the best of "
                      f"{len(fl.get('probe_readings_gbs') or [0])} probes); gpuserv's batch-1 step: "
                      f"{_f(fl.get('gpuserv_batch1_step_ms'), '{:.1f}')} ms ({verdict})."]
    lines += floor_lines(result)
    m = result["meta"]
    why = f" ({m['dtype_reason']})" if m.get("dtype_reason") else ""
    lines += ["", f"{m['date']}, {m['host']['cpu']} ({m['host']['cores']} cores), dtype {m['dtype']}{why}, "
                  f"{m['threads']} threads, torch {m['torch']}, transformers {m['transformers']}.", ""]
    return "\n".join(lines)


def _longest_lines(top: dict | None) -> list[str]:
    if not top:
        return []
    times = ", ".join(f"{name} {_f(c)} s" for name, c in top["completion_s"].items())
    ratios = ", ".join(f"{OURS} / {name} {_f(r, '{:.2f}x')}" for name, r in top["gpuserv_over"].items())
    return ["", f"Longest request {top['request_id']} ({top['cls']}, {top['prompt_tokens']} + {top['output_tokens']} "
                f"tokens), completion: {times}" + (f"; {ratios}" if ratios else "") + "."]


def _prefix_cache_lines(result: dict) -> list[str]:
    """Per gpuserv run: the prefix cache's measured hit rate beside the workload's own (its construction
    through an unbounded cache), and each variant's TTFT P50 against the base."""
    ours = {n: s["extra"] for n, s in result["systems"].items() if _ours(n) and "prefix_query_tokens" in s["extra"]}
    if not any(e["prefix_query_tokens"] or e.get("prefix_expected_hit_rate") for e in ours.values()):
        return []
    lines = ["", "| run | prefix caching | hit rate | expected hit rate | hit / query tokens | ttft p50 / base |",
             "|---|---|---|---|---|---|"]
    for name, e in ours.items():
        v = (result.get("variants") or {}).get(name) or {}
        lines.append("| " + " | ".join([
            name, "on" if e.get("prefix_caching") else "off", _f(e.get("prefix_hit_rate"), "{:.3f}"),
            _f(e.get("prefix_expected_hit_rate"), "{:.3f}"), f"{e['prefix_hit_tokens']} / {e['prefix_query_tokens']}",
            _f(v.get("ttft_p50"), "{:.2f}x") if v else "-"]) + " |")
    return lines


def _preemption_lines(result: dict, groups: list[str]) -> list[str]:
    """Per gpuserv run: what preemption did and cost; variants against the base; the drag."""
    # The in-process runs: a run through HTTP (report_http.py) has no engine records to show here.
    ours = {n: s for n, s in result["systems"].items() if _ours(n) and s["extra"].get("target") != "http"}
    if not any("num_preempted" in s["extra"] for s in ours.values()):
        return []
    head = ["run", "preemptions", "max per request", "kinds", "swap MB", "tokens recomputed", "layer suspends",
            "scheduler % of step", "swap % of step", "busy %"]
    lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in ours.items():
        e = s["extra"]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted((e.get("preemptions_by_kind") or {}).items())) or "-"
        lines.append("| " + " | ".join([
            name, str(e.get("num_preempted", "-")), str(e.get("max_preemptions_per_request", "-")), kinds,
            _f(e.get("swap_bytes", 0) / 1e6, "{:.1f}"), str(e.get("tokens_recomputed", "-")),
            str(e.get("layer_suspends", "-")), _f(100 * e.get("scheduler_share", 0), "{:.2f}"),
            _f(100 * e.get("swap_share", 0), "{:.2f}"), _f(100 * (e.get("busy_share") or 0), "{:.0f}")]) + " |")
    if result.get("variants"):
        head = ["variant / gpuserv", "tok/s"] + [f"latency {g} p50 / p99" for g in groups]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, v in result["variants"].items():
            cells = [name, _f(v["throughput"], "{:.2f}x")]
            cells += [f"{_f(v['latency_p50'].get(g), '{:.2f}x')} / {_f(v['latency_p99'].get(g), '{:.2f}x')}"
                      for g in groups]
            lines.append("| " + " | ".join(cells) + " |")
    if result.get("drag"):
        lines += ["", "Drag (mean latency / mean latency without the extra class):"]
        for name, d in result["drag"].items():
            lines.append(f"- {name}: " + ", ".join(f"{c} {_f(x, '{:.2f}x')}" for c, x in d.items()))
    return lines


def plot_latency_cdf(path, runs: list[SystemRun], classes: list[str]) -> None:
    """One panel per request class (plus "all" when there are several), one CDF line per system."""
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")  # no display: this runs on servers and in tests
    import matplotlib.pyplot as plt

    groups = ["all", *classes] if len(classes) > 1 else (classes or ["all"])
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for run in runs:
            lat = sorted(r.finish_s - r.arrival_s for r in run.requests if group == "all" or r.cls == group)
            if lat:
                # Start each line at 0 so that even a single request draws its jump.
                frac = np.arange(0, len(lat) + 1) / len(lat)
                ax.step([lat[0], *lat], frac, where="post", label=run.system)
        ax.set_title(f"latency CDF: {group}")
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
