"""The human-readable replay reports: one bundle's in detail (what differs here, what matched,
how fast it ran, and the verdict as its last line), and a suite's as one summary row per bundle
with a progress bar meanwhile."""

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracekit.cli.terminal import inert
from tracekit.errors import EXIT_OK
from tracekit.replay import verdict as verdicts
from tracekit.replay.checks import KV_DIGEST_ITEM
from tracekit.replay.result import ReplayResult
from tracekit.replay.suite import SuiteOutcome, SuiteRecord
from tracekit.replay.verdict import VerdictName


def _us(value: Any) -> str:
    return f"{value / 1000:.3f} ms" if isinstance(value, (int, float)) else "-"


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else ("-" if value is None else str(value))


def describe_engine_build(build: dict[str, Any]) -> str:
    """`lean (captured FULL 8; compile sizes 8), built in 12.3 s` or `full (as vLLM builds it), ...`."""
    if build["kind"] == "full":
        what = "full (as vLLM builds it: every graph and compile size)"
    else:
        captured = build["graphs_captured"]
        graphs = "no graphs" if not captured else "captured " + ", ".join(f"{mode} {size}" for mode, size in captured)
        sizes = "" if build["compile_sizes"] is None else f"; compile sizes {build['compile_sizes'] or 'none'}"
        what = f"lean ({graphs}{sizes}; --full-engine builds it as vLLM does)"
    if not build.get("built_for_this_step", True):
        return f"{what}, reused"
    if build.get("seconds") is None:
        return what
    imports = f" ({build['import_seconds']:.1f} s of it importing vLLM)" if build.get("import_seconds") is not None else ""
    return f"{what}, built in {build['seconds']:.1f} s{imports}"


def print_differences(console: Console, environment_differences: list[dict[str, Any]], overrides: dict[str, Any]) -> None:
    """How this machine differs from the recording one, and the engine arguments overridden."""
    for difference in environment_differences:
        marker = "[yellow]![/yellow]" if difference["affects_numerics"] else " "
        console.print(
            f" {marker} environment {inert(str(difference['field']))}: recorded {inert(repr(difference['recorded']))}, "
            f"here {inert(repr(difference['here']))}"
        )
    for name, value in overrides.items():
        console.print(f"   override {name} = {value!r}")


