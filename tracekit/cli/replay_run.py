"""Running a `tracekit replay` request in child processes (`isolation.run_isolated`), and
reporting it (a child that dies on a bundle: `replay_isolated`).
"""

import contextlib
import sys
from pathlib import Path
from typing import Any, TextIO

import click

from tracekit.cli.isolation import Progress, crash_record, print_crash, run_isolated
from tracekit.cli.terminal import inert
from tracekit.replay.request import ReplayRequest
from tracekit.replay.verdict_names import worst_exit_code


def replay_isolated(request: ReplayRequest, verbose: bool, report_to_stderr: bool) -> tuple[list[dict], int]:
    """Replay `request` in children until every bundle has its record (or, without --keep-going,
    until one dies); returns the records and the exit code."""
    stream = sys.stderr if report_to_stderr else sys.stdout
    records: list[dict[str, Any]] = []
    exit_codes = []
    while request.bundles:
        outcome = run_isolated(lambda progress, todo=request: _work(todo, progress, verbose, report_to_stderr))
        records.extend(outcome.records)
        exit_codes.append(outcome.exit_code)
        if outcome.died_on is None:
            break
        dead = Path(outcome.died_on["started"])
        crashed = crash_record(outcome.died_on, outcome.death, request.names.get(dead))
        records.append(crashed)
        print_crash(crashed, stream)
        request = request.without({Path(record["bundle"]) for record in records})
        if request.bundles and (not request.keep_going or request.opened is not None):
            click.echo(f"tracekit: {len(request.bundles)} bundle(s) not run (--keep-going runs them all)", file=stream)
            break
    return records, worst_exit_code(exit_codes)


def _work(request: ReplayRequest, progress: Progress, verbose: bool, report_to_stderr: bool) -> int:
    """The child's part: replay, report, return the exit code."""
    from tracekit.cli.engine_output import engine_output
    from tracekit.cli.replay_report import print_report
    from tracekit.integrations.vllm.records.needs import bundle_needs
    from tracekit.replay.request import carry_out

    with engine_output(verbose, "replay") as output:
        stream = output.errors if report_to_stderr else output.report
        listener = _Listener(progress, len(request.bundles), output.errors)
        with listener.bar or contextlib.nullcontext():
            outcome = carry_out(request, listener)
        opened = request.opened  # one bundle: what it needs is its report's second line
        needs = None if opened is None else bundle_needs(opened.content, opened.path).line()
        print_report(outcome.report, stream, needs)
        if output.log_line():
            click.echo(f"   {output.log_line()}", file=stream)
    return outcome.exit_code


class _Listener:
    """Sends each bundle's start and record to the parent; with many bundles, draws a progress
    bar meanwhile on `errors` (only on a terminal; gone when the suite ends)."""

    def __init__(self, progress: Progress, total: int, errors: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._progress = progress
        self.bar = None  # shown while its `with` block runs
        if total > 1:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bar = Bar(*columns, console=Console(file=errors), transient=True)
            self._task = self.bar.add_task("reading bundles", total=total)

    def started(self, position: int, bundle: Path, building: bool, facts: dict[str, Any]) -> None:
        self._progress.started(str(bundle), **facts)
        if self.bar is not None:
            doing = "building an engine for" if building else "replaying"
            self.bar.update(self._task, description=f"{doing} {inert(Path(bundle).name)}")

    def finished(self, record: dict[str, Any]) -> None:
        self._progress.finished(record)
        if self.bar is not None:
            self.bar.advance(self._task)


def write_reports(records: list[dict[str, Any]], json_out: str | None, plot_path: str | None) -> None:
    """The JSON lines (`--json`) and the plot (`--plot`) of the records, each whole or not at all."""
    from tracekit.outputs import STDOUT, json_text, write_text_atomically

    if json_out:
        text = "".join(json_text(record) + "\n" for record in records)
        if json_out == STDOUT:
            click.echo(text, nl=False)
        else:
            write_text_atomically(json_out, text)
    if plot_path and records:
        from tracekit.replay.plots import plot_records

        click.echo(f"plot: {plot_records(records, plot_path)}", err=json_out == STDOUT)
