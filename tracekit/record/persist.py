"""Writing recorded steps, already copied to host, to bundle files on one background thread, off
the engine's critical path. A failure here is logged once, leaves nothing at the target path and
never reaches the engine (docs/GUIDE.md, "When recording fails").
"""

import dataclasses
import glob
import logging
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any, Callable

from tracekit.errors import UsageError, one_line
from tracekit.format.content import write_steps
from tracekit.format.schema import EngineConfig, Environment, ParallelRank, Step
from tracekit.graphs.host_copy import context_lost
from tracekit.graphs.kernel_choices import launched_choices
from tracekit.outputs import claim_outputs, describe_existing, require_parent

logger = logging.getLogger("tracekit.record")

STEP_PLACEHOLDER = "{step}"
RANK_PLACEHOLDER = "{rank}"


class OutputTemplate:
    """Where bundles go. A path with `{step}` takes every firing step; a plain path takes the
    first one only (the recorder then stops firing). Each rank of a multi-rank engine writes its
    own bundle, at `{rank}` or with `.rank{rank}` inserted before the suffixes (docs/GUIDE.md,
    "Multi-rank engines")."""

    def __init__(self, template: str | Path, world_size: int = 1):
        self.template = str(template)
        if world_size > 1 and RANK_PLACEHOLDER not in self.template:
            folder, name = os.path.split(self.template)
            stem, dot, suffixes = name.partition(".")
            ranked = f"{stem}.rank{RANK_PLACEHOLDER}{dot}{suffixes}" if dot else f"{name}.rank{RANK_PLACEHOLDER}"
            self.template = os.path.join(folder, ranked)
        parent = require_parent(self.path_for(0), f"bundles to {self.template}")
        probe = parent / f".tracekit-write-probe-{threading.get_ident()}"
        try:
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise UsageError(f"cannot write bundles to {self.template}: {error.strerror}") from error

    @property
    def single(self) -> bool:
        return STEP_PLACEHOLDER not in self.template

    def path_for(self, step_index: int, rank: int = 0) -> Path:
        return Path(self.template.replace(STEP_PLACEHOLDER, str(step_index)).replace(RANK_PLACEHOLDER, str(rank)))

    def claim(self, force: bool) -> None:
        """Refuse (usage, unless `force`) to record where bundles of this template exist already:
        a new recording would write over them."""
        if self.single:
            claim_outputs({"-o": self.template}, force=force)
            return
        numbered = re.escape(self.template).replace(re.escape(STEP_PLACEHOLDER), r"\d+")
        pattern = re.compile(numbered.replace(re.escape(RANK_PLACEHOLDER), r"\d+"))
        wildcard = glob.escape(self.template).replace(STEP_PLACEHOLDER, "*").replace(RANK_PLACEHOLDER, "*")
        existing = sorted(path for path in glob.glob(wildcard) if pattern.fullmatch(path))
        if existing and not force:
            more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
            raise UsageError(f"-o {self.template}: {existing[0]} exists ({describe_existing(Path(existing[0]))}){more}: "
                             "name another output, or pass --force to write over them")


class BackgroundPersister:
    """One writer thread with a queue; `close()` waits for every submitted bundle.

    A write that fails, or the thread dying, is reported to `on_failure(reason)` as it happens
    (on the thread it happened on), so the recorder stops at once rather than at the engine's
    next step, which may never come. Each bundle's engine record gets the kernel choices of the
    process as they are when it is written (`kernel_choices.launched_choices`: read here, off the
    engine's thread; a kernel is autotuned at its first launch, which may be the step's own)."""

    def __init__(self, environment: Environment, engine: EngineConfig,
                 on_failure: Callable[[str], None] | None = None):
        self.environment = environment
        self.engine = engine
        self.written: list[Path] = []
        self.failures: list[str] = []
        self._on_failure = on_failure
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0  # submitted and not yet written (or failed)
        self._thread = threading.Thread(target=self._run, name="tracekit-writer", daemon=True)
        self._thread.start()

    def submit(self, path: Path, step: Step, parallel: ParallelRank | None = None,
               ready: Callable[[], Any] | None = None, now: bool = False) -> None:
        """Write `step` on the writer thread, once `ready()` returned (the step's copies to host
        landed: on a GPU they run on a side stream while the engine goes on); or `now`, on this
        thread, for a step whose forward raised: the engine may be going down."""
        if now:
            if ready is not None:
                ready()
            self._write(path, step, parallel)
            return
        if not self._thread.is_alive():
            raise RuntimeError(f"the writer thread is gone ({self.failures[-1] if self.failures else 'no reason'})")
        with self._idle:
            self._pending += 1
        self._queue.put((path, step, parallel, ready))

    def wait_idle(self) -> None:
        """Until every bundle submitted so far is written, or failed, or the thread is gone."""
        with self._idle:
            while self._pending and self._thread.is_alive():
                self._idle.wait(0.05)  # (a dying thread notifies before it is gone)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            path, step, parallel, ready = item
            try:
                if self._landed(step, ready):
                    self._write(path, step, parallel)
            except BaseException as error:  # the thread ends; the recorder is told before anyone waiting
                self._failed(f"the writer thread died: {type(error).__name__}: {error}")
                return
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _landed(self, step: Step, ready: Callable[[], Any] | None) -> bool:
        """Whether the step's copies landed (`ready()` returned). A device context lost before
        they did (a later step's device-side assert) leaves this bundle unwritten and the writer
        alive: the recorder stays armed to keep the step that failed, from host memory."""
        try:
            if ready is not None:
                ready()
            return True
        except Exception as error:
            if not context_lost(error):
                raise
            message = (f"step {step.index} not written: the device context was lost before its copies to host "
                       f"landed ({one_line(error)})")
            logger.error("tracekit: %s", message)
            self.failures.append(message)
            return False

    def _write(self, path: Path, step: Step, parallel: ParallelRank | None) -> None:
        try:
            engine = dataclasses.replace(self.engine, kernel_choices=launched_choices())
            self.written.append(write_steps(path, self.environment, engine, [step], parallel))
        except Exception as error:  # never let recording harm the engine
            self._failed(f"could not write {path}: {type(error).__name__}: {error}")
            return
        logger.info("tracekit: wrote %s (%s): step %d (%s), %s", path, _size(path), step.index, step.trigger,
                    _requests(step))

    def _failed(self, message: str) -> None:
        if not self.failures:
            logger.error("tracekit: %s; recording stops, the engine goes on unrecorded", message)
        self.failures.append(message)
        if self._on_failure is not None:
            self._on_failure(message)


def bundle_bytes(path: Path) -> int | None:
    """A written bundle's size; None where its user moved it away at once (a watcher collecting
    bundles): it was still written."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _size(path: Path) -> str:
    """The written bundle's size, for the log line."""
    size = bundle_bytes(path)
    if size is None:
        return "moved since"
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size / 1024:.0f} KiB"


def _requests(step: Step, shown: int = 4) -> str:
    """The step's requests by engine id, the first few named."""
    ids = [request.req_id for request in step.requests]
    more = f", +{len(ids) - shown} more" if len(ids) > shown else ""
    return f"{len(ids)} request{'s' if len(ids) != 1 else ''}: {', '.join(ids[:shown])}{more}"
