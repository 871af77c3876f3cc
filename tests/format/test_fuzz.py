"""A short run of tools/fuzz_bundle.py (the long runs are by hand): mutated bundles through the
public API and `tracekit inspect --verify` give only clean refusals or correct reads."""

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fuzz_bundle.py"


def test_a_short_fuzz_run_finds_nothing():
    # 60 cases of a fixed seed: a few seconds on an idle 2-core machine; the cases (and so their
    # outcomes) are the same every run, whatever the machine's speed
    result = subprocess.run([sys.executable, str(TOOL), "--cases", "60", "--seconds", "240", "--seed", "11"],
                            capture_output=True, text=True, timeout=300)
    counts = {name: int(count) for name, count in re.findall(r"^  ([a-z-]+) +(\d+)", result.stdout, re.MULTILINE)}
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(counts) >= {"refused", "read", "foreign", "different-data", "timeout", "memory"}
    assert counts["refused"] + counts["read"] + counts["slow"] == 60
    assert counts["refused"] > 0 and counts["read"] > 0  # both outcomes are exercised
