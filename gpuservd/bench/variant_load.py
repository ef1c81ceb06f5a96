"""Variant load: what loading a variant moves when its base is resident, against a full load.

A random LoRA adapter (and a full-rank delta) for the model is written and
derived into a private store beside a link to the real model (the user's store
is not touched). Each repeat drops the files from the page cache, then measures

- weights: `load_weights` of the base (every tensor read through a counting
  source) against `VariantSource.build_weights` over those resident weights
  (the adapter file read, the base's source never opened);
- daemon: `Serving.load(base)` then `Serving.load(variant)` in one process (the
  variant's engine, KV pool and tokenizer included), with the device tier's
  bytes before and after, and `Serving.load(variant)` in a fresh process state
  where the base must come in as a hidden dependency.

Exactness against the merged weights is a test (tests/test_lora.py, tiny models);
here the largest logit change the adapter makes is reported, to show it is not a no-op.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpuservd.bench.cold import drop_page_cache as _drop
from gpuservd.bench.output import write_result
from gpuservd.serving.daemon_config import daemon_config_from_dict
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.load import SafetensorsReader, load_weights
from gpuservd.runner.model_config import load_arch
from gpuservd.serving.serving import Serving
from gpuservd.store.layout import read_config
from gpuservd.store.store import ModelStore
from gpuservd.serving.tenants import TenantMap
from gpuservd.weights.delta import CountingSource, VariantSource, make_adapter


def drop_page_cache(paths) -> None:
    """Drop the files' cached pages once the last run's mappings are gone (mapped pages stay cached)."""
    gc.collect()
    _drop(paths)


def _files(d: Path) -> list[Path]:
    return [p for p in Path(d).iterdir() if p.is_file()]


def _weights_run(base_dir: Path, variant_dir: Path, base_cfg: dict, dtype) -> dict:
    arch = load_arch(base_dir)
    drop_page_cache(_files(base_dir) + _files(variant_dir))
    base_src = CountingSource(SafetensorsReader(base_dir))
    t0 = time.perf_counter()
    base = load_weights(base_src, arch, dtype, torch.device("cpu"))
    full_s = time.perf_counter() - t0
    full_bytes = base_src.bytes_read
    vs = VariantSource(base, variant_dir, base_cfg, base_dir.name)
    t0 = time.perf_counter()
    weights = vs.build_weights(arch, dtype, torch.device("cpu"))
    variant_s = time.perf_counter() - t0
    assert base_src.bytes_read == full_bytes  # the variant never touched the base's files
    return {"full_s": full_s, "full_bytes": full_bytes, "variant_s": variant_s, "variant_bytes": vs.bytes_read,
            "base_bytes_read_by_variant": base_src.bytes_read - full_bytes,
            "variant_device_bytes": weights.nbytes(), "base_device_bytes": base.nbytes()}


def _serving_run(model: str, variant: str, dirs: list[Path], threads: int | None) -> dict:
    engine = {"kv_cache_bytes": "64MiB", "num_threads": threads} if threads else {"kv_cache_bytes": "64MiB"}

    async def main():
        cfg = daemon_config_from_dict({"engine": engine, "server": {"models": []},
                                       "cache": {"cache_size": 4, "host_bytes": 0}})
        out = {}
        s = Serving(cfg, TenantMap())
        try:
            drop_page_cache([f for d in dirs for f in _files(d)])
            t0 = time.perf_counter()
            await s.load(model)
            out["base_load_s"] = time.perf_counter() - t0
            out["device_bytes_base"] = s.cache.status()["device"]["used_bytes"]
            t0 = time.perf_counter()
            await s.load(variant)
            out["variant_load_s"] = time.perf_counter() - t0
            out["variant_tier"] = s.slots[variant].source_tier
            # of which building the variant's runner (weights + KV pool); the rest: engine, tokenizer, thread
            out["variant_runner_s"] = s.slots[variant].loop.engine.runner.load_report.load_s
            out["device_bytes_base_and_variant"] = s.cache.status()["device"]["used_bytes"]
            out["delta_bytes_read"] = s.cache.bytes_loaded.get("delta", 0)
            out["same_weights_object"] = (s.slots[variant].loop.engine.runner.weights.base
                                          is s.slots[model].loop.engine.runner.weights)
        finally:
            await s.stop_engines()
        s = Serving(cfg, TenantMap())
        try:
            drop_page_cache([f for d in dirs for f in _files(d)])
            t0 = time.perf_counter()
            await s.load(variant)
            out["variant_alone_load_s"] = time.perf_counter() - t0
            out["variant_alone_tier"] = s.slots[variant].source_tier
        finally:
            await s.stop_engines()
        return out

    return asyncio.run(main())


def _logit_change(base_dir: Path, variant_dir: Path, base_cfg: dict) -> float:
    """Largest logit change the adapter makes on a short prompt (0 would mean a no-op adapter)."""
    arch = load_arch(base_dir)
    base = load_weights(base_dir, arch, torch.float32, torch.device("cpu"))
    var = VariantSource(base, variant_dir, base_cfg, base_dir.name).build_weights(arch, torch.float32, "cpu")
    ids = list(range(100, 132))
    logits = []
    for w in (base, var):
        cache = KVCache(cache_shape(arch, 16, torch.float32), 4, torch.device("cpu"))
        batch = build_batch([SeqChunk(ids, 0, cache.pool.allocate(2), True)], 16, torch.device("cpu"))
        logits.append(LlamaModel(arch, w, 256, torch.float32, "cpu").forward(batch, cache.layer)[0])
    return float((logits[0] - logits[1]).abs().max())


def run_variant_load(model: str, out_dir: Path, rank: int = 8, repeats: int = 3, threads: int | None = None,
                     log=print) -> dict:
    if threads:
        torch.set_num_threads(threads)
    base_dir = ModelStore().path(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix="gpuserv-variant-load-"))  # adapters + a private store, removed after
    home = work / "home"  # the private store: a link to the real model plus the derived variants
    (home / "models").mkdir(parents=True, exist_ok=True)
    link = home / "models" / model
    if not link.exists():
        link.symlink_to(base_dir.resolve())
    old_home = os.environ.get("GPUSERV_HOME")
    os.environ["GPUSERV_HOME"] = str(home)
    try:
        store = ModelStore()
        base_cfg = read_config(base_dir)
        kinds = {f"{model}-lora-r{rank}": dict(kind="lora", rank=rank, targets=(
                     "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
                 f"{model}-delta-qv": dict(kind="delta", targets=("q_proj", "v_proj"))}
        variants = {}
        for name, kw in kinds.items():
            adapter = make_adapter(base_dir, work / "adapters" / name, seed=1, **kw)
            info = store.derive(name, model, adapter, overwrite=True)
            variants[name] = {"kind": kw["kind"], "targets": list(kw["targets"]), "rank": kw.get("rank", 0),
                              "adapter_bytes_on_disk": info.bytes_on_disk, "dir": store.path(name)}
        rows = {}
        log("warm-up (one-time costs: imports, kernels, first allocations)")
        _serving_run(model, next(iter(variants)), [], threads)
        for name, v in variants.items():
            runs = []
            for i in range(repeats):
                log(f"{name}: repeat {i + 1}/{repeats} (weights)")
                runs.append(_weights_run(base_dir, v["dir"], base_cfg, torch.float32))
            serv = []
            for i in range(repeats):
                log(f"{name}: repeat {i + 1}/{repeats} (daemon load path)")
                serv.append(_serving_run(model, name, [base_dir, v["dir"]], threads))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            smed = {k: (statistics.median(r[k] for r in serv) if isinstance(serv[0][k], (int, float))
                        and not isinstance(serv[0][k], bool) else serv[0][k]) for k in serv[0]}
            rows[name] = {**{k: x for k, x in v.items() if k != "dir"}, "weights": med, "daemon": smed,
                          "max_logit_change": _logit_change(base_dir, v["dir"], base_cfg),
                          "runs": {"weights": runs, "daemon": serv}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if old_home is None:
            os.environ.pop("GPUSERV_HOME", None)
        else:
            os.environ["GPUSERV_HOME"] = old_home
    result = {"model": model, "repeats": repeats, "threads": threads or torch.get_num_threads(), "variants": rows,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "method": "page cache dropped (posix_fadvise DONTNEED) before each load; medians over repeats; "
                        "bytes counted at the tensor sources; fp32 compute"}
    raw = _raw_read_s(base_dir)
    result["raw_read_s"] = raw

    write_result(out_dir, result, markdown(result))
    return result


def _raw_read_s(base_dir: Path) -> dict:
    """Seconds to read the base's files with read(2), page cache dropped and not: what the disk gives."""
    out = {}
    files = [p for p in _files(base_dir) if p.suffix == ".safetensors"]
    for label in ("dropped", "cached"):
        if label == "dropped":
            drop_page_cache(files)
        t0 = time.perf_counter()
        for p in files:
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
        out[label] = time.perf_counter() - t0
    return out


