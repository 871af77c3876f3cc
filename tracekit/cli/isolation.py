"""Running a command's replay work in a child process, so that no failure ends it with a traceback.

A CUDA device-side assert or an illegal address poisons the process's CUDA context: the Python
exception that reports it is followed, at exit, by aborts in destructors (exit 134, no report,
nothing a `git bisect run` can read). So the command forks before anything imports torch or
vLLM: the child does the work, sends each bundle's start and record as JSON lines on a pipe, and
leaves with `os._exit`, skipping those destructors. If the child dies (a signal, or an exit code
outside the contract), the bundle it was on gets a `crashed` record, exit 4 (docs/GUIDE.md, "Replaying").

`TRACEKIT_REPLAY_IN_PROCESS=1` runs the work in the command's own process (for debuggers).
"""

import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from tracekit.cli.terminal import console_for, inert
from tracekit.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REPLAY_FAILED, TracekitError, one_line
from tracekit.replay.verdict_names import EXIT_SEVERITY, VerdictName

IN_PROCESS_VARIABLE = "TRACEKIT_REPLAY_IN_PROCESS"


class Progress:
    """The child's side: tells the parent what it starts and what each bundle came to (in the
    command's own process, only keeps the records)."""

    def __init__(self, stream: TextIO | None, records: list[dict[str, Any]] | None = None):
        self._stream = stream
        self._records = records

    def _send(self, message: dict[str, Any]) -> None:
        if self._stream is not None:
            self._stream.write(json.dumps(message, default=str) + "\n")
            self._stream.flush()

    def started(self, bundle: str, **facts: Any) -> None:
        self._send({"started": bundle, **facts})

    def finished(self, record: dict[str, Any]) -> None:
        if self._records is not None:
            self._records.append(record)
        self._send({"finished": record})


@dataclass
class ChildOutcome:
    exit_code: int
    records: list[dict[str, Any]] = field(default_factory=list)  # the finished bundles', in order
    # The bundle the child was on when it died or left ({"started": path, ...}), and how.
    died_on: dict[str, Any] | None = None
    death: str | None = None


def run_isolated(work: Callable[[Progress], int]) -> ChildOutcome:
    """Run `work(progress)` (it returns the exit code) in a child process; see the module doc."""
    if os.environ.get(IN_PROCESS_VARIABLE) == "1":
        records: list[dict[str, Any]] = []
        return ChildOutcome(work(Progress(None, records)), records)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        code = EXIT_REPLAY_FAILED
        try:
            with os.fdopen(write_end, "w") as stream:
                code = _exit_code_of(work, Progress(stream))
        finally:
            _leave(code)
    os.close(write_end)
    outcome = ChildOutcome(EXIT_OK)
    with os.fdopen(read_end) as stream:
        for line in stream:
            message = json.loads(line)
            if "started" in message:
                outcome.died_on = message
            elif "finished" in message:
                outcome.records.append(message["finished"])
                outcome.died_on = None
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # -N: killed by signal N
    outcome.exit_code = code if code in EXIT_SEVERITY else EXIT_REPLAY_FAILED  # it lists every code
    if code < 0:
        outcome.death = f"the replay process was killed by {signal.Signals(-code).name}"
    elif code not in EXIT_SEVERITY:
        outcome.death = f"the replay process exited with status {code}"
    if outcome.died_on is not None and outcome.death is None:  # it left early, saying why on stderr
        outcome.death = f"the replay ended (exit {outcome.exit_code}) before this bundle's outcome"
        outcome.exit_code = EXIT_REPLAY_FAILED if outcome.exit_code == EXIT_OK else outcome.exit_code
    return outcome


def _exit_code_of(work: Callable[[Progress], int], progress: Progress) -> int:
    try:
        return work(progress)
    except SystemExit as leaving:
        return leaving.code if isinstance(leaving.code, int) else EXIT_BAD_INPUT
    except TracekitError as error:
        print(f"tracekit: error: {error}", file=sys.stderr)
        return error.exit_code
    except BaseException as error:  # noqa: BLE001 - the child reports every failure in one line
        print(f"tracekit: error: the replay failed: {one_line(error)}", file=sys.stderr)
        return EXIT_REPLAY_FAILED


def _leave(code: int) -> None:
    """End the child now: after a device failure, running destructors can abort the process."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def crash_record(started: dict[str, Any], reason: str, name: str | None = None) -> dict[str, Any]:
    """The JSON record of the bundle a replay died on (docs/GUIDE.md, "JSON fields")."""
    return {
        "bundle": started["started"],
        "name": name,
        "verdict": VerdictName.CRASHED.value,
        "exit_code": EXIT_REPLAY_FAILED,
        "error": reason,
        "step": started.get("step"),
        "trigger": started.get("trigger"),
    }


def print_crash(record: dict[str, Any], stream: TextIO | None = None) -> None:
    """The report of a replay that broke off inside vLLM, the device or tracekit, from its record
    (made here, or by the child that caught the failure)."""
    console = console_for(stream)
    step = record.get("step")
    where = f"  step {inert(step)} ({inert(record.get('trigger'))})" if step is not None else ""
    console.print(f"[bold]replay[/bold] {inert(record['bundle'])}{where}")
    console.print(
        f"verdict [bold]{VerdictName.CRASHED.value}[/bold]: [bold red]REPLAY FAILED[/bold red] "
        f"(exit {VerdictName.CRASHED.exit_code}; says nothing yet about the step): {inert(record['error'])}"
    )
