"""`gpuserv plan [--hardware NAME] [--profile FILE] [--json]`: the SM partitions and memory quotas.

FILE is YAML with a `sharing:` section. A file holding only that section plans exactly the models
it lists, with the engine's default settings for any term it leaves out; any other file is read as a
daemon config (every section validated), whose engine settings size the terms and whose
server.models join the plan. Without --profile the daemon's own config is read
(--config / $GPUSERV_CONFIG / /etc/gpuserv/gpuserv.yaml). The hardware is --hardware, else
sharing.hardware, else (hardware: auto) the configured CUDA device itself; a CPU has no SMs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from gpuservd.config import EngineConfig, read_yaml_file
from gpuservd.errors import UserError

GB = 1e9


def load_profile(profile: Optional[Path]):
    """(sharing config, engine config, models, where, daemon config or None) from FILE or the daemon's config."""
    # only for `gpuserv plan`: the daemon's and sharing config pull the GPU backends
    from gpuservd.serving.daemon_config import daemon_config_from_dict, load_daemon_config
    from gpuservd.sharing.config import sharing_from_dict

    if profile is not None:
        where = str(profile)
        data = read_yaml_file(profile)
        if not isinstance(data, dict) or "sharing" not in data:
            raise UserError(f"{where}: no sharing: section; a plan needs "
                            "`sharing: {models: {NAME: {share: 0.4}, ...}}`")
        if set(data) == {"sharing"}:
            sharing = sharing_from_dict(data["sharing"], where)
            return sharing, EngineConfig(), list(sharing.models), where, None
        cfg = daemon_config_from_dict(data, where)
    else:
        cfg = load_daemon_config(None)
        where = str(cfg.path) if cfg.path else "the daemon config (built-in defaults)"
    sharing = cfg.sharing
    models = list(sharing.models) + [m for m in cfg.server.models if m not in sharing.models]
    return sharing, cfg.engine, models, where, cfg


def resolve_hardware(name: Optional[str], sharing, engine, cfg):
    # only for `gpuserv plan`: keeps every other command's start light
    from gpuservd.sharing.hardware import hardware_from_device, list_hardware, load_hardware

    profiles_dir = cfg.server.profiles_dir if cfg is not None else None
    name = name or (sharing.hardware if sharing.hardware != "auto" else None)
    if name:
        return load_hardware(name, profiles_dir)
    known = ", ".join(list_hardware(profiles_dir))
    if not engine.device.startswith("cuda"):
        raise UserError(f"the configured device is the CPU, which has no SMs to partition; pass --hardware NAME "
                        f"(known: {known})")
    from gpuservd.daemon.run import device_info  # imports torch: only for hardware: auto on a CUDA config

    hw = hardware_from_device(device_info(cfg), profiles_dir)
    if hw is None:
        raise UserError(f"no CUDA device is visible to read SMs from; pass --hardware NAME (known: {known})")
    return hw


def _gb(n) -> str:
    return "?" if n is None else f"{n / GB:.1f}"


def render(plan) -> list[str]:
    """The plan as text lines: hardware, SM groups with the spare, the memory table, warnings."""
    hw = plan.hardware
    lines = []
    if hw is not None:
        g = hw.granularity
        bw = f", {hw.mem_bw_bytes_per_s / 1e12:.2f} TB/s" if hw.mem_bw_bytes_per_s else ""
        lines.append(f"hardware  {hw.name} ({hw.description or 'device'}): {hw.num_sms} SMs, compute capability "
                     f"{hw.cc}, {_gb(hw.memory_bytes)} GB{bw}")
        lines.append(f"SM partitions (green contexts: at least {g.min_sms} SMs, steps of {g.align_sms}; "
                     f"recommended multiples of 8)")
        width = max([len(x.name) for x in plan.groups] + [5])
        lines.append(f"  {'group':<{width}}  {'share':>6}  {'ideal':>6}  {'SMs':>4}  models")
        for x in plan.groups:
            lines.append(f"  {x.name:<{width}}  {x.share * 100:5.1f}%  {x.raw_sms:6.1f}  {x.num_sms:>4}  "
                         f"{', '.join(x.models)}")
        lines.append(f"  {'spare':<{width}}  {'':>6}  {'':>6}  {plan.spare_sms:>4}  (elastic buffer)")
    if plan.quotas:
        headroom = next(iter(plan.quotas.values())).headroom
        lines.append(f"memory quotas (GB; quota = need x {1 + headroom:.2f})")
        width = max([len(n) for n in plan.quotas] + [5])
        lines.append(f"  {'model':<{width}}  {'weights':>7}  {'kv_peak':>7}  {'activ.':>7}  {'overhead':>8}  "
                     f"{'need':>6}  {'quota':>6}  per card")
        for n, q in plan.quotas.items():
            fits = plan.fits.get(n)
            quota = _gb(q.quota) + ("*" if q.fixed else "")
            lines.append(f"  {n:<{width}}  {_gb(q.weights):>7}  {_gb(q.kv_peak):>7}  {_gb(q.activations):>7}  "
                         f"{_gb(q.overhead):>8}  {_gb(q.need):>6}  {quota:>6}  {'' if fits is None else fits}")
        if plan.memory_bytes is not None:
            verdict = "fits" if plan.memory_fits else "does not fit at once"
            lines.append(f"  total quota {_gb(plan.quota_total)} GB of {_gb(plan.memory_bytes)} GB: {verdict}")
        estimated = sorted({t for q in plan.quotas.values() for t, s in q.sources.items() if s == "estimate"})
        if estimated:
            lines.append(f"  estimated from the model's shape and the token budget: {', '.join(estimated)}")
        if any(q.fixed for q in plan.quotas.values()):
            lines.append("  * fixed by memory_quota_bytes")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return lines


def plan(
    hardware: Optional[str] = typer.Option(None, "--hardware", help="A profile in profiles/hardware/ (a100, h100, "
                                           "h200, l40s, ...); default: sharing.hardware, else the CUDA device."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="YAML with a sharing: section (a daemon config "
                                           "works); default: the daemon's config."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Plan SM partitions per model group and per-model memory quotas."""
    # only for `gpuserv plan`: keeps every other command's start light
    from gpuservd.sharing.planner import plan as make_plan

    sharing, engine, models, where, cfg = load_profile(profile)
    if not models or not sharing.models:
        raise UserError(f"{where} lists no models under sharing.models; write e.g. `sharing: {{models: "
                        "{chat: {share: 0.4}, classifier: {share: 0.35, group: batch}}}` "
                        "(or try --profile profiles/sharing/seed-a100.yaml)")
    hw = resolve_hardware(hardware, sharing, engine, cfg)
    try:
        result = make_plan(sharing, hw, models, engine=engine)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo("\n".join(render(result)))


def register(app: typer.Typer) -> None:
    app.command()(plan)
