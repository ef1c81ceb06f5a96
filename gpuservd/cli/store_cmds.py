"""`gpuserv models ...` and `gpuserv pull`: thin commands over gpuservd.store.

The main CLI mounts `app` as `gpuserv models` and calls `pull_command` for
`gpuserv pull NAME`. Errors are raised as UserError; the main CLI prints them on
one line and exits 2. Nothing heavy is imported at module level: numpy, gguf and
transformers load only inside a pull.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from gpuservd.config import load_config
from gpuservd.errors import StoreCorrupt
from gpuservd.store.store import ModelInfo, ModelStore

app = typer.Typer(help="Manage the local model store.", no_args_is_help=True, add_completion=False)


def _console() -> Console:
    # Built per call so tests' captured stdout (CliRunner) is the one written to.
    return Console(highlight=False, soft_wrap=True)


def format_count(n: int) -> str:
    """134515008 -> '134.5M'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    """538090408 -> '538.1 MB' (decimal units, as `ls -h --si` and package sizes use)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def info_to_dict(info: ModelInfo) -> dict:
    """A ModelInfo as JSON-ready data (path as a string)."""
    data = asdict(info)
    data["path"] = str(info.path)
    return data


@app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the models in the store."""
    store = ModelStore()
    infos = store.list()
    if as_json:
        typer.echo(json.dumps([info_to_dict(i) for i in infos], indent=2))
        return
    console = _console()
    if not infos:
        console.print(f"No models in {store.root}. Run `gpuserv pull smollm2` to fetch the default model.",
                      markup=False)
        return
    table = Table(title=f"models in {store.root}")
    for column in ("name", "architecture", "parameters", "dtype", "on disk", "layers"):
        table.add_column(column, justify="right" if column in ("parameters", "on disk", "layers") else "left")
    for info in infos:
        architecture = f"DAMAGED: {info.error}" if info.error else info.architecture
        if info.base and not info.error:
            architecture += f" ({info.variant_kind} over {info.base})"
        table.add_row(info.name, architecture, format_count(info.num_parameters), info.dtype,
                      format_bytes(info.bytes_on_disk), str(info.num_layers))
    console.print(table)


