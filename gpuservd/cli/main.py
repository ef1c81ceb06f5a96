"""`gpuserv`: the command line. Thin commands that hand off to the layer below.

Nothing heavy is imported at module level (no torch, no engine) so `gpuserv
--help` and the store commands answer at once; commands that run a model
import the engine inside the function. A UserError becomes one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from gpuservd.cli import bench_cmds, daemon_cmds, doctor_cmd, plan_cmd, record_cmd, remote, store_cmds, top_cmd
from gpuservd.cli.chat_loop import chat_loop
from gpuservd.config import load_config
from gpuservd.errors import UserError

app = typer.Typer(
    help="gpuserv: a single-node model-serving daemon and its tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(store_cmds.app, name="models")
daemon_cmds.register(app, store_cmds.app)
top_cmd.register(app)
app.add_typer(bench_cmds.app, name="bench")
doctor_cmd.register(app)
record_cmd.register(app)
plan_cmd.register(app)

ConfigOpt = typer.Option(None, "--config", "-c", help="Engine config YAML, with --local (the daemon reads the same file).")
LocalOpt = typer.Option(False, "--local", help="Run an in-process engine instead of asking the daemon.")


def _remote_params(max_tokens, temperature, top_p, top_k, seed, stop, config) -> dict:
    if config is not None:
        raise UserError("--config applies to --local runs; the daemon reads its own config")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k or None,
            "seed": seed, "stop": list(stop) if stop else None}


@app.command()
def pull(
    name: str = typer.Argument(..., help="Model to fetch into the store (known: smollm2)."),
    force: bool = typer.Option(False, "--force", help="Convert again even if the model is in the store."),
) -> None:
    """Fetch a known model and convert it into the model store."""
    store_cmds.pull_command(name, force)


def _sampling(max_tokens, temperature, top_p, top_k, seed, stop, schema: dict | None = None,
              logprobs: int | None = None):
    from gpuservd.engine.request import GuidedSpec, SamplingParams  # the engine (torch) only for --local

    guided = GuidedSpec("json_schema", json.dumps(schema), "--json-schema") if schema is not None else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=list(stop or []),
        logprobs=logprobs, guided=guided,
    )
    params.validate()
    return params


def _read_schema(path: Optional[Path]) -> dict | None:
    """The JSON schema in --json-schema FILE, or a one-line error naming the flag."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"--json-schema: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--json-schema: {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError(f"--json-schema: {path} must hold a JSON schema (an object)")
    return schema


def _engine(model: str, config: Optional[Path]):
    from gpuservd.engine.engine import LLMEngine  # the engine (torch) only for --local

    cfg = load_config(config)
    cfg.model = model
    return LLMEngine.from_store(model, cfg)


def _one_shot_engine(model: str, config: Optional[Path], encode, max_tokens: int):
    """(engine, prompt ids) for one request: unless the config sets engine.kv_cache_bytes, the KV pool holds
    what this request needs (its prompt plus max_tokens), not the daemon's share of the device budget
    (2.4 GB for a 135M model)."""
    from gpuservd.engine.engine import LLMEngine  # the engine (torch) only for --local
    from gpuservd.engine.tokenizer import load_tokenizer
    from gpuservd.kv_cache.cache import cache_shape
    from gpuservd.runner.model_config import load_arch
    from gpuservd.runner.model_runner import DTYPES
    from gpuservd.store.store import ModelStore

    cfg = load_config(config)
    cfg.model = model
    info = ModelStore().check(model)  # names the exact missing or damaged file before any load
    tokenizer = load_tokenizer(info.path)
    ids = encode(tokenizer)
    if cfg.kv_cache_bytes is None:
        shape = cache_shape(load_arch(info.path), cfg.block_size, DTYPES[cfg.dtype])
        cfg.kv_cache_bytes = -(-(len(ids) + max_tokens) // cfg.block_size) * shape.bytes_per_block
    return LLMEngine(model, info.path, cfg, tokenizer=tokenizer), ids


def _print_stream(engine, request_id, ids, params, logprobs: list | None = None) -> object:
    """Stream one request's text to stdout; its sampler.TokenLogprobs go into `logprobs` when given."""
    last = None
    for out in engine.stream(request_id, ids, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if logprobs is not None:
            logprobs += out.logprobs or []
        last = out
    sys.stdout.write("\n")
    sys.stdout.flush()
    return last


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (sent as a user message through the chat template)."),
    model: str = typer.Option("smollm2", "--model", "-m", help="Model name in the store."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="New tokens at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, without the chat template."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="A JSON schema file the reply must follow."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Print each token's logprob and the N most "
                                           "likely alternatives to stderr (chat: up to 20, --raw: up to 5)."),
    config: Optional[Path] = ConfigOpt,
    local: bool = LocalOpt,
    socket: Optional[Path] = daemon_cmds.SocketOpt,
) -> None:
    """Generate a reply through the daemon (or in-process with --local), streaming it to the terminal."""
    schema = _read_schema(json_schema)
    if not local:
        params = _remote_params(max_tokens, temperature, top_p, top_k, seed, stop, config)
        remote.generate_remote(socket, model, prompt, raw, params, schema, logprobs)
        return
    from gpuservd.engine.tokenizer import encode_chat, encode_raw  # the engine (torch) only for --local

    params = _sampling(max_tokens, temperature, top_p, top_k, seed, stop, schema, logprobs)

    def encode(tok):
        return encode_raw(tok, prompt) if raw else encode_chat(tok, [{"role": "user", "content": prompt}])

    engine, ids = _one_shot_engine(model, config, encode, max_tokens)
    tok = engine.tokenizer
    entries: list = []
    last = _print_stream(engine, "generate-0", ids, params, entries)
    if logprobs is not None:
        text = lambda t: tok.decode([t])  # noqa: E731
        remote.print_logprobs([(text(e.token_id), e.logprob, [(text(t), v) for t, v in e.top]) for e in entries])
    if last is not None:
        typer.echo(f"[{last.num_output_tokens} tokens, finish: {last.finish_reason.value}]", err=True)


@app.command()
def chat(
    model: str = typer.Option("smollm2", "--model", "-m", help="Model name in the store."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t"),
    system: Optional[str] = typer.Option(None, "--system", help="A system message for the conversation."),
    config: Optional[Path] = ConfigOpt,
    local: bool = LocalOpt,
    socket: Optional[Path] = daemon_cmds.SocketOpt,
) -> None:
    """Chat with a model through the daemon, or in-process with --local (/reset clears, Ctrl-D quits)."""
    if not local:
        params = _remote_params(max_tokens, temperature, 1.0, 0, None, None, config)
        remote.chat_remote(socket, model, system, params)
        return
    from gpuservd.engine.tokenizer import encode_chat  # the engine (torch) only for --local

    params = _sampling(max_tokens, temperature, 1.0, 0, None, None)
    engine = _engine(model, config)
    typer.echo(f"chatting with {model}; /reset clears the history, Ctrl-D quits", err=True)
    turns = iter(range(1, 1 << 62))

    def reply(history):
        ids = encode_chat(engine.tokenizer, history)
        return (out.new_text for out in engine.stream(f"chat-{next(turns)}", ids, params))

    chat_loop(model, system, reply)


def main() -> None:
    """Entry point: run the Typer app, turning user mistakes into one-line errors.

    Standalone mode lets click report its own usage errors (a missing argument,
    a bad option) as a usage line and exit 2; our UserErrors pass through it.
    """
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
