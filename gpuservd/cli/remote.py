"""`gpuserv generate`, `gpuserv chat` and `gpuserv bench --target socket` through the daemon.

The in-process variants (--local, --target inprocess) stay in gpuservd.cli.main
and gpuservd.bench; these hand off to gpuservd.api.client. When no daemon
answers, generate and chat say so on one line, with how to start one and how
to run in-process instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from gpuservd.api.client import Client, DaemonUnavailable
from gpuservd.cli.chat_loop import chat_loop
from gpuservd.errors import UserError
from gpuservd.store.store import ModelStore


def _no_daemon(exc: DaemonUnavailable) -> UserError:
    return UserError(f"{exc}; or run in-process with --local")


def print_logprobs(entries: list) -> None:
    """One line per generated token on stderr: the token, its logprob and the most likely alternatives."""
    for token, logprob, top in entries:
        alts = ", ".join(f"{json.dumps(t)} {v:.3f}" for t, v in top)
        typer.echo(f"{json.dumps(token):>16} {logprob:9.4f}" + (f"   top: {alts}" if alts else ""), err=True)


def generate_remote(socket: Optional[Path], model: str, prompt: str, raw: bool, params: dict,
                    schema: dict | None = None, logprobs: int | None = None) -> None:
    """`gpuserv generate` through the daemon: stream the reply to stdout, the token count (and the
    logprobs, when asked) to stderr. schema: a JSON schema the reply must follow."""
    params = dict(params)
    if schema is not None:
        if raw:
            params["guided_json"] = schema
        else:
            params["response_format"] = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    if logprobs is not None:
        params.update({"logprobs": logprobs} if raw else {"logprobs": True, "top_logprobs": logprobs})
    usage, finish, entries = None, None, []
    try:
        with Client(socket) as client:
            stream = (client.completion_stream(model, prompt, **params) if raw else
                      client.chat_stream(model, [{"role": "user", "content": prompt}], **params))
            for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                finish = delta.finish_reason or finish
                usage = delta.usage or usage
                entries += delta.logprobs or []
    except DaemonUnavailable as exc:
        raise _no_daemon(exc) from None
    sys.stdout.write("\n")
    if logprobs is not None:
        print_logprobs(entries)
    if usage:
        typer.echo(f"[{usage['completion_tokens']} tokens, finish: {finish}]", err=True)


def chat_remote(socket: Optional[Path], model: str, system: Optional[str], params: dict) -> None:
    """`gpuserv chat` through the daemon."""
    with Client(socket) as client:
        try:
            client.health()
        except DaemonUnavailable as exc:
            raise _no_daemon(exc) from None
        typer.echo(f"chatting with {model} through {client.where}; /reset clears the history, Ctrl-D quits", err=True)
        chat_loop(model, system, lambda history: (d.text for d in client.chat_stream(model, history, **params)))


def bench_socket(workload_path: Path, socket: Optional[Path], out_dir: Optional[Path], model: Optional[str],
                 log=print) -> dict:
    """`gpuserv bench --target socket`: the workload through a running daemon's HTTP socket, same report."""
    from gpuservd.bench.socket_run import run_socket  # numpy and the tokenizer: only for bench --target socket
    from gpuservd.bench.report import write_report
    from gpuservd.bench.workload import load_workload
    from gpuservd.engine.tokenizer import load_tokenizer

    workload = load_workload(workload_path)
    name = model or workload.model
    model_dir = ModelStore().path(name)  # the tokenizer only: prompts are sent as token ids
    tok = load_tokenizer(model_dir)
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    eos = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                  *([tok.eos_token_id] if tok.eos_token_id is not None else [])})
    requests = workload.materialize(len(tok), eos, tokenize=lambda s: tok.encode(s))
    with Client(socket) as client:
        st = client.status_dict()  # one line and exit 2 when no daemon answers
        path = client.where
    if name not in [m["name"] for m in st["models"] if m["state"] == "ready"]:
        raise UserError(f"the daemon at {path} does not serve {name}; load it: gpuserv models load {name}")
    log(f"gpuserv through {path}: {len(requests)} requests to {name}")
    run = run_socket(path, requests, name)
    if run.extra["errors"]:
        raise UserError(f"{len(run.extra['errors'])} requests failed, first: {run.extra['errors'][0]}")
    log(f"  {run.generated_tokens / run.wall_s:.1f} tok/s, wall {run.wall_s:.1f} s")
    x = run.extra
    if x.get("daemon_cpu_s_per_token") is not None:
        log(f"  CPU per streamed token: daemon {1e3 * x['daemon_cpu_s_per_token']:.3f} ms (its event loop "
            f"{1e3 * x['daemon_loop_cpu_s_per_token']:.3f} ms), client {1e3 * x['client_cpu_s_per_token']:.3f} ms")
    out_dir = out_dir or Path("bench/runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{workload.name}-socket"
    config = {"target": "socket", "socket": path, "daemon_version": st["version"], "device": st["device"],
              "threads": st["device"].get("num_threads")}
    result = write_report(out_dir, workload, [run], None, config)
    log(f"wrote {out_dir}/result.json, result.md, latency_cdf.png")
    return result
