"""Report imports inside functions (lazy imports) that do not say why they are lazy.

    python scripts/check_lazy_imports.py [DIR ...]   # default: gpuservd console; exit 1 when any is unexplained

Imports go at the top of a module unless there is a reason (start-up time, an optional dependency,
a module that must not load torch). A run of consecutive imports in one function body counts as
explained when a comment sits on one of its lines or on the line just above it. tests/test_import_layers.py
runs the same check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def lazy_imports(root: Path, base: Path | None = None) -> list[tuple[str, int, int, bool]]:
    """(path relative to base, first line, imports in the run, explained) for each run of lazy imports."""
    base = base or root.parent
    runs = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        rel = path.relative_to(base).as_posix()
        for run in _runs(ast.parse("\n".join(lines))):
            seg = lines[max(0, run[0].lineno - 2): run[-1].end_lineno]
            runs.append((rel, run[0].lineno, len(run), any("#" in line for line in seg)))
    return runs


def _runs(node: ast.AST, in_function: bool = False):
    """Runs of consecutive import statements in the bodies of functions (nested blocks included)."""
    for name in ("body", "orelse", "finalbody"):
        body = getattr(node, name, None)
        if not in_function or not isinstance(body, list):
            continue
        run: list[ast.stmt] = []
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                run.append(stmt)
                continue
            if run:
                yield run
            run = []
        if run:
            yield run
    for child in ast.iter_child_nodes(node):
        yield from _runs(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def main(argv: list[str]) -> int:
    repo = Path(__file__).resolve().parent.parent
    dirs = [Path(a).resolve() for a in argv] or [repo / "gpuservd", repo / "console"]
    runs = [r for d in dirs for r in lazy_imports(d, repo if d.is_relative_to(repo) else d.parent)]
    bad = [r for r in runs if not r[3]]
    for rel, line, _, _ in bad:
        print(f"{rel}:{line}: a lazy import with no comment saying why it is lazy")
    print(f"{sum(r[2] for r in runs)} lazy imports in {len(runs)} places; {len(bad)} places without a reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
