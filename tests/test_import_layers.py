"""Imports go one way (DESIGN.md, "Layers"): the import-linter contracts in .importlinter hold.

The contracts are checked on the source, lazy (function-level) imports included; the console's and
the CLI's run-time lightness (no torch in sys.modules) is checked by test_console_pilot.py and
test_cli.py."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def test_every_import_goes_the_way_the_contracts_say():
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(CONFIG)!r}, no_cache=True))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    report = proc.stdout[proc.stdout.find("Contracts"):] + proc.stderr
    assert proc.returncode == 0, report
    assert "0 broken" in proc.stdout, report


def test_every_daemon_module_has_a_layer():
    """A module added at the gpuservd/ root must take a place in the layers, or no contract covers it."""
    cfg = configparser.ConfigParser()
    cfg.read(CONFIG)
    named = {m.strip() for line in cfg["importlinter:contract:layers"]["layers"].splitlines()
             for m in line.replace(":", "|").split("|") if m.strip()}
    here = {f"gpuservd.{p.stem}" for p in (ROOT / "gpuservd").iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert here - named == set(), "add these to the layers in .importlinter"
    assert named - here == set(), "these layers name modules that do not exist"
