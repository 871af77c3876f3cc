"""The Python API for people who already hold an `LLM` (docs/GUIDE.md, "From Python, on an `LLM`
you already hold"; servers use the vLLM plugin, `tracekit.record.plugin`).

With the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and one rank, the recorder
is armed on the runner directly. Otherwise its runners live in worker processes: a recorder is
armed inside every worker, and `written` / `failures` are collected from all of them when the
block exits.
"""

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
def recording(llm: Any, output: str | Path = "tracekit-step{step}.zst",
              **settings: Any) -> Iterator[Recorder | WorkerRecording]:
    """Arm a recorder on `llm` for the block; bundles are all written when it exits. `settings`:
    `tracekit record`'s options, as `RecordSettings` names them (`steps`, `when`, `on`, `kv`,
    `max_bundles`, `layers`, `window`, `keep_lora_weights`)."""
    with recording_with(llm, output, RecordSettings(**settings)) as recorder:
        yield recorder


@contextmanager
def recording_with(llm: Any, output: str | Path, settings: RecordSettings) -> Iterator[Recorder | WorkerRecording]:
    """`recording`, its settings given as one."""
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