def print_report(result: ReplayResult, stream: TextIO | None = None) -> None:
    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    console.print(f"[bold]replay[/bold] {inert(result.bundle)}  step {result.step_index} ({inert(result.trigger)})")
    if result.engine_build is not None:
        console.print(f"   engine: {inert(describe_engine_build(result.engine_build))}")
    print_differences(console, result.environment_differences, result.overrides)
    for note in result.notes:
        console.print(f" [yellow]![/yellow] {inert(note)}")
    _print_dispatch(console, result.dispatch, attention=not result.bit_exact)
    verdict = result.verdict
    print_checks(console, result, verdict)
    _print_not_deciding(console, result)
    if result.layer_checks:
        first_layer = result.first_diverging_layer
        agreeing = sum(item.bit_exact for item in result.layer_checks)
        console.print(
            f"layers vs recorded (eager): {agreeing}/{len(result.layer_checks)} bit-exact"
            + ("" if first_layer is None else
               f"; first diverging layer [bold]{inert(first_layer.name.removeprefix('layer/'))}[/bold] "
               f"max_abs {_number(first_layer.details.get('max_abs'))} "
               f"relative_rms {_number(first_layer.details.get('relative_rms'))}")
        )
    if result.layers_bundle:
        console.print(f"per-layer outputs (eager) written to {inert(result.layers_bundle)}")

    timing = Table(title="forward time", title_justify="left")
    for column in ("mode", "median", "min", "p90", "spread", "/ recorded", "output vs recorded"):
        timing.add_column(column)
    recorded = result.recorded_timing.get("forward_us")
    timing.add_row("recorded (engine)", _us(recorded), "", "", "", "", "")
    timing.add_row("replay, cold run", _us(result.replay_forward_us), "", "", "", "", "")
    unavailable = {mode: report["reason"] for mode, report in result.modes.items() if not report.get("available")}
    for mode, report in result.modes.items():
        if mode in unavailable:
            continue
        latency, versus = report["latency_us"], report.get("vs_recorded", {})
        ratio = report.get("ratio_to_recorded")
        timing.add_row(
            mode,
            _us(latency["median"]),
            _us(latency["min"]),
            _us(latency["p90"]),
            f"{latency['sample_spread_pct']:.1f}%",
            f"{ratio:.2f}x" if isinstance(ratio, float) else "-",
            "bit-exact" if (versus or {}).get("bit_exact") else f"rel_rms {_number((versus or {}).get('relative_rms'))}",
        )
    console.print(timing)
    timers = sorted({report["latency_us"].get("timer", "?") for report in result.modes.values() if report.get("available")})
    if timers:
        recorded_timer = result.recorded_timing.get("forward_timer") or "host clock around the forward and a sync"
        console.print(f"   timed by: recorded {recorded_timer}; replayed {', '.join(timers)}")
    for mode, reason in unavailable.items():
        console.print(f"   {mode}: unavailable here ({inert(reason)})")
    agreement = result.mode_agreement
    if agreement is not None:
        if agreement["agree"]:
            console.print(f"   modes agree: {', '.join(agreement['bit_exact_with_recording'])} bit-exact with the recording")
        else:
            parted = ", ".join(f"{mode} (rel_rms {_number(rms)})" for mode, rms in agreement["parted"].items())
            console.print(f"   [bold yellow]modes disagree[/bold yellow]: {parted} part from the recording"
                          + (f"; bit-exact: {', '.join(agreement['bit_exact_with_recording'])}"
                             if agreement["bit_exact_with_recording"] else ""))
        if agreement["nonfinite"]:
            console.print(f"   [bold red]non-finite real rows[/bold red] in: {', '.join(agreement['nonfinite'])}")
    for mode, report in result.modes.items():
        if report.get("profile_trace"):
            console.print(f"   {mode}: profile trace {inert(report['profile_trace'])} (open in ui.perfetto.dev)")

    padding = any(item.is_padding for item in result.checks)
    print_verdict(console, verdict, result.first_divergence, result.tolerance, padding)


def print_verdict(console: Console, verdict: Any, first_divergence: str | None, tolerance: float, padding: bool) -> None:
    """The report's last line: the verdict, in words, and why (`padding`: padding rows were
    compared apart)."""
    headline = {
        VerdictName.BIT_EXACT: "[bold green]REPRODUCED[/bold green] (bit-exact)",
        VerdictName.WITHIN_TOLERANCE: f"[bold green]REPRODUCED[/bold green] (within tolerance {tolerance:g})",
        VerdictName.PLATFORM_DIFFERENCE: "[bold yellow]REPRODUCED up to the platform difference[/bold yellow]",
        VerdictName.ERROR_REPRODUCED: "[bold green]REPRODUCED[/bold green] (the recorded error)",
        VerdictName.ERROR_NOT_REPRODUCED: "[bold red]NOT REPRODUCED[/bold red] (the recorded error)",
        VerdictName.RELEASE_DIFFERENCE: "[bold yellow]REPRODUCED up to the release difference[/bold yellow]",
        VerdictName.ERROR_GONE: "[bold red]NOT REPRODUCED[/bold red] (the recorded error is gone)",
        VerdictName.ERROR_APPEARED: "[bold red]NOT REPRODUCED[/bold red] (an error appeared)",
        VerdictName.NONFINITE_GONE: "[bold red]NOT REPRODUCED[/bold red] (the non-finite outputs are gone)",
        VerdictName.NONFINITE_APPEARED: "[bold red]NOT REPRODUCED[/bold red] (non-finite outputs appeared)",
        VerdictName.DIVERGED: f"[bold red]NOT REPRODUCED[/bold red]: first divergence at "
                              f"[bold]{inert(str((verdict.beyond_bound or [first_divergence])[0]))}[/bold]",
    }[verdict.name]
    real_rows = " (real rows; padding rows reported apart)" if padding else ""
    console.print(f"verdict [bold]{verdict.name.value}[/bold]: {headline}{real_rows} ({inert(verdict.reason)})")


