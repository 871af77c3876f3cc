"""One-shot exact capture: one graph for one recorded batch, checked against eager and timed.

The graph is captured for the exact inputs of the recorded step, so every host-side decision baked
in at capture (attention plans, kernel choices by query length) is right by construction; no
capture sizes, padding or dummy metadata are involved. How each replay restores its state and
where the timing events sit: docs/GRAPHS.md ("One-shot exact capture").
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracekit.graphs.device import DeviceBackend
from tracekit.graphs.profiling import trace_calls
from tracekit.graphs.timing import latency_summary, warm_up
from tracekit.numerics import compare_tensors


@dataclass
class OneShotResult:
    """`report` is plain data (JSON-ready); `output` is the first replay's output, on the device."""

    report: dict[str, Any]
    output: torch.Tensor


def capture_and_time(
    forward: Callable[[], Any],
    state_views: Sequence[torch.Tensor],
    backend: DeviceBackend,
    iters: int,
    samples: int,
    warmup_s: float = 1.0,
    trace_to: str | Path | None = None,
) -> OneShotResult:
    """Capture `forward` (no arguments; its first output tensor is checked) as one graph.

    `state_views` are the tensors the forward mutates and reads (KV blocks it writes); they are
    snapshotted now and restored before every run. The report's fields are docs/GRAPHS.md's
    ("One-shot exact capture"). With `trace_to`, `iters` more replays are traced into that Chrome
    trace file (`profile_trace` in the report).
    """
    backend.require_graphs()
    restore = state_restorer(state_views)
    stream = backend.new_stream()
    backend.wait_for_current_stream(stream)
    in_graph = (
        (backend.timing_event(in_graph=True), backend.timing_event(in_graph=True))
        if backend.in_graph_timing
        else None
    )
    with backend.stream_context(stream):
        # Some kernels set up per-stream state on first use, which cannot happen in a capture.
        restore()
        eager = first_tensor(forward()).clone()
        restore()
        reference = first_tensor(forward()).clone()
    stream.synchronize()
    graph = backend.new_graph()
    with backend.graph_capture(graph, stream=stream):
        restore()
        if in_graph:
            in_graph[0].record()
        output = first_tensor(forward())
        if in_graph:
            in_graph[1].record()

    graph.replay()
    backend.synchronize()
    first = output.clone()
    graph.replay()
    backend.synchronize()
    report: dict[str, Any] = {
        "eager_repeat": compare_tensors(reference, eager),
        "graph_vs_eager": compare_tensors(first, reference),
        "graph_deterministic": bool(torch.equal(first, output)),
        "finite": bool(output.isfinite().all()),
        "state_reset_bytes": sum(view.numel() * view.element_size() for view in state_views),
    }
    report.update(_time_replays(graph, backend, in_graph, iters, samples, warmup_s))
    if trace_to is not None:
        report["profile_trace"] = trace_calls(graph.replay, iters, backend, trace_to)
    del graph
    return OneShotResult(report=report, output=first)


def _time_replays(
    graph: Any,
    backend: DeviceBackend,
    in_graph: tuple[Any, Any] | None,
    iters: int,
    samples: int,
    warmup_s: float,
) -> dict[str, Any]:
    warm_up(graph.replay, backend, warmup_s)
    around = (backend.timing_event(), backend.timing_event())
    forward_us, replay_us = [], []
    for _ in range(iters * samples):
        around[0].record()
        graph.replay()
        around[1].record()
        around[1].synchronize()
        replay_us.append(around[0].elapsed_time(around[1]) * 1000)
        if in_graph:
            forward_us.append(in_graph[0].elapsed_time(in_graph[1]) * 1000)
    replay = latency_summary(replay_us, samples, "replay_events")
    forward = latency_summary(forward_us, samples, "graph_events") if in_graph else replay
    return {"latency_us": forward, "replay_us": replay}


def state_restorer(state_views: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Snapshot `state_views` now; the returned function copies the snapshot back."""
    snapshots = [(view, view.clone()) for view in state_views]

    def restore() -> None:
        for view, saved in snapshots:
            view.copy_(saved)

    return restore


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a forward's output leads with: itself, the first of a tuple/list, or the first
    value of a mapping (a `transformers` ModelOutput, say)."""
    while not isinstance(output, torch.Tensor):
        if isinstance(output, Mapping):
            output = next(iter(output.values()))
        elif isinstance(output, (tuple, list)):
            output = output[0]
        else:
            raise TypeError(f"forward returned {type(output).__name__}, which holds no tensor")
    return output
