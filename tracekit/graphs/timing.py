"""Latency statistics and the eager/compiled timer, shared by every replay mode.

All modes report the same dict (vLLM's forward-bench semantics: `iters * samples` timed runs,
median and the spread of the per-sample medians as the stability figure), so eager, compiled,
one-shot graph and piecewise numbers can be set side by side.
"""

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tracekit.graphs.device import DeviceBackend


def latency_summary(times_us: Sequence[float], samples: int, timer: str) -> dict[str, Any]:
    """Summarise `times_us` (microseconds, `samples` consecutive equal-sized groups)."""
    times = np.asarray(times_us, dtype=np.float64)
    if times.size == 0 or samples < 1 or times.size % samples:
        raise ValueError(f"{times.size} timings cannot be split into {samples} equal samples")
    sample_medians = np.median(times.reshape(samples, -1), axis=1)
    median = float(np.median(times))
    return {
        "timer": timer,
        "median": median,
        "sample_spread_pct": float(
            100 * (sample_medians.max() - sample_medians.min()) / max(median, 1e-12)
        ),
        "mean": float(times.mean()),
        "std": float(times.std()),
        "min": float(times.min()),
        "p90": float(np.percentile(times, 90)),
        "count": int(times.size),
        "samples_us": [round(float(t), 2) for t in times],
    }


def time_callable(
    fn: Callable[[], Any],
    iters: int,
    samples: int,
    backend: DeviceBackend,
    warmup_s: float = 1.0,
    before: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Time `iters * samples` calls of `fn` after warming up for about `warmup_s` seconds.

    On a device, each call is timed by events recorded on the current stream around it (the
    device time of the call, host launch gaps included), with the device idle when the first
    event is recorded — as it is when tracekit's recorder times a step in the engine, right after
    copying the step to host — so the time to launch the call's first kernel counts, as it does
    there; on CPU by `time.perf_counter`. `before` (restoring the state the forward mutates, say)
    runs ahead of every call, outside the timing.
    """
    before = before or _nothing
    warm_up(lambda: (before(), fn()), backend, warmup_s)
    count = iters * samples
    if not backend.has_device_events:
        times = []
        for _ in range(count):
            before()
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
        return latency_summary(times, samples, "perf_counter")
    start, end = backend.timing_event(), backend.timing_event()
    times = []
    for _ in range(count):
        before()
        backend.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return latency_summary(times, samples, "device_events")


def warm_up(fn: Callable[[], Any], backend: DeviceBackend, seconds: float) -> None:
    """Call `fn` until clocks and caches settle: at least twice, for about `seconds`."""
    begin = time.perf_counter()
    fn()
    backend.synchronize()
    per_call = max(time.perf_counter() - begin, 1e-6)
    for _ in range(max(1, int(seconds / per_call))):
        fn()
    backend.synchronize()


def _nothing() -> None:
    return None
