"""Issue 48's bars, measured in one run: the structural ones are tests (each named here and run),
the size of tracekit/ is a measure against the 20.2k lines it had when the issue was filed
(4c77b45), printed rather than asserted — it is a direction, not a gate CI can hold.

    python tools/code_bars.py          # prints each bar and whether it holds; exit 1 if a test fails
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINES_WHEN_FILED = 20_243  # `wc -l` of tracekit/**/*.py at 4c77b45

# bar -> the test that holds it
TESTED_BARS = {
    "0 upward imports": "tests/test_layering.py::test_no_import_runs_up_the_layers",
    "no `window is` branch outside the sequence code": "tests/test_one_sequence_path.py",
    "no string-key read of vLLM's records outside records/ and releases/":
        "tests/test_layering.py::test_recorded_vllm_objects_are_read_by_attribute_outside_their_records",
    "record/ and replay/ reach vLLM through one seam each": "tests/test_layering.py::test_a_layer_reaches_vllm_through_one_seam",
    "README <= 250 lines": "tests/test_docs.py",
    "largest cli/ function <= 60 lines": "tests/cli/test_arguments.py",
    "every Release base hook overridden or named a shared default": "tests/test_release_hooks.py",
}


def package_lines() -> int:
    return sum(len(path.read_text().splitlines()) for path in (ROOT / "tracekit").rglob("*.py"))


def main() -> int:
    failed = 0
    for bar, test in TESTED_BARS.items():
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                             cwd=ROOT, capture_output=True, text=True)
        failed += run.returncode != 0
        print(f"{'holds' if run.returncode == 0 else 'FAILS'}  {bar}  ({test})")
    lines = package_lines()
    print(f"{'holds' if lines < LINES_WHEN_FILED else 'above'}  tracekit/ is {lines} lines "
          f"({lines / LINES_WHEN_FILED:.3f}x the {LINES_WHEN_FILED} it had when issue 48 was filed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
