"""A short run of tools/fuzz_bundle.py (the long runs are by hand): mutated bundles through the
public API and `tracekit inspect --verify` give only clean refusals or correct reads."""

import os
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
    assert set(counts) >= {"refused", "read", "foreign", "different-data", "hidden-bytes", "bad-header", "timeout", "memory"}
    assert counts["refused"] + counts["read"] + counts["slow"] == 60
    assert counts["refused"] > 0 and counts["read"] > 0  # both outcomes are exercised


# Issue 18's header and frame-extent checks, taken out again in the fuzzer's worker processes
# (Python imports sitecustomize at start-up, before the worker imports tracekit).
UNDO_THE_CHECKS = """
import tracekit.format.codec as codec
import tracekit.format.reader as reader

real_check_plain = reader.check_plain
reader.check_plain = lambda obj: set() if isinstance(obj, dict) and "magic" in obj else real_check_plain(obj)
reader.BundleReader._check_header_fields = lambda self: None
codec.frame_end = len
"""


def test_a_short_fuzz_run_finds_the_header_and_frame_end_checks_missing(tmp_path):
    """The header mutations reach the header checks, and the frame padding the extent check:
    without those checks a short run of fixed cases reports bad-header and hidden-bytes cases
    (and exits 1), so the clean run above means something."""
    (tmp_path / "sitecustomize.py").write_text(UNDO_THE_CHECKS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(TOOL), "--cases", "300", "--seconds", "240", "--seed", "11"],
                            capture_output=True, text=True, timeout=300, env=env)
    counts = {name: int(count) for name, count in re.findall(r"^  ([a-z-]+) +(\d+)", result.stdout, re.MULTILINE)}
    assert result.returncode == 1, result.stdout + result.stderr
    assert counts["bad-header"] > 0 and counts["hidden-bytes"] > 0, result.stdout
