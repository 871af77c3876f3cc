"""Latency statistics and the eager/compiled timer, shared by every replay mode.

All modes report the same dict (vLLM's forward-bench semantics: `iters * samples` timed runs,
median and the spread of the per-sample medians as the stability figure), so eager, compiled,
one-shot graph and piecewise numbers can be set side by side.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.graphs.device import DeviceBackend

# What a forward time measures, by how it was taken (a bundle's `timing.forward_timer`, a timed
# mode's `latency_us.timer`).
QUEUED_DEVICE_EVENTS = "device_events_queued"  # the device's own time: the region queued ahead
DEVICE_EVENTS = "device_events"  # events around the region, the host's launch gaps inside
HOST_CLOCK = "perf_counter"  # no device events (CPU): the host clock

# The head start the first timed region gets when nothing says how long its host issue takes.
DEFAULT_HEAD_START_US = 2000.0
MAX_HEAD_START_US = 50_000.0


@dataclass(frozen=True)
class RegionTime:
    us: float  # by `timer`
    timer: str
    host_us: float  # the host's time to issue the region (on CPU: the same as `us`)


class RegionTimer:
    """Times one region of work as the recorder times the engine's model call and the replay its
    timed runs, so that the two compare (docs/GUIDE.md, "Timing", says why host launch gaps are
    left out). Where the device has a spin kernel, the start event is queued behind a spin longer
    than the host's issue of the region, so the events measure the device's own time for it
    (`QUEUED_DEVICE_EVENTS`); if the host took longer than the spin, the device may have waited on
    it inside the region (`DEVICE_EVENTS`). The spin costs the device its length, the host nothing.
    """

    def __init__(self, backend: DeviceBackend, head_start_us: float = DEFAULT_HEAD_START_US):
        self._events = None
        self._spun = backend.can_spin
        if backend.has_device_events:
            cycles = head_start_us * cycles_per_us(backend) if self._spun else 0
            self._events = tuple(backend.timing_event() for _ in range(3))
            self._events[0].record()
            if cycles:
                backend.spin(cycles)
            self._events[1].record()
        self._host_started = time.perf_counter()

    def stop(self) -> RegionTime:
        """End the region (waits for the device)."""
        if self._events is None:
            host_us = (time.perf_counter() - self._host_started) * 1e6
            return RegionTime(host_us, HOST_CLOCK, host_us)
        self._events[2].record()
        host_us = (time.perf_counter() - self._host_started) * 1e6
        self._events[2].synchronize()
        spin_us = self._events[0].elapsed_time(self._events[1]) * 1000
        us = self._events[1].elapsed_time(self._events[2]) * 1000
        queued = self._spun and host_us < spin_us
        return RegionTime(us, QUEUED_DEVICE_EVENTS if queued else DEVICE_EVENTS, host_us)


_CYCLES_PER_US: dict[str, float] = {}


def cycles_per_us(backend: DeviceBackend) -> float:
    """The device's spin-kernel clock, measured once per process (a millisecond's spin)."""
    if backend.device not in _CYCLES_PER_US:
        cycles = 2_000_000
        begin, end = backend.timing_event(), backend.timing_event()
        backend.spin(1000)  # the kernel's first launch out of the measurement
        begin.record()
        backend.spin(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_US[backend.device] = cycles / max(begin.elapsed_time(end) * 1000, 1.0)
    return _CYCLES_PER_US[backend.device]


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
    """Time `iters * samples` calls of `fn` after warming up for about `warmup_s` seconds, each
    from an idle device by a `RegionTimer` with a head start twice the longest host issue the
    warm-up saw (on CPU by the host clock). `before` (restoring the state the forward mutates,
    say) runs ahead of every call, outside the timing. The summary's `timer` is the one most calls
    got; `runs_with_host_gaps` counts the calls whose host issue outlasted their head start,
    `host_issue_us` is the median host issue time."""
    host_us = []

    def timed_once(head_start_us: float) -> RegionTime:
        if before is not None:
            before()
        backend.synchronize()
        timer = RegionTimer(backend, head_start_us)
        fn()
        measured = timer.stop()
        host_us.append(measured.host_us)
        return measured

    def head_start_us() -> float:  # twice the longest of the latest host issues
        return min(max(2 * max(host_us[-5:], default=DEFAULT_HEAD_START_US / 2), 50.0), MAX_HEAD_START_US)

    warm_up(lambda: timed_once(head_start_us()), backend, warmup_s)
    head_start = head_start_us()
    host_us.clear()
    measured = [timed_once(head_start) for _ in range(iters * samples)]
    timers = [m.timer for m in measured]
    # A run the host fell behind in (a collection, a page fault) moves the mean, not the median.
    timer = max(set(timers), key=timers.count)
    summary = latency_summary([m.us for m in measured], samples, timer)
    summary["host_issue_us"] = float(np.median(host_us))
    summary["runs_with_host_gaps"] = sum(m.timer == DEVICE_EVENTS for m in measured)
    return summary


def warm_up(fn: Callable[[], Any], backend: DeviceBackend, seconds: float) -> None:
    """Call `fn` until clocks and caches settle: at least twice, for about `seconds`."""
    begin = time.perf_counter()
    fn()
    backend.synchronize()
    per_call = max(time.perf_counter() - begin, 1e-6)
    for _ in range(max(1, int(seconds / per_call))):
        fn()
    backend.synchronize()
