"""The human-readable report of a replayed window of steps: one row per step (rebuilt or carried,
its dispatch, its verdict, the first item that parted, its forward recorded and replayed), the
first step that parted in detail; the window's verdict comes first."""

from typing import Any, TextIO

from rich.console import Console

from tracekit.cli.replay_report import describe_engine_build, print_checks, print_differences, print_verdict
from tracekit.cli.terminal import console_for, inert, table
from tracekit.replay.kv_sources import describe
from tracekit.replay.window import WindowReplayResult

KV_SOURCE_LINES = 12  # the most lines on where parted steps' KV came from (`--json` has them all)


def _ms(value: Any) -> str:
    return f"{value / 1000:.3f}" if isinstance(value, (int, float)) else "-"


def _dispatch(audited: dict[str, Any]) -> str:
    """The step's graph mode and padded rows here, flagged where they differ from the recording."""
    here = audited.get("replayed") or {}
    if not here:
        return "-"
    shown = f"{here.get('runtime_mode')} {here.get('num_tokens_padded')}"
    return f"[yellow]{shown} (differs)[/yellow]" if audited.get("differences") else shown


def print_window_report(result: WindowReplayResult, stream: TextIO | None = None, needs: str | None = None) -> None:
    console = console_for(stream)
    padding = any(item.is_padding for step in result.steps for item in step.checks)
    print_verdict(console, result.verdict, result.first_divergence, result.tolerance, padding)
    if needs:
        console.print(inert(needs))
    first, last = result.recorded[0], result.recorded[-1]
    carried = "rebuilt at " + ", ".join(map(str, result.rebuilt)) + ", carried by the runner from step to step"
    console.print(f"[bold]replay[/bold] {inert(result.bundle)}  window of steps {first}..{last} "
                  f"({len(result.recorded)} of {result.requested} asked for; {carried})")
    if result.engine_build is not None:
        console.print(f"   engine: {inert(describe_engine_build(result.engine_build))}")
    print_differences(console, result.environment_differences, result.overrides)
    steps = table(console, "steps vs recorded",
                  ["step", "state", "dispatch", "verdict", "first divergence", "forward ms recorded", "replayed"])
    for step in result.steps:
        verdict = step.verdict
        colour = "green" if verdict.exit_code() == 0 else "red"
        steps.add_row(
            str(step.step_index),
            "rebuilt" if step.step_index in result.rebuilt else "carried",
            _dispatch(step.dispatch),
            f"[{colour}]{verdict.name.value}[/{colour}]",
            inert(step.first_divergence or "-"),
            _ms(step.recorded_timing.get("forward_us")),
            _ms(step.replay_forward_us),
        )
    for index in result.not_run:
        steps.add_row(str(index), "not run", "-", "-", "(after the step that raised)", "-", "-")
    console.print(steps)
    parted = next((step for step in result.steps if step.verdict.exit_code() != 0), None)
    if parted is not None:
        console.print(f"step {parted.step_index}, where the window parts:")
        for note in parted.notes:
            console.print(f"   note: {inert(note)}")
        print_checks(console, parted, parted.verdict)
        for finding in parted.padding_findings:
            console.print(f"   [red]padding[/red]: {inert(finding)}")
    _print_kv_sources(console, result)


def _print_kv_sources(console: Console, result: WindowReplayResult) -> None:
    """Per parted step and request, where the KV it read came from: computed bit-exact (the step
    parts in itself), or by a step before it that parted."""
    lines = [describe(index, req_id, source) for index, sources in sorted(result.kv_sources.items())
             for req_id, source in sources.items()]
    for line in lines[:KV_SOURCE_LINES]:
        console.print(f"   KV read: {inert(line)}")
    if len(lines) > KV_SOURCE_LINES:
        console.print(f"   ... {len(lines) - KV_SOURCE_LINES} more (--json)")
