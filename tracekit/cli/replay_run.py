"""Running a `tracekit replay` request in child processes, and reporting it.

The work runs in a child (`isolation.run_isolated`): it replays (`tracekit.replay.request.carry_out`)
with vLLM's and torch's own output kept in a log file (`engine_output`), prints the report, and
sends each bundle's record to the parent. Where a child dies on a bundle, that bundle gets a
`crashed` record here, and with `--keep-going` a new child goes on with the bundles left.
"""

import sys
from pathlib import Path
from typing import Any, TextIO

import click

from tracekit.cli.isolation import Progress, crash_record, print_crash, run_isolated
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
        print_crash(str(dead), crashed["step"], crashed["trigger"], outcome.death, stream)
        request = request.without({Path(record["bundle"]) for record in records})
        if request.bundles and (not request.keep_going or request.opened is not None):
            click.echo(f"tracekit: {len(request.bundles)} bundle(s) not run (--keep-going runs them all)", file=stream)
            break
    return records, worst_exit_code(exit_codes)


def _work(request: ReplayRequest, progress: Progress, verbose: bool, report_to_stderr: bool) -> int:
    """The child's part: replay, report, return the exit code."""
    from tracekit.cli.engine_output import engine_output
    from tracekit.replay.request import carry_out

    with engine_output(verbose, "replay") as output:
        stream = output.errors if report_to_stderr else output.report
        with _Listener(progress, len(request.bundles), output.errors) as listener:
            outcome = carry_out(request, listener)
        print_outcome(outcome.report, stream, _needs(request))
        if output.log_line():
            click.echo(f"   {output.log_line()}", file=stream)
    return outcome.exit_code


def _needs(request: ReplayRequest) -> str | None:
    """What the one bundle replayed needs, as its report's second line (None for many)."""
    from tracekit.integrations.vllm.records.needs import bundle_needs

    if request.opened is None:
        return None
    return bundle_needs(request.opened.content, request.opened.path).line()


class _Listener:
    """Sends each bundle's start and record to the parent; with many bundles, draws a progress
    bar meanwhile (on the terminal's standard error)."""

    def __init__(self, progress: Progress, total: int, errors: TextIO):
        self._progress = progress
        self._total = total
        self._errors = errors
        self._bar: Any = None
        self._closing: Any = None

    def __enter__(self) -> "_Listener":
        if self._total > 1:
            from tracekit.cli.replay_report import suite_progress

            self._closing = suite_progress(self._total, self._errors)
            self._bar = self._closing.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._closing is not None:
            self._closing.__exit__(*exc_info)

    def started(self, position: int, bundle: Path, building: bool, facts: dict[str, Any]) -> None:
        self._progress.started(str(bundle), **facts)
        if self._bar is not None:
            self._bar.start(position, Path(bundle), building)

    def finished(self, record: dict[str, Any]) -> None:
        self._progress.finished(record)
        if self._bar is not None:
            self._bar.done(record)


def print_outcome(report: Any, stream: TextIO, needs: str | None = None) -> None:
    """The report of what a replay came to, by its kind (`needs`: the bundle's needs line)."""
    from tracekit.cli.rank_set_report import print_rank_set_report
    from tracekit.cli.replay_report import print_report, print_suite_summary
    from tracekit.replay.multirank import RankSetReplayResult
    from tracekit.replay.request import Crash
    from tracekit.replay.suite import SuiteOutcome

    if isinstance(report, Crash):
        print_crash(report.bundle, report.step, report.trigger, report.reason, stream)
    elif isinstance(report, SuiteOutcome):
        print_suite_summary(report, stream)
    elif isinstance(report, RankSetReplayResult):
        print_rank_set_report(report, stream, needs)
    else:
        print_report(report, stream, needs)


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
