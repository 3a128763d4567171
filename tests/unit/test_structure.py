"""The house rules a reader relies on, measured: no source file over 400 lines, no function
over 50, and no dead code (vulture at 80% confidence, with tests/vulture_whitelist.py holding
the names an interface requires)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "meshforge"
MAX_FILE, MAX_FUNCTION = 400, 50


def sizes() -> tuple[list[str], list[str]]:
    files, functions = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE:
            files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    return files, functions


def test_no_file_over_400_lines_and_no_function_over_50():
    files, functions = sizes()
    assert files == [] and functions == []


def test_no_dead_code():
    # this interpreter's module, the one run below: a vulture on PATH may belong to another
    # environment (the compat venv of .ci/compat beside the system's)
    if importlib.util.find_spec("vulture") is None:
        pytest.skip("vulture is not installed (pip install '.[test]')")
    whitelist = ROOT / "tests" / "vulture_whitelist.py"
    cmd = [sys.executable, "-m", "vulture", str(SRC), str(whitelist), "--min-confidence", "80"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "", r.stdout


def test_test_files_have_names_of_their_own_across_the_tiers():
    """pytest imports tests/unit/x.py and tests/integration/x.py as the same module: one of them
    would not even be collected ("import file mismatch")."""
    names = [p.name for tier in ("unit", "integration") for p in (ROOT / "tests" / tier).glob("test_*.py")]
    assert len(names) > 80 and len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