def print_checks(console: Console, result: ReplayResult, verdict: Any) -> None:
    """The step's items against the recording (those that decide), then the requests whose
    sampled ids differ; `verdict` says how an item that is not bit-exact counts (the platform's)."""
    checks = Table(title=f"vs recorded ({result.reference_mode} forward)", title_justify="left")
    checks.add_column("item", overflow="fold")
    for column in ("bit-exact", "max_abs", "relative_rms", "argmax/tokens"):
        checks.add_column(column)
    for item in result.checks:
        if not item.decides:
            continue
        details = item.details
        if item.bit_exact:
            agreement = "[green]yes[/green]"
        elif item.within_tolerance:
            agreement = "[yellow]within tol[/yellow]"
        elif verdict.name == VerdictName.PLATFORM_DIFFERENCE:
            agreement = "[yellow]platform[/yellow]"  # not bit-exact, within the platform bound
        elif verdict.name == VerdictName.RELEASE_DIFFERENCE:
            agreement = "[yellow]release[/yellow]"  # not bit-exact, within the bound, under another release
        else:
            agreement = "[red]NO[/red]"
        checks.add_row(
            inert(item.name),
            agreement,
            _number(details.get("max_abs")),
            _number(details.get("relative_rms")),
            _number(details.get("argmax_agreement", details.get("agreement"))),
        )
    console.print(checks)
    for item in result.checks:
        for row in item.details.get("differing_rows", []):
            console.print(f"   {inert(verdicts.describe_differing_row(row))}")
        if item.name == KV_DIGEST_ITEM:
            _print_kv_writes(console, item)


KV_WRITER_LINES = 8  # the most requests named whose KV writes differ (`--json` has them all)


def _print_kv_writes(console: Console, item: Any) -> None:
    """A window step's digest of its KV writes: each request that wrote other KV, from which
    layer on; or why the replay could not check them."""
    if "problem" in item.details:
        console.print(f"   kv_written not checked: {inert(item.details['problem'])}")
    moved = list(item.details.get("requests_moved", {}).items())
    for req_id, layer in moved[:KV_WRITER_LINES]:
        console.print(f"   request {inert(req_id)} wrote other KV than recorded, from layer {inert(layer)} on")
    if len(moved) > KV_WRITER_LINES:
        console.print(f"   ... {len(moved) - KV_WRITER_LINES} more requests (--json)")


def _print_dispatch(console: Console, audited: dict[str, Any], attention: bool) -> None:
    """What the engine chose for the step, recorded and here; differences flagged (and, with
    `attention`, how the attention metadata differs: a lead when the replay is not bit-exact)."""
    if not audited:
        return
    before, after = audited.get("recorded") or {}, audited.get("replayed") or {}

    def shape(view: dict[str, Any]) -> str:
        if not view:
            return "unknown"
        return f"{view.get('runtime_mode')} graph at {view.get('num_tokens_padded')} rows for {view.get('num_tokens')} tokens"

    mark = "[yellow]![/yellow]" if audited.get("differences") else " "
    console.print(f" {mark} dispatch: recorded {inert(shape(before))}; here {inert(shape(after))}")
    for line in audited.get("differences", []):
        console.print(f"     [yellow]differs[/yellow] {inert(line)}")
    for line in audited.get("attention_differences", []) if attention else []:
        console.print(f"     attention metadata differs: {inert(line.removeprefix('attention '))}")


