"""The human-readable replay report: what differs here, what matched, how fast it ran, and the
verdict (its last line)."""

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tracekit.replay import verdict as verdicts
from tracekit.replay.replayer import ReplayResult


def _us(value: Any) -> str:
    return f"{value / 1000:.3f} ms" if isinstance(value, (int, float)) else "-"


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else ("-" if value is None else str(value))


def print_report(result: ReplayResult, stream: TextIO | None = None) -> None:
    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    console.print(f"[bold]replay[/bold] {result.bundle}  step {result.step_index} ({result.trigger})")
    for difference in result.environment_differences:
        marker = "[yellow]![/yellow]" if difference["affects_numerics"] else " "
        console.print(
            f" {marker} environment {escape(str(difference['field']))}: recorded {escape(repr(difference['recorded']))}, "
            f"here {escape(repr(difference['here']))}"
        )
    for name, value in result.overrides.items():
        console.print(f"   override {name} = {value!r}")
    for note in result.notes:
        console.print(f" [yellow]![/yellow] {escape(note)}")

    checks = Table(title=f"vs recorded ({result.reference_mode} forward)", title_justify="left")
    checks.add_column("item", overflow="fold")
    for column in ("bit-exact", "max_abs", "relative_rms", "argmax/tokens"):
        checks.add_column(column)
    verdict = result.verdict
    for item in result.checks:
        details = item.details
        if item.bit_exact:
            agreement = "[green]yes[/green]"
        elif item.within_tolerance:
            agreement = "[yellow]within tol[/yellow]"
        elif verdict.name == verdicts.PLATFORM_DIFFERENCE:
            agreement = "[yellow]platform[/yellow]"  # not bit-exact, within the platform bound
        else:
            agreement = "[red]NO[/red]"
        checks.add_row(
            escape(item.name),
            agreement,
            _number(details.get("max_abs")),
            _number(details.get("relative_rms")),
            _number(details.get("argmax_agreement", details.get("agreement"))),
        )
    console.print(checks)
    for item in result.checks:
        for row in item.details.get("differing_rows", []):
            console.print(f"   {escape(verdicts.describe_differing_row(row))}")
    if result.layer_checks:
        first_layer = result.first_diverging_layer
        agreeing = sum(item.bit_exact for item in result.layer_checks)
        console.print(
            f"layers vs recorded (eager): {agreeing}/{len(result.layer_checks)} bit-exact"
            + ("" if first_layer is None else
               f"; first diverging layer [bold]{escape(first_layer.name.removeprefix('layer/'))}[/bold] "
               f"max_abs {_number(first_layer.details.get('max_abs'))} "
               f"relative_rms {_number(first_layer.details.get('relative_rms'))}")
        )
    if result.layers_bundle:
        console.print(f"per-layer outputs (eager) written to {escape(result.layers_bundle)}")

    timing = Table(title="forward time", title_justify="left")
    for column in ("mode", "median", "min", "p90", "spread", "vs recorded"):
        timing.add_column(column)
    recorded = result.recorded_timing.get("forward_us")
    timing.add_row("recorded in engine", _us(recorded), "", "", "", "")
    timing.add_row("replay, checked run (cold)", _us(result.replay_forward_us), "", "", "", "")
    unavailable = {mode: report["reason"] for mode, report in result.modes.items() if not report.get("available")}
    for mode, report in result.modes.items():
        if mode in unavailable:
            continue
        latency, versus = report["latency_us"], report.get("vs_recorded", {})
        timing.add_row(
            mode,
            _us(latency["median"]),
            _us(latency["min"]),
            _us(latency["p90"]),
            f"{latency['sample_spread_pct']:.1f}%",
            "bit-exact" if versus.get("bit_exact") else f"rel_rms {_number(versus.get('relative_rms'))}",
        )
    console.print(timing)
    for mode, reason in unavailable.items():
        console.print(f"   {mode}: unavailable here ({escape(reason)})")

    headline = {
        verdicts.BIT_EXACT: "[bold green]REPRODUCED[/bold green] (bit-exact)",
        verdicts.WITHIN_TOLERANCE: f"[bold green]REPRODUCED[/bold green] (within tolerance {result.tolerance:g})",
        verdicts.PLATFORM_DIFFERENCE: "[bold yellow]REPRODUCED up to the platform difference[/bold yellow]",
        verdicts.ERROR_REPRODUCED: "[bold green]REPRODUCED[/bold green] (the recorded error)",
        verdicts.ERROR_NOT_REPRODUCED: "[bold red]NOT REPRODUCED[/bold red] (the recorded error)",
        verdicts.DIVERGED: f"[bold red]NOT REPRODUCED[/bold red]: first divergence at "
                           f"[bold]{escape(str((verdict.beyond_bound or [result.first_divergence])[0]))}[/bold]",
    }[verdict.name]
    console.print(f"verdict [bold]{verdict.name}[/bold]: {headline} ({escape(verdict.reason)})")
