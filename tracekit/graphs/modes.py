"""What `tracekit replay --mode` measures in each mode, behind one call per mode.

The replayer builds the forward for a mode (eager model, compiled model, or a model compiled with
the piecewise backend, see `tracekit.integrations.vllm.engines.graph_backend`) and hands it here with the
state the forward mutates and the recorded output; every mode answers with the same report shape:
timing, comparison with the recording, and for graph modes on a machine without graphs, why not.
"""

from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from tracekit.errors import UsageError
from tracekit.graphs.device import DeviceBackend
from tracekit.graphs.oneshot import capture_and_time, first_tensor, state_restorer
from tracekit.graphs.piecewise import PiecewiseGraphBackend
from tracekit.graphs.profiling import trace_calls
from tracekit.graphs.timing import time_callable
from tracekit.numerics import compare_tensors


class ReplayMode(str, Enum):
    """What `tracekit replay --mode` can time the step's forward in."""

    EAGER = "eager"  # the model without torch.compile
    COMPILED = "compiled"  # as the engine dispatched it (through vLLM's graphs where it ran them)
    COMPILED_NO_GRAPH = "compiled-no-graph"  # the engine's compiled code, vLLM's graphs bypassed
    VLLM_PIECEWISE = "vllm-piecewise"  # vLLM's own PIECEWISE graphs of the step's padded size
    GRAPH = "graph"  # the recorded compilation captured one-shot by tracekit (an engine of its own)
    PIECEWISE = "piecewise"  # tracekit's piecewise graph backend (an engine of its own)


MODES = tuple(mode.value for mode in ReplayMode)
# The modes that need an engine built for them (vLLM's own graphs off, or tracekit's backend).
OWN_ENGINE_MODES = (ReplayMode.GRAPH.value, ReplayMode.PIECEWISE.value)


def expand_modes(requested: str) -> list[str]:
    """`--mode` value to the modes to run: "all", or one or more of MODES separated by commas."""
    if requested == "all":
        return list(MODES)
    modes = [mode.strip() for mode in requested.split(",")]
    for mode in modes:
        if mode not in MODES:
            raise UsageError(f"unknown replay mode {mode!r}; choose from {', '.join(MODES)}, all (or a comma list)")
    return list(dict.fromkeys(modes))


def measure_mode(
    mode: str,
    forward: Callable[[], Any],
    state_views: Sequence[torch.Tensor],
    expected: torch.Tensor | None,
    device: DeviceBackend,
    iters: int,
    samples: int,
    warmup_s: float = 1.0,
    piecewise: PiecewiseGraphBackend | None = None,
    trace_to: str | Path | None = None,
    rows: int | None = None,
) -> dict[str, Any]:
    """Run and time `forward` in `mode`; compare its first output tensor (its first `rows` rows:
    a graph of a padded size computes padding rows past them) with `expected` (None where
    nothing was recorded). The report, per mode, is docs/GRAPHS.md's ("Replay modes").

    `forward` takes no arguments and must already be the mode's forward (for "piecewise" one
    compiled with `piecewise`, whose counters are reported: without it the mode is reported
    unavailable rather than mislabelled); `state_views` are restored before every run. With
    `trace_to`, `iters` more runs of the timed forward are traced into that Chrome trace file.
    """
    reason = device.unavailable_reason if mode in OWN_ENGINE_MODES else None
    if reason is None and mode == "piecewise" and piecewise is None:
        reason = (
            "the engine was not built with tracekit's piecewise backend "
            "(tracekit.integrations.vllm.engines.graph_backend.compilation_config_for('piecewise', table))"
        )
    if reason is not None:
        return {"mode": mode, "available": False, "reason": reason}
    if mode == "graph":
        result = capture_and_time(forward, state_views, device, iters, samples, warmup_s, trace_to=trace_to)
        return {
            "mode": mode,
            "available": True,
            **result.report,
            "vs_recorded": _compare_with_recording(result.output, expected, rows),
        }
    if mode not in MODES:
        raise UsageError(f"unknown replay mode {mode!r}")
    restore = state_restorer(state_views)
    # Timing first: its warm-up runs also take the piecewise backend through its warm-ups and
    # captures, so the output checked below comes from replays.
    latency = time_callable(forward, iters, samples, device, warmup_s, before=restore)
    restore()
    output = first_tensor(forward()).clone()
    restore()
    repeat = first_tensor(forward()).clone()
    report = {
        "mode": mode,
        "available": True,
        "latency_us": latency,
        "vs_recorded": _compare_with_recording(output, expected, rows),
        "deterministic": bool(torch.equal(output[:rows], repeat[:rows])),
    }
    if piecewise is not None:
        report["piecewise"] = piecewise.counters.to_plain()
    if trace_to is not None:
        report["profile_trace"] = trace_calls(forward, iters, device, trace_to, before=restore)
    return report


def _compare_with_recording(
    output: torch.Tensor, expected: torch.Tensor | None, rows: int | None = None
) -> dict[str, Any] | None:
    if expected is None:
        return None
    real = output[:rows]
    return {**compare_tensors(real, expected), "finite": bool(torch.isfinite(real).all())}
