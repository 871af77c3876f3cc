"""A torch profiler trace of a timed forward, as a Chrome trace file (docs/GUIDE.md, `--profile`).
The runs traced come after the timed ones, never among them (the profiler's cost per operator
would land in the latencies), and are the very callable that was timed.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from tracekit.graphs.device import DeviceBackend
from tracekit.outputs import atomic_path

TRACE_SUFFIX = ".trace.json"


def trace_calls(
    fn: Callable[[], Any],
    count: int,
    backend: DeviceBackend,
    path: str | Path,
    before: Callable[[], Any] | None = None,
) -> str:
    """Run `before(); fn()` `count` times under the torch profiler (CPU, plus CUDA kernels on a
    CUDA device), each run a labelled range; write the Chrome trace to `path` atomically and
    return the path written."""
    activities = [ProfilerActivity.CPU]
    if backend.name == "cuda":
        activities.append(ProfilerActivity.CUDA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as profiler:
        for run in range(count):
            if before is not None:
                before()
            with record_function(f"tracekit forward {run}"):
                fn()
            backend.synchronize()
    with atomic_path(path) as partial:
        profiler.export_chrome_trace(str(partial))
    return str(path)


def trace_path(prefix: str | Path | None, mode: str) -> Path | None:
    """Where the trace of `mode` goes for a replay whose traces start with `prefix` (None: no
    tracing)."""
    return None if prefix is None else Path(f"{prefix}.{mode}{TRACE_SUFFIX}")
