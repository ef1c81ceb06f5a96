"""`gpuserv systemd install [--user]`: write the unit files (gpuservd.daemon.systemd_units renders them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from gpuservd.daemon import systemd_units
from gpuservd.errors import UserError

app = typer.Typer(help="systemd unit files.", no_args_is_help=True, add_completion=False)


def _gpuservd_path() -> str:
    here = Path(sys.executable).parent / "gpuservd"
    found = shutil.which("gpuservd")
    if here.exists():
        return str(here)
    return found or f"{sys.executable} -m gpuservd.daemon"


@app.command("install")
def systemd_install(
    user: bool = typer.Option(False, "--user", help="Install user units (~/.config/systemd/user)."),
    dest: Optional[Path] = typer.Option(None, "--dest", help="Directory to write to (default: /etc/systemd/system, "
                                        "or ~/.config/systemd/user with --user)."),
    exec_path: Optional[str] = typer.Option(None, "--exec", help="ExecStart command (default: this "
                                            "installation's gpuservd)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the units instead of writing them."),
) -> None:
    """Write gpuservd.service and gpuservd.socket (and, for the system, the gpuserv user's sysusers file)."""
    exec_path = exec_path or _gpuservd_path()
    files = {"gpuservd.service": systemd_units.service(exec_path, user), "gpuservd.socket": systemd_units.socket_unit(user)}
    if dry_run:
        for name, text in files.items():
            typer.echo(f"# ---- {name}\n{text}")
        return
    default_dest = Path("~/.config/systemd/user").expanduser() if user else Path("/etc/systemd/system")
    target = dest or default_dest
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (target / name).write_text(text)
        sysusers = None
        if not user:
            sysusers = (target / "gpuserv.sysusers.conf") if dest else Path("/etc/sysusers.d/gpuserv.conf")
            sysusers.parent.mkdir(parents=True, exist_ok=True)
            sysusers.write_text(systemd_units.SYSUSERS)
    except PermissionError as exc:
        raise UserError(f"cannot write {exc.filename}: permission denied (run with sudo, or use --user)") from None
    typer.echo(f"wrote {', '.join(str(target / n) for n in files)}" + (f" and {sysusers}" if sysusers else ""))
    if dest is None and not user and shutil.which("systemd-sysusers"):
        subprocess.run(["systemd-sysusers", str(sysusers)], check=False)
    ctl = "systemctl --user" if user else "systemctl"
    typer.echo(f"next: {ctl} daemon-reload && {ctl} enable --now gpuservd.socket gpuservd.service")
