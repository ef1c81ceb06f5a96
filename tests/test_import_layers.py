"""Imports go one way (DESIGN.md, "Layers"): the import-linter contracts in .importlinter hold, and
every import inside a function says why it is lazy.

The contracts are checked on the source, lazy (function-level) imports included; the console's and
the CLI's run-time lightness (no torch in sys.modules) is checked by test_console_pilot.py and
test_cli.py."""

from __future__ import annotations

import configparser
import importlib.util
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


_spec = importlib.util.spec_from_file_location("check_lazy_imports", ROOT / "scripts" / "check_lazy_imports.py")
check_lazy_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lazy_imports)


def test_every_lazy_import_says_why():
    """An import inside a function carries a comment saying why it is not at the top (start-up time, an
    optional dependency, a module that must stay free of torch); scripts/check_lazy_imports.py lists them."""
    runs = [r for d in ("gpuservd", "console") for r in check_lazy_imports.lazy_imports(ROOT / d, ROOT)]
    assert runs, "the checker found no lazy imports at all: it is not looking"
    assert [(rel, line) for rel, line, _, explained in runs if not explained] == []


def test_the_lazy_import_checker_finds_an_unexplained_one(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os\n\n\ndef f():\n    x = 1\n    import json\n    import re\n    return x\n\n\n"
                              "def g():\n    try:\n        import torch  # optional: only some machines have it\n"
                              "    except ImportError:\n        pass\n")
    runs = check_lazy_imports.lazy_imports(pkg, tmp_path)
    assert runs == [("pkg/m.py", 6, 2, False), ("pkg/m.py", 13, 1, True)]
