"""Cold start (layered loading, INT8 transfer): time to first token of a model that is only on disk.

For each load strategy (full; layered; layered from the INT8 file) and each
repeat: the model's files are dropped from the page cache (posix_fadvise
DONTNEED, so the bytes really come from the disk), the engine is built, one
request is added and stepped until its first token. The INT8 file is written
before the runs (the disk tier holds it; writing is not a load). Quality of the
INT8 weights against the fp32 ones: greedy agreement over a prompt set and the
largest logit difference. Writes result.json, result.md and a bar chart.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from gpuservd.bench.output import write_result
from gpuservd.bench.random_model import RANDOM_MODELS, ensure_random_llama
from gpuservd.config import EngineConfig
from gpuservd.engine.agreement import measure_int8, summary_line
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.runner.load import SafetensorsReader
from gpuservd.runner.model_config import load_arch
from gpuservd.store.store import ModelStore
from gpuservd.weights.int8_file import Int8Reader, ensure_int8, int8_path

STRATEGIES = ("full", "layered", "layered+int8")


def drop_page_cache(paths) -> None:
    """Ask the kernel to forget the files' cached pages (clean pages go; nothing is deleted). Pages
    that a process still maps (a live safetensors reader, CPU weights that are views of the file)
    stay: drop every engine and reader first."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) are not dropped: write them out first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _engine(model: str, model_dir: Path, cfg, strategy: str, initial_layers: int):
    source = Int8Reader(int8_path(model_dir)) if strategy.endswith("int8") else SafetensorsReader(model_dir)
    initial = initial_layers if strategy.startswith("layered") else None
    return LLMEngine(model, model_dir, cfg, weight_source=source, initial_layers=initial), source