def markdown(r: dict) -> str:
    lines = [f"# variant load over a resident base: {r['model']}", "",
             "| variant | bytes read | vs full load | load s (weights) | full load s (weights) | "
             "daemon: variant s | daemon: base s | daemon: variant alone s | device bytes base -> +variant |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        w, d = v["weights"], v["daemon"]
        lines.append(
            f"| {name} ({v['kind']}) | {w['variant_bytes'] / 1e6:.2f} MB | "
            f"{100 * w['variant_bytes'] / w['full_bytes']:.2f}% of {w['full_bytes'] / 1e6:.0f} MB | "
            f"{w['variant_s']:.3f} | {w['full_s']:.2f} | {d['variant_load_s']:.2f} | {d['base_load_s']:.2f} | "
            f"{d['variant_alone_load_s']:.2f} | {d['device_bytes_base'] / 1e6:.1f} MB -> "
            f"{d['device_bytes_base_and_variant'] / 1e6:.1f} MB |")
    lines += ["", "weights: `load_weights` of the base vs the variant's delta over it (nothing else); daemon: "
              "`Serving.load` end to end (engine thread, KV pool, tokenizer), the variant after its base, and "
              "alone (its base loaded first as a hidden dependency). Of the daemon's variant load, building "
              "the runner (delta + KV pool) took "
              + ", ".join(f"{n}: {v['daemon']['variant_runner_s']:.2f} s" for n, v in r["variants"].items()) + "."]
    lines += ["", "bytes read by the variant load from the base's files: "
              + ", ".join(f"{n}: {v['weights']['base_bytes_read_by_variant']}" for n, v in r["variants"].items())
              + "; base weights shared by object with the variant's engine: "
              + ", ".join(f"{n}: {v['daemon']['same_weights_object']}" for n, v in r["variants"].items())
              + "; largest logit change the adapter makes: "
              + ", ".join(f"{n}: {v['max_logit_change']:.2f}" for n, v in r["variants"].items()) + ".",
              "", f"Reading the base's safetensors with read(2): {r['raw_read_s']['dropped']:.2f} s with the page cache "
              f"dropped, {r['raw_read_s']['cached']:.2f} s cached (a shared VM disk; timings vary run to run).",
              "", f"{r['date']}, {r['threads']} threads; {r['method']}.", ""]
    return "\n".join(lines)
