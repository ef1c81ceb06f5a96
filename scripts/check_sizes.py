"""Report Python files over 500 lines and functions over 80 lines (the project's size limits).

    python scripts/check_sizes.py [DIR ...]      # default: gpuservd console; exit 1 when any is over

A function's length counts its whole body, nested functions included (a closure that holds ten
route handlers is one long function to a reader). tests/test_code_size.py runs the same check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(root: Path, base: Path | None = None) -> list[tuple[str, str, int]]:
    """(path relative to base, "file" or the function's qualified name, lines) for each one over a limit."""
    base = base or root.parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(base).as_posix()
        text = path.read_text()
        num_lines = len(text.splitlines())
        if num_lines > MAX_FILE_LINES:
            found.append((rel, "file", num_lines))
        for qualname, node in _functions(ast.parse(text)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((rel, qualname, length))
    return found


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")


def main(argv: list[str]) -> int:
    repo = Path(__file__).resolve().parent.parent
    dirs = [Path(a).resolve() for a in argv] or [repo / "gpuservd", repo / "console"]
    found = [f for d in dirs for f in oversized(d, repo)]
    for rel, what, n in found:
        limit = MAX_FILE_LINES if what == "file" else MAX_FUNCTION_LINES
        print(f"{rel}: {what} has {n} lines (limit {limit})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