def _ttft(engine, prompt: list[int]) -> float:
    engine.add_request("cold", prompt, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
    while True:
        for out in engine.step():
            if out.new_token_ids:
                return time.perf_counter()


def int8_agreement(model: str, model_dir: Path, cfg) -> dict:
    """Teacher-forced and free-running agreement of the INT8 weights with full precision (engine/agreement.py),
    stored beside the INT8 file for `gpuserv models show` and the daemon's int8 check."""
    q = measure_int8(model, model_dir, cfg)
    q["group_size"] = Int8Reader(int8_path(model_dir)).group_size
    # the names this result had before the agreement measures (free-running token shares)
    q["greedy_token_agreement"] = q["free_running"]["token_agreement"]
    q["greedy_identical_prefix_share"] = q["free_running"]["identical_prefix_share"]
    return q


def read_floor_s(paths) -> float:
    """Seconds to read the files once from the disk (page cache dropped first): no load strategy that
    reads these bytes can bring its first token sooner."""
    drop_page_cache(paths)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run_cold_start(model: str, out_dir: Path, prompt_tokens: int = 256, initial_layers: int = 8, repeats: int = 3,
                   num_threads: int | None = None, log=print, device: str = "cpu", dtype: str = "auto") -> dict:
    store = ModelStore()
    if model in RANDOM_MODELS:  # a stand-in of a known shape (isolation-small: SmolLM2's), made on first use
        ensure_random_llama(store, model, RANDOM_MODELS[model], tokenizer_from="smollm2")
    model_dir = store.path(model)
    cfg = EngineConfig(model=model, device=device, dtype=dtype, num_threads=num_threads, kv_cache_bytes=64 << 20)
    cfg.validate()
    cfg.scheduler.max_prefill_tokens = max(cfg.scheduler.max_prefill_tokens, prompt_tokens)
    cfg.scheduler.max_num_batched_tokens = max(cfg.scheduler.max_num_batched_tokens, prompt_tokens)
    ensure_int8(SafetensorsReader(model_dir), model_dir)  # written once; an older format is made again
    files = sorted(str(p) for p in model_dir.glob("*.safetensors")) + [str(int8_path(model_dir))]

    vocab = load_arch(model_dir).vocab_size
    prompt = [3 + (100 + i * 7) % (vocab - 3) for i in range(prompt_tokens)]
    # The device's context and the kernels' first use (CUDA's context, the CPU's C++ kernels) are the
    # running daemon's, not a load's: one warm run first, not measured.
    log("warming up (device context, kernels)")
    warm, warm_source = _engine(model, model_dir, cfg, "full", initial_layers)
    _ttft(warm, prompt)
    del warm, warm_source
    runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    floors: dict[str, list[float]] = {"full": [], "int8": []}
    for rep in range(repeats):
        gc.collect()  # the last run's engine and reader: pages still mapped are not dropped from the cache
        floors["full"].append(read_floor_s(files[:-1]))
        floors["int8"].append(read_floor_s(files[-1:]))
        for strategy in STRATEGIES:  # interleaved, so drift hits every strategy alike
            gc.collect()
            drop_page_cache(files)
            _sync(device)
            t0 = time.perf_counter()
            engine, source = _engine(model, model_dir, cfg, strategy, initial_layers)
            built = time.perf_counter() - t0
            first = _ttft(engine, prompt) - t0
            gate = engine.runner.weights.gate
            if gate is not None:
                gate.wait_all()
            _sync(device)
            all_in = time.perf_counter() - t0
            read = getattr(source, "bytes_read", None)
            if read is None:
                read = sum(Path(f).stat().st_size for f in files[:-1])
            runs[strategy].append({"ttft_s": first, "engine_ready_s": built, "all_layers_s": all_in,
                                   "bytes_read": read})
            log(f"  {strategy:>13} #{rep + 1}: ttft {first:.2f} s (engine ready {built:.2f} s, all layers {all_in:.2f} s)")
            del engine, source
    summary = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
    full = summary["full"]["ttft_s"]
    for s in STRATEGIES:
        summary[s]["speedup_vs_full"] = full / summary[s]["ttft_s"]
        summary[s]["read_floor_s"] = statistics.median(floors["int8" if s.endswith("int8") else "full"])
    log("agreement of the INT8 weights with full precision")
    quality = int8_agreement(model, model_dir, cfg)
    log(f"  {summary_line(quality)}")

    result = {"model": model, "device": device, "device_name": _device_name(device), "dtype": cfg.dtype,
              "dtype_reason": cfg.dtype_reason,
              "prompt_tokens": prompt_tokens, "initial_layers": initial_layers, "repeats": repeats,
              "threads": num_threads or torch.get_num_threads(), "summary": summary, "runs": runs,
              "read_floor_runs": floors,
              "int8_quality": quality, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "method": "page cache dropped (posix_fadvise DONTNEED) before each run; medians over repeats; "
                        "read floor: the files read once, cache dropped"}

    _plot(write_result(out_dir, result, markdown(result)) / "cold_start.png", summary)
    return result


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def markdown(r: dict) -> str:
    where = f" on {r['device']} ({r.get('device_name', '')}), {r.get('dtype', 'float32')}" if "device" in r else ""
    lines = [f"# cold start: {r['model']}, {r['prompt_tokens']}-token prompt, initial_layers {r['initial_layers']}{where}",
             "", "| strategy | TTFT s | engine ready s | all layers in s | bytes read MB | read floor s | vs full |",
             "|---|---|---|---|---|---|---|"]
    for s, v in r["summary"].items():
        floor = f"{v['read_floor_s']:.2f}" if "read_floor_s" in v else "-"
        lines.append(f"| {s} | {v['ttft_s']:.2f} | {v['engine_ready_s']:.2f} | {v['all_layers_s']:.2f} | "
                     f"{v['bytes_read'] / 1e6:.0f} | {floor} | {v['speedup_vs_full']:.2f}x |")
    q = r["int8_quality"]
    lines += ["", f"INT8 (a scale per {q.get('group_size', '?')} input columns) against full precision: "
                  f"{summary_line(q)}; {100 * q['free_running']['identical_prefix_share']:.1f}% of reply tokens "
                  "before the first divergence.",
              "", f"{r['date']}, {r['threads']} threads; {r['method']}.", ""]
    return "\n".join(lines)


def _plot(path: Path, summary: dict) -> None:
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    names = list(summary)
    ax.bar(names, [summary[n]["ttft_s"] for n in names], color=["#888", "#4a7", "#27a"])
    ax.set_ylabel("cold time to first token (s)")
    for i, n in enumerate(names):
        ax.text(i, summary[n]["ttft_s"], f"{summary[n]['ttft_s']:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
