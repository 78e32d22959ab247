"""Docstrings state the contract (shapes, dtypes, units, errors, a source); measurements and
design history live in docs/ (docs/notes/, docs/benchmarks.md). Held here as numbers: at
most 15 % of the package's lines are docstrings, and no module opens with more than 15."""
from __future__ import annotations

import ast
import pathlib

import pagedllm

ROOT = pathlib.Path(pagedllm.__file__).parent
MAX_SHARE = 0.15
MAX_MODULE_LINES = 15


def _docstrings(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield node, first.end_lineno - first.lineno + 1


def test_docstrings_are_at_most_15_percent_of_the_package():
    total = doc = 0
    long_modules = []
    for path in sorted(ROOT.rglob("*.py")):
        src = path.read_text()
        total += len(src.splitlines())
        for node, n in _docstrings(ast.parse(src)):
            doc += n
            if isinstance(node, ast.Module) and n > MAX_MODULE_LINES:
                long_modules.append(f"{path.relative_to(ROOT)} ({n} lines)")
    assert total > 10000   # the walk found the package
    assert doc / total <= MAX_SHARE, f"docstrings are {doc} of {total} lines ({doc / total:.1%})"
    assert not long_modules, f"module docstrings over {MAX_MODULE_LINES} lines: {long_modules}"
