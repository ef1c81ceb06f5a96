"""Cold start (layered loading, INT8 transfer): time to first token of a model that is only on disk.

For each load strategy (full; layered; layered from the INT8 file) and each
repeat: the model's files are dropped from the page cache (posix_fadvise
DONTNEED per file, checked with mincore: the share of the file's pages still
cached is recorded), the engine is built, one request is added and stepped until
its first token. Next to each TTFT: the bytes the load read and the read floor of
those files (the fastest of the repeats at reading them with the cache dropped:
a lower bound for any load that reads these bytes), and the same prompt's TTFT on
the loaded engine (the forward's own time, which a cold start cannot beat
either). The INT8 file is written before the runs (the disk tier holds it;
writing is not a load). Quality of the INT8 weights against the fp32 ones:
greedy agreement over a prompt set and the largest logit difference. Writes
result.json, result.md and a bar chart.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import platform
import resource
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
from gpuservd.kv_cache.prefault import resident_fraction
from gpuservd.runner.load import SafetensorsReader, pipeline_enabled
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


def cached_fraction(path) -> float:
    """The share of a file's pages in the page cache (mincore on a private map of it); nan when unknown."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0.0
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            return resident_fraction(ctypes.addressof(ctypes.c_char.from_buffer(m)), size)
    except (OSError, AttributeError, ValueError, TypeError):
        return float("nan")


def _engine(model: str, model_dir: Path, cfg, strategy: str, initial_layers: int):
    source = Int8Reader(int8_path(model_dir)) if strategy.endswith("int8") else SafetensorsReader(model_dir)
    initial = initial_layers if strategy.startswith("layered") else None
    return LLMEngine(model, model_dir, cfg, weight_source=source, initial_layers=initial), source


def _ttft(engine, prompt: list[int], request_id: str = "cold") -> float:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
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
    """Seconds to read the files once from the disk (page cache dropped first), asking for every byte up
    front (WILLNEED: the disk's whole queue) and reading them sequentially into one reused buffer: no
    load strategy that reads these bytes can bring its first token sooner."""
    drop_page_cache(paths)
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            while f.readinto(buf):
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
            runs[strategy].append(_cold_run(model, model_dir, cfg, strategy, initial_layers, prompt, files, device))
            r = runs[strategy][-1]
            if r["cached_before"] > 0.05:
                log(f"  warning: {100 * r['cached_before']:.0f}% of a weight file stayed in the page cache: another "
                    "process maps it (a daemon or bench on this model); this run was not cold")
            log(f"  {strategy:>13} #{rep + 1}: ttft {r['ttft_s']:.2f} s (engine ready {r['engine_ready_s']:.2f} s, "
                f"all layers {r['all_layers_s']:.2f} s, {r['bytes_read'] / 1e6:.0f} MB read, "
                f"warm ttft {r['warm_ttft_s']:.2f} s, {100 * r['cached_before']:.0f}% cached before)")
    summary = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
    full = summary["full"]["ttft_s"]
    for s in STRATEGIES:
        summary[s]["speedup_vs_full"] = full / summary[s]["ttft_s"]
        # the fastest read of the files is the bound: a median would let a slow read excuse a slow load
        summary[s]["read_floor_s"] = min(floors["int8" if s.endswith("int8") else "full"])
        summary[s]["ttft_vs_read_floor"] = summary[s]["ttft_s"] / summary[s]["read_floor_s"]
        # neither the read nor the forward can be hidden behind the other entirely: the larger is the bound
        summary[s]["bound_s"] = max(summary[s]["read_floor_s"], summary[s]["warm_ttft_s"])
        summary[s]["ttft_vs_bound"] = summary[s]["ttft_s"] / summary[s]["bound_s"]
    log("agreement of the INT8 weights with full precision")
    quality = int8_agreement(model, model_dir, cfg)
    log(f"  {summary_line(quality)}")

    result = {"model": model, "device": device, "device_name": _device_name(device), "dtype": cfg.dtype,
              "dtype_reason": cfg.dtype_reason,
              "prompt_tokens": prompt_tokens, "initial_layers": initial_layers, "repeats": repeats,
              "threads": num_threads or torch.get_num_threads(), "summary": summary, "runs": runs,
              "read_floor_runs": floors,
              "int8_quality": quality, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "load_pipeline": pipeline_enabled(),
              "cache_dropped": all(r["cached_before"] <= 0.05 for rs in runs.values() for r in rs),
              "method": "page cache dropped (posix_fadvise DONTNEED per file; cached_before: the share of pages "
                        "mincore still saw) before each run; medians over repeats; read floor: the fastest of the "
                        "repeats at reading the strategy's files once, cache dropped; warm TTFT: the same-length "
                        "prompt on the loaded engine; CPU s: the process's, every thread, from the engine's "
                        "construction to the first token"}

    _plot(write_result(out_dir, result, markdown(result)) / "cold_start.png", summary)
    return result