@app.command("import")
def import_cmd(
    path: Path = typer.Argument(..., help="A local Hugging Face model directory (Llama, Mistral or Qwen2)."),
    name: str = typer.Option(..., "--name", "-n", help="Name in the store: [a-z0-9][a-z0-9._-]*."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing model of that name."),
) -> None:
    """Copy a local Hugging Face model directory into the store."""
    info = ModelStore().import_dir(path, name, overwrite=overwrite)
    _console().print(f"imported {info.name}: {info.architecture}, {format_count(info.num_parameters)} "
                     f"parameters, {info.dtype}, {format_bytes(info.bytes_on_disk)} at {info.path}", markup=False)


@app.command("derive")
def derive(
    name: str = typer.Argument(..., help="Name of the new variant: [a-z0-9][a-z0-9._-]*."),
    base: str = typer.Option(..., "--base", "-b", help="The full model in the store it is derived from."),
    adapter: Path = typer.Option(..., "--adapter", "-a", help="A PEFT LoRA adapter directory (adapter_config.json "
                                 "+ adapter_model.safetensors) or a full-rank delta (delta_model.safetensors)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing model of that name."),
) -> None:
    """Register a variant: a base model plus a LoRA adapter or full-rank delta (only the delta is stored)."""
    info = ModelStore().derive(name, base, adapter, overwrite=overwrite)
    _console().print(f"derived {info.name}: {info.variant_kind} over {info.base}, {format_count(info.num_parameters)} "
                     f"delta parameters, {info.dtype}, {format_bytes(info.bytes_on_disk)} at {info.path}", markup=False)


@app.command("make-adapter")
def make_adapter_cmd(
    base: str = typer.Option(..., "--base", "-b", help="The model in the store the adapter is shaped for."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write the adapter into."),
    kind: str = typer.Option("lora", "--kind", help="lora (PEFT layout) or delta (full rank)."),
    rank: int = typer.Option(8, "--rank", "-r", help="LoRA rank."),
    alpha: float = typer.Option(16.0, "--alpha", help="LoRA alpha (scale = alpha / rank)."),
    targets: str = typer.Option("q_proj,k_proj,v_proj,o_proj", "--targets",
                                help="Comma list of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    std: float = typer.Option(0.02, "--std", help="Standard deviation of B (LoRA) or dW (delta)."),
) -> None:
    """Write a random test adapter for a store model (random B, unlike PEFT's zero init, so it changes the model)."""
    from gpuservd.weights.delta import make_adapter  # torch: only for this command

    store = ModelStore()
    path = make_adapter(store.base_dir(base), out, kind=kind, rank=rank, alpha=alpha,
                        targets=tuple(t.strip() for t in targets.split(",") if t.strip()), seed=seed, std=std)
    _console().print(f"wrote a random {kind} adapter for {base} to {path}; register it with "
                     f"`gpuserv models derive NAME --base {base} --adapter {path}`", markup=False)


@app.command("rm")
def rm(name: str = typer.Argument(..., help="The model to delete.")) -> None:
    """Delete a model from the store."""
    store = ModelStore()
    path = store.path(name)
    store.remove(name)
    _console().print(f"removed {name} ({path})", markup=False)


def int8_section(model_dir: Path, name: str, measure: bool, config: Path | None) -> dict:
    """The model's INT8 file and how well it keeps the model's answers (stored by the last measurement;
    measured now with --int8-agreement). torch loads only here: `gpuserv --help` stays light."""
    from gpuservd.weights.int8_file import FORMAT, int8_format, int8_path, read_agreement  # torch: here only

    if measure:
        from gpuservd.engine.agreement import measure_int8  # the engine: only with --int8-agreement

        measure_int8(name, model_dir, load_config(config))
    path = int8_path(model_dir)
    if not path.exists():
        return {"file": None, "agreement": None}
    try:
        fmt = int8_format(path)
    except Exception as exc:
        fmt = f"unreadable ({exc})"
    current = fmt == FORMAT
    return {"file": str(path), "bytes": path.stat().st_size, "format": fmt or "1 (per-row)", "current": current,
            "agreement": read_agreement(model_dir) if current else None}


def _int8_line(sec: dict, name: str) -> str:
    if sec["file"] is None:
        return f"none yet (written on the first int8 load; measure with gpuserv models show {name} --int8-agreement)"
    head = f"{format_bytes(sec['bytes'])}, format {sec['format']}" + ("" if sec["current"] else " (remade on next use)")
    a = sec["agreement"]
    if a is None:
        return f"{head}; agreement not measured (gpuserv models show {name} --int8-agreement)"
    from gpuservd.engine.agreement import summary_line  # the engine (torch): only when one was measured

    return f"{head}; {summary_line(a)}"


@app.command("show")
def show(
    name: str = typer.Argument(..., help="The model to describe."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    int8_agreement: bool = typer.Option(False, "--int8-agreement",
                                        help="Measure the INT8 weights against full precision now (and store it)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Engine config for the measurement (dtype)."),
) -> None:
    """Show one model's metadata, whether its files are sound, and how well its INT8 weights keep its answers."""
    store = ModelStore()
    info = store.entry(name)
    try:
        store.check(name)
        status = "ok"
    except StoreCorrupt as exc:
        status = f"DAMAGED: {exc}"
    data = info_to_dict(info)
    data["check"] = status
    data["int8"] = int8_section(info.path, name, int8_agreement, config)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    console = _console()
    data["num_parameters"] = f"{info.num_parameters} ({format_count(info.num_parameters)})"
    data["bytes_on_disk"] = f"{info.bytes_on_disk} ({format_bytes(info.bytes_on_disk)})"
    data.pop("error")
    data["int8"] = _int8_line(data["int8"], name)
    width = max(len(k) for k in data)
    for key, value in data.items():
        console.print(f"{key:<{width}}  {value}", markup=False)


def pull_command(name: str, force: bool) -> None:
    """`gpuserv pull NAME [--force]`: fetch a known model (only smollm2) into the store."""
    from gpuservd.store.pull import pull  # keeps `gpuserv --help` free of the pull machinery

    console = _console()
    info = pull(name, force=force, progress=lambda line: console.print(line, markup=False))
    console.print(f"{info.name}: {info.architecture}, {format_count(info.num_parameters)} parameters, "
                  f"{info.dtype}, {format_bytes(info.bytes_on_disk)}", markup=False)
