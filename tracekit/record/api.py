"""The Python API for people who already hold an `LLM`.

    with tracekit.record.recording(llm, "step{step}.zst", steps="3:5") as recorder:
        llm.generate(prompts, params)
    print(recorder.written)

With the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and one rank, the recorder
is armed on the runner directly. Otherwise — a tensor-parallel `LLM`, whose runners live in one
worker process per rank, or an engine core in its own process — a recorder is armed inside every
worker through vLLM's `collective_rpc`, and `written` / `failures` are collected from all of
them when the block exits (each rank writes its own bundle of every recorded step,
`step3.rank0.zst`, `step3.rank1.zst`, ...). For servers use the vLLM plugin
(`tracekit.record.plugin`).
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
from tracekit.record.triggers import DEFAULT_MAX_BUNDLES


class WorkerRecording:
    """The recorders armed in an engine's worker processes, seen from the `LLM`'s process."""

    def __init__(self) -> None:
        self.written: list[Path] = []
        self.failures: list[str] = []


@contextmanager
def recording(
    llm: Any,
    output: str | Path = "tracekit-step{step}.zst",
    *,
    steps: str | None = None,
    when: str | None = None,
    on: tuple[str, ...] = (),
    kv: str = "read",
    max_bundles: int = DEFAULT_MAX_BUNDLES,
    layers: bool = False,
    window: int = 1,
    keep_lora_weights: bool = False,
) -> Iterator[Recorder | WorkerRecording]:
    """Arm a recorder on `llm` for the block; bundles are all written when it exits. `layers`:
    also store every decoder layer's output of a recorded step (eager engines only). `window`:
    each bundle keeps that many consecutive steps from a firing step on, the runner carrying its
    state from one to the next (`tracekit record --window`). `keep_lora_weights`: keep every
    LoRA adapter's files in the bundles, whatever their size (by default only those up to
    `lora_adapters.KEEP_LIMIT`)."""
    settings = RecordSettings(steps, when, tuple(on), kv, max_bundles, window, layers, keep_lora_weights)
    with recording_with(llm, output, settings) as recorder:
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