def _cold_run(model, model_dir, cfg, strategy, initial_layers, prompt, files, device) -> dict:
    """One cold start: cache dropped, engine built, first token; then the same-length prompt on the
    loaded engine (the forward alone)."""
    gc.collect()
    drop_page_cache(files)
    cached = max(cached_fraction(f) for f in files)
    _sync(device)
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    engine, source = _engine(model, model_dir, cfg, strategy, initial_layers)
    built = time.perf_counter() - t0
    first = _ttft(engine, prompt) - t0
    cpu = _cpu_s() - cpu0
    gate = engine.runner.weights.gate
    if gate is not None:
        gate.wait_all()
    _sync(device)
    all_in = time.perf_counter() - t0
    read = getattr(source, "bytes_read", None)
    if not read:  # a source that does not count: every byte of its files
        read = sum(Path(f).stat().st_size for f in files[:-1])
    other = [t + 1 for t in prompt]  # another prompt of the same length: no prefix-cache hit
    t1 = time.perf_counter()
    warm = _ttft(engine, other, "warm") - t1
    return {"ttft_s": first, "engine_ready_s": built, "all_layers_s": all_in, "bytes_read": read,
            "warm_ttft_s": warm, "cached_before": cached, "cpu_to_first_token_s": cpu}


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread (the reader's and loader's too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def markdown(r: dict) -> str:
    where = f" on {r['device']} ({r.get('device_name', '')}), {r.get('dtype', 'float32')}" if "device" in r else ""
    lines = [f"# cold start: {r['model']}, {r['prompt_tokens']}-token prompt, initial_layers {r['initial_layers']}{where}",
             "", "| strategy | TTFT s | read floor s | TTFT / floor | warm TTFT s | TTFT / max(floor, warm) "
                 "| CPU s to 1st token | bytes read MB | engine ready s | all layers in s | vs full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, v in r["summary"].items():
        def cell(key, fmt):
            return fmt.format(v[key]) if key in v else "-"
        lines.append(f"| {s} | {v['ttft_s']:.3f} | {cell('read_floor_s', '{:.3f}')} | "
                     f"{cell('ttft_vs_read_floor', '{:.2f}x')} | {cell('warm_ttft_s', '{:.3f}')} | "
                     f"{cell('ttft_vs_bound', '{:.2f}x')} | {cell('cpu_to_first_token_s', '{:.2f}')} | "
                     f"{v['bytes_read'] / 1e6:.0f} | {v['engine_ready_s']:.3f} | {v['all_layers_s']:.3f} | "
                     f"{v['speedup_vs_full']:.2f}x |")
    q = r["int8_quality"]
    lines += ["", f"INT8 (a scale per {q.get('group_size', '?')} input columns) against full precision: "
                  f"{summary_line(q)}; {100 * q['free_running']['identical_prefix_share']:.1f}% of reply tokens "
                  "before the first divergence.",
              "", f"{r['date']}, {r['threads']} threads, load pipeline {'on' if r.get('load_pipeline', True) else 'off'}; "
                  f"{r['method']}.", ""]
    return "\n".join(lines)


def _plot(path: Path, summary: dict) -> None:
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend when imported

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    names = list(summary)
    ax.bar(names, [summary[n]["ttft_s"] for n in names], color=["#888", "#4a7", "#27a"])
    ax.set_ylabel("cold time to first token (s)")
    for i, n in enumerate(names):
        ax.text(i, summary[n]["ttft_s"], f"{summary[n]['ttft_s']:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
