"""`gpuserv bench`: one workload on gpuserv and on its peers, in one run, one report."""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

from gpuservd.errors import UserError

PEERS = ("hf_static", "hf_continuous")


def parse_peers(value: str) -> list[str]:
    """'hf_static,hf_continuous' | 'none' -> a list of peer names (UserError on unknown ones)."""
    if value.strip() == "none":
        return []
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad or not names:
        what = ", ".join(bad) if bad else repr(value)
        raise UserError(f"--peers: unknown peer {what}; choose from {', '.join(PEERS)} or none")
    return names


def run_bench(workload_path: Path, config_path: Path | None, peers: list[str], out_dir: Path | None,
              model: str | None = None, log=print) -> dict:
    """Run the workload on gpuserv, measure the decode floor, run the peers, write the report."""
    from gpuservd.bench.engine_run import batch1_decode_step_s, run_gpuserv
    from gpuservd.bench.floor import ForeignLoad, floor_summary, measure_read_bandwidth, weight_bytes_per_decode_step
    from gpuservd.bench.report import write_report
    from gpuservd.bench.workload import load_workload
    from gpuservd.config import load_config
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.store.store import ModelStore

    workload = load_workload(workload_path)
    cfg = load_config(config_path)
    cfg.model = model or workload.model
    store = ModelStore()
    model_dir = store.path(cfg.model)
    out_dir = out_dir or Path("bench/runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{workload.name}"

    import torch

    threads = cfg.num_threads or torch.get_num_threads()
    # Measured before anything else is allocated: inside a process that already holds the
    # engine, the same probe read 58 GB/s against 29-32 GB/s in a fresh one on this machine
    # (where the 1 GiB lands in memory changes it); the fresh figure is the conservative floor.
    bandwidth = measure_read_bandwidth(threads)
    log(f"loading {cfg.model} ({cfg.dtype}) from {model_dir}")
    t_load = time.perf_counter()
    engine = LLMEngine(cfg.model, model_dir, cfg)
    load_s = time.perf_counter() - t_load
    tok = engine.tokenizer
    requests = workload.materialize(len(tok), sorted(engine.eos_token_ids), tokenize=lambda s: tok.encode(s))
    for r in requests:
        if len(r.prompt_token_ids) + r.output_tokens > engine.max_model_len:
            raise UserError(f"{workload_path}: request {r.request_id} needs more than the context {engine.max_model_len}")
    log(f"gpuserv: {len(requests)} requests, {threads} threads (engine loaded in {load_s:.2f} s)")
    with ForeignLoad() as load:
        run = run_gpuserv(engine, requests)
    run.extra["foreign_cpu_share"] = load.share
    run.extra["engine_load_s"] = load_s
    runs = [run]
    log(f"  {run.generated_tokens / run.wall_s:.1f} tok/s, wall {run.wall_s:.1f} s")

    step_s = batch1_decode_step_s(engine)
    arch_cfg = json.loads((model_dir / "config.json").read_text())
    dtype_bytes = torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    floor = floor_summary(weight_bytes_per_decode_step(arch_cfg, dtype_bytes), bandwidth, step_s)
    log(f"  batch-1 decode step {1000 * step_s:.1f} ms; floor {floor['floor_step_ms']:.1f} ms")
    del engine
    gc.collect()

    for peer in peers:
        from gpuservd.bench import peers as peer_mod

        log(f"{peer}: running")
        fn = getattr(peer_mod, f"run_{peer}")
        prun = fn(model_dir, requests, dtype=cfg.dtype, max_num_seqs=cfg.scheduler.max_num_seqs, num_threads=threads)
        runs.append(prun)
        log(f"  {prun.generated_tokens / prun.wall_s:.1f} tok/s, wall {prun.wall_s:.1f} s")
        gc.collect()

    config = dataclasses.asdict(cfg)
    config["num_threads"] = threads
    result = write_report(out_dir, workload, runs, floor, config)
    log(f"wrote {out_dir}/result.json, result.md, latency_cdf.png")
    return result
