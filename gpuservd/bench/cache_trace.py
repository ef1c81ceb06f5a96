"""`gpuserv bench cache-trace`: the weight cache's hit rate on a multi-model trace (LRU and prefetch).

The real LRU policy with and without the prefetch predictor, next to Belady's
offline optimum, at several device cache sizes. See weights/trace_sim.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpuservd.bench.output import write_result
from gpuservd.weights.trace_sim import belady, make_trace, replay


def run_cache_trace(out_dir: Path, sizes=(3, 5, 10, 15), num_requests: int = 6000, seed: int = 0) -> dict:
    trace, meta = make_trace(num_requests=num_requests, seed=seed)
    rows = []
    for k in sizes:
        lru, pre, opt = replay(trace, k, False), replay(trace, k, True), belady(trace, k)
        rows.append({"cache_size": k, "lru": lru["hit_rate"], "lru_prefetch": pre["hit_rate"],
                     "belady": opt["hit_rate"], "prefetch": pre["prefetch_stats"]})
    result = {"trace": meta, "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = write_result(out_dir, result, markdown(result))
    _plot(out / "hit_rate.png", rows)
    return result


def markdown(r: dict) -> str:
    t = r["trace"]
    lines = [f"# weight cache hit rate: {t['models']} models ({t['bases']} bases with variants), "
             f"{t['requests']} requests, top 10 get {100 * t['top10_share']:.0f}%", "",
             "| cache_size | LRU | LRU + prefetch | Belady (offline optimum, demand) | prefetch accuracy |",
             "|---|---|---|---|---|"]
    for row in r["rows"]:
        acc = row["prefetch"]["accuracy"]
        lines.append(f"| {row['cache_size']} | {100 * row['lru']:.1f}% | {100 * row['lru_prefetch']:.1f}% | "
                     f"{100 * row['belady']:.1f}% | {'-' if acc is None else f'{100 * acc:.0f}%'} "
                     f"({row['prefetch']['used']}/{row['prefetch']['issued']}) |")
    lines += ["", f"{r['date']}; sessions of {t['mean_session']} requests on average, "
                  f"{100 * t['follow']:.0f}% of switches follow a workflow; seed {t['seed']}.", ""]
    return "\n".join(lines)


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend when imported

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    x = [r["cache_size"] for r in rows]
    for key, label in (("lru", "LRU"), ("lru_prefetch", "LRU + prefetch"), ("belady", "Belady")):
        ax.plot(x, [100 * r[key] for r in rows], marker="o", label=label)
    ax.axhline(90, color="#999", linestyle=":", linewidth=1)
    ax.set_xlabel("models on the device (cache_size)")
    ax.set_ylabel("device hit rate (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
