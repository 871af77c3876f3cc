"""Timing a replayed step's forward in each `--mode` (docs/GUIDE.md, "Dispatch and modes"), and
setting the times beside the recorded one, timed alike (docs/GUIDE.md, "Replaying": Timing).
"""

from typing import Any

from tracekit.format.schema import EngineConfig, Step
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.modes import OWN_ENGINE_MODES, ReplayMode, measure_mode
from tracekit.graphs.profiling import trace_path
from tracekit.integrations.vllm.replay_engine import EngineSpec, ForwardHandle, ReplayEngine, build_replay_engine
from tracekit.replay.options import ReplayOptions

# Timed samples whose medians spread more than this (in percent) make a ratio to the recorded
# time say little (a shared CPU's medians spread tens of percent; a GPU's, a few).
NOISY_SPREAD_PCT = 25.0


def measure(mode: str, handle: ForwardHandle, recorded: Step, options: ReplayOptions,
            piecewise: Any = None) -> dict[str, Any]:
    """Time the step's forward in `mode` (`options`: iterations, samples, warm-up and where the
    profile goes) and compare its output with the recorded one."""
    form = ReplayMode.COMPILED.value if mode in OWN_ENGINE_MODES else mode  # their engine compiled it their way
    reason = handle.unavailable_reason(form)
    if reason is not None:
        return {"mode": mode, "available": False, "reason": reason}
    handle.restore()
    return measure_mode(
        mode,
        lambda: handle.forward(form),
        handle.state_views(),
        recorded.outputs.hidden_states[: recorded.num_real_rows] if recorded.outputs is not None and
        recorded.outputs.hidden_states is not None else None,
        get_device_backend(handle.device),
        options.iters,
        options.samples,
        options.warmup_s,
        piecewise=piecewise,
        trace_to=trace_path(options.profile_prefix, mode),
        rows=recorded.num_real_rows,
    )


def time_in_own_engines(engine: ReplayEngine, recorded_engine: EngineConfig, recorded: Step, modes: list[str],
                        options: ReplayOptions, lora_paths: dict[int, str]) -> dict[str, dict[str, Any]]:
    """Time the modes that need an engine of their own, one after the other; the replay engine
    is released first (its engine arguments, read back, rebuild each)."""
    engine_args, has_graphs = engine.engine_args(), engine.has_graphs
    engine.release()
    return {mode: _measure_in_own_engine(mode, recorded_engine, engine_args, recorded, options, has_graphs, lora_paths)
            for mode in modes}


def _measure_in_own_engine(mode: str, engine: EngineConfig, engine_args: dict[str, Any], recorded: Step,
                           options: ReplayOptions, has_graphs: bool, lora_paths: dict[int, str]) -> dict[str, Any]:
    """"graph": the recorded compilation with vLLM's own graphs off, the step captured one-shot.
    "piecewise": tracekit's piecewise backend capturing the recorded capture sizes plus this
    step's token count (vLLM does not pad without its graphs), so the step itself replays a graph;
    then one more forward under the divergence probe, every piece against its eager FX module.
    Without graphs (CPU) the pieces are only compiled (Inductor, once for any size): the mode is
    not timed, but the probe still says which piece the compiler changed."""
    from tracekit.graphs import divergence

    dispatch = recorded.graph
    if has_graphs:
        table = CaptureTable(
            mode="piecewise",
            capture_sizes=tuple(sorted({*dispatch.capture_sizes, dispatch.num_tokens})),
            compile_sizes=tuple(dispatch.compile_sizes),
            num_warmups=max(dispatch.num_warmups or 0, 1),
        )
    else:  # each piece compiled once, for the symbolic token count (its "general" form)
        table = CaptureTable(mode="none", capture_sizes=(), compile_sizes=())
    own = build_replay_engine(EngineSpec(engine, timing_mode=mode, engine_args=engine_args, table=table))
    report: dict[str, Any] = {}
    try:
        def time_it(handle: ForwardHandle) -> None:
            backend = own.piecewise_backend() if mode == "piecewise" else None
            report.update(measure(mode, handle, recorded, options, piecewise=backend))
            if backend is not None:
                handle.restore()
                with divergence.probe(backend) as probed:
                    handle.forward()
                report["divergence"] = {
                    "pieces_compiled_with": "inductor", "pieces_captured": has_graphs, **probed.to_plain(),
                }

        own.driver(recorded, lora_paths, on_forward=time_it).run_one()
    finally:
        own.release()
    return report


def mode_agreement(modes: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Whether the step's real rows came out the same in every mode that ran, each against the
    recorded output (docs/GUIDE.md, "Dispatch and modes"); None where fewer than two could be."""
    outputs = {mode: report["vs_recorded"] for mode, report in modes.items()
               if report.get("available") and report.get("vs_recorded")}
    if len(outputs) < 2:
        return None
    exact = sorted(mode for mode, versus in outputs.items() if versus["bit_exact"])
    parted = {mode: versus.get("relative_rms") for mode, versus in outputs.items() if not versus["bit_exact"]}
    nonfinite = sorted(mode for mode, versus in outputs.items() if versus.get("finite") is False)
    return {"agree": not parted, "bit_exact_with_recording": exact, "parted": parted, "nonfinite": nonfinite}


def compare_with_recorded(modes: dict[str, dict[str, Any]], recorded: dict[str, Any]) -> None:
    """Add `ratio_to_recorded` (replayed median / recorded forward) to every timed mode, and
    where that ratio says little, why: `ratio_not_comparable` when the recorded time is not one
    to compare with (`_not_comparable`), `ratio_means_little` when the timed samples spread widely."""
    recorded_us = recorded.get("forward_us")
    if not isinstance(recorded_us, (int, float)) or recorded_us <= 0:
        return
    for report in modes.values():
        if not (report.get("available") and report.get("latency_us")):
            continue
        latency = report["latency_us"]
        report["ratio_to_recorded"] = latency["median"] / recorded_us
        not_comparable = _not_comparable(recorded, latency.get("timer"))
        if not_comparable is not None:
            report["ratio_not_comparable"] = not_comparable
        spread = latency.get("sample_spread_pct")
        if isinstance(spread, (int, float)) and spread > NOISY_SPREAD_PCT:
            report["ratio_means_little"] = (
                f"its timed samples spread {spread:.0f}% (over {NOISY_SPREAD_PCT:.0f}%): other work shares this "
                "machine's cores or the forward is too short to time alone, so any ratio to it means little")


def _not_comparable(recorded: dict[str, Any], timer: str | None) -> str | None:
    """Why the recorded forward time is not one to set a replayed one against (None: it is)."""
    recorded_timer = recorded.get("forward_timer")
    if recorded_timer is None:
        return ("the recorded time was taken by an older recorder (host clock around the forward and a device "
                "sync, host launch included), which overstates the recorded cost")
    if recorded.get("first_of_its_size"):
        return ("the recorded forward was the engine's first of its padded size since tracekit was armed: it may "
                "hold one-time costs (compilation or autotuning of that size, allocator growth, first-touch of "
                "buffers)")
    if timer is not None and timer != recorded_timer:
        return f"the recorded forward was timed by {recorded_timer}, these runs by {timer}"
    return None