def _print_not_deciding(console: Console, result: ReplayResult) -> None:
    """The items that do not decide the verdict: padding rows, and what could not be compared."""
    for item in result.checks:
        if not item.decides and "why_not_deciding" in item.details:
            console.print(f"   {inert(item.name)} not compared: {inert(str(item.details['why_not_deciding']))}")
    for item in [item for item in result.checks if item.is_padding]:
        rows = item.details.get("rows", ["?", "?"])
        state = "bit-exact" if item.bit_exact else (
            f"differ (max_abs {_number(item.details.get('max_abs'))}; does not decide the verdict)")
        console.print(f"   padding rows {rows[0]}..{rows[1]} of {inert(item.name.removesuffix('/padding'))}: {state}")
    for finding in result.padding_findings:
        console.print(f" [red]![/red] padding: {inert(finding)}")


def _ratio(replayed: Any, recorded: Any) -> str:
    if not isinstance(replayed, (int, float)) or not isinstance(recorded, (int, float)) or recorded <= 0:
        return "-"
    return f"{replayed / recorded:.2f}x"


def _verdict_cell(record: SuiteRecord) -> str:
    colour = "green" if record.exit_code == EXIT_OK else "red"
    return f"[{colour}]{record.verdict}[/{colour}]"


def print_suite_summary(outcome: SuiteOutcome, stream: TextIO | None = None) -> None:
    """One row per bundle, in the order they ran; errors and bundles left unrun below."""
    console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
    table = Table(title=f"{len(outcome.records)} bundle(s) on {outcome.engines_built} engine(s)", title_justify="left")
    widest = max((len(record.name) for record in outcome.records), default=6)
    table.add_column("bundle", overflow="fold", min_width=min(widest, 24))
    for column in ("step", "engine", "verdict"):
        table.add_column(column, no_wrap=True)
    table.add_column("first divergence", overflow="fold", min_width=12)
    for column in ("forward", "recorded", "vs recorded"):
        table.add_column(column, no_wrap=True)
    for record in outcome.records:
        result = record.result
        table.add_row(
            inert(record.name),
            "-" if result is None else str(result.step_index),
            "-" if record.engine is None else str(record.engine),
            _verdict_cell(record),
            inert((result.first_divergence if result else None) or "-"),
            _us(record.forward_us),
            _us(record.recorded_forward_us),
            _ratio(record.forward_us, record.recorded_forward_us),
        )
    console.print(table)
    for record in outcome.records:
        if record.error:
            console.print(f" [red]![/red] {inert(record.bundle)}: {inert(record.error)}")
    traces = [report["profile_trace"] for record in outcome.records if record.result
              for report in record.result.modes.values() if report.get("profile_trace")]
    if traces:
        console.print(f"   profile traces: {len(traces)} in {inert(str(Path(traces[0]).parent))} (open in ui.perfetto.dev)")
    if outcome.not_run:
        console.print(f"[bold red]stopped at the first failure[/bold red]: {len(outcome.not_run)} bundle(s) not run "
                      "(--keep-going runs them all)")
    failed = sum(record.exit_code != EXIT_OK for record in outcome.records)
    if failed:
        console.print(f"[bold red]{failed} of {len(outcome.records)} bundle(s) failed[/bold red] (exit {outcome.exit_code})")
    else:
        console.print(f"[bold green]all {len(outcome.records)} bundle(s) reproduced[/bold green]")


class _SuiteProgress:
    def __init__(self, progress: Progress, total: int):
        self._progress = progress
        self._task = progress.add_task("reading bundles", total=total)

    def start(self, position: int, bundle: Path, building_engine: bool) -> None:
        doing = "building an engine for" if building_engine else "replaying"
        self._progress.update(self._task, description=f"{doing} {inert(bundle.name)}")

    def done(self, record: SuiteRecord) -> None:
        self._progress.advance(self._task)


@contextlib.contextmanager
def suite_progress(total: int) -> Iterator[_SuiteProgress]:
    """A progress bar on stderr (drawn only on a terminal), gone when the suite ends."""
    console = Console(file=sys.stderr)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield _SuiteProgress(progress, total)
