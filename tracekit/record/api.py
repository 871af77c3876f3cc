"""The Python API for people who already hold an `LLM`: the recorder is armed on its runner, or
inside every worker process where the runners are not in this one (docs/GUIDE.md, "From Python,
on an `LLM` you already hold"; servers use the vLLM plugin, `tracekit.record.plugin`).
"""

import dataclasses
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tracekit.errors import TracekitError
from tracekit.integrations.vllm.recording import find_runner, on_every_worker, runner_in_this_process
from tracekit.record import arm_in_workers
from tracekit.record.recorder import Recorder
from tracekit.record.settings import RecordSettings


class WorkerRecording:
    """The recorders armed in an engine's worker processes, seen from the `LLM`'s process."""

    def __init__(self) -> None:
        self.written: list[Path] = []
        self.failures: list[str] = []


@contextmanager
def recording(llm: Any, output: str | Path = "tracekit-step{step}.zst", settings: RecordSettings | None = None,
              **fields: Any) -> Iterator[Recorder | WorkerRecording]:
    """Arm a recorder on `llm` for the block; bundles are all written when it exits. `settings`,
    its fields given as keywords on top: `tracekit record`'s options, as `RecordSettings` names them."""
    settings = dataclasses.replace(settings or RecordSettings(), **fields)
    settings.check()  # refused here, before any worker hears of them
    if runner_in_this_process(llm):
        with Recorder(find_runner(llm), output, settings) as recorder:
            yield recorder
        return
    session = uuid.uuid4().hex
    remote = WorkerRecording()
    try:
        on_every_worker(llm, arm_in_workers.arm_recorder, session, str(Path(output).absolute()), settings)
    except TracekitError:
        on_every_worker(llm, arm_in_workers.disarm_recorder, session)  # ranks that did arm
        raise
    try:
        yield remote
    finally:
        for result in on_every_worker(llm, arm_in_workers.disarm_recorder, session):
            remote.written.extend(Path(path) for path in result["written"])
            remote.failures.extend(result["failures"])
