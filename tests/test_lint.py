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
