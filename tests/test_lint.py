"""The linter configured in pyproject.toml (ruff: imports, unused names, bugbear) finds nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install 'tracekit[test]')")
    finished = subprocess.run([ruff, "check", "tracekit", "tests", "tools"], cwd=ROOT, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout + finished.stderr


def test_every_name_tools_import_from_tracekit_exists():
    """The benchmarks and generators under tools/ run by hand, so no test runs their `main()`: a
    name they import from tracekit inside it that was renamed would only fail there (a stale
    import kept `bench_window.py` from running)."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tracekit")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.name}: from {node.module} import {alias.name}")
    assert not missing, missing
