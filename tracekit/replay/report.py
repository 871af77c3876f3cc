"""The human-readable replay report: what differs here, what matched, how fast it ran."""

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tracekit.replay.replayer import ReplayResult


def _us(value: Any) -> str:
    return f"{value / 1000:.3f} ms" if isinstance(value, (int, float)) else "-"


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else ("-" if value is None else str(value))


def print_differences(console: Console, environment_differences: list[dict[str, Any]], overrides: dict[str, Any]) -> None:
    """How this machine differs from the recording one, and the engine arguments overridden."""
    for difference in environment_differences:
        marker = "[yellow]![/yellow]" if difference["affects_numerics"] else " "
        console.print(
            f" {marker} environment {difference['field']}: recorded {difference['recorded']!r}, here {difference['here']!r}"
        )
    for name, value in overrides.items():
        console.print(f"   override {name} = {value!r}")


def print_report(result: ReplayResult, stream: TextIO | None = None) -> None:
    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    console.print(f"[bold]replay[/bold] {result.bundle}  step {result.step_index} ({result.trigger})")
    print_differences(console, result.environment_differences, result.overrides)
    for note in result.notes:
        console.print(f" [yellow]![/yellow] {escape(note)}")

    checks = Table(title=f"vs recorded ({result.reference_mode} forward)", title_justify="left")
    checks.add_column("item", overflow="fold")
    for column in ("bit-exact", "max_abs", "relative_rms", "argmax/tokens"):
        checks.add_column(column)
    for item in result.checks:
        details = item.details
        checks.add_row(
            escape(item.name),
            "[green]yes[/green]" if item.bit_exact else ("[yellow]within tol[/yellow]" if item.within_tolerance else "[red]NO[/red]"),
            _number(details.get("max_abs")),
            _number(details.get("relative_rms")),
            _number(details.get("argmax_agreement", details.get("agreement"))),
        )
    console.print(checks)

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

    if result.reproduced:
        verdict = "bit-exact" if result.bit_exact else f"within tolerance {result.tolerance}"
        console.print(f"[bold green]REPRODUCED[/bold green] ({verdict})")
    else:
        console.print(f"[bold red]NOT REPRODUCED[/bold red]: first divergence at [bold]{result.first_divergence}[/bold]")
