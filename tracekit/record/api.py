"""The Python API for people who already hold an `LLM`.

    with tracekit.record.recording(llm, "step{step}.zst", steps="3:5") as recorder:
        llm.generate(prompts, params)
    print(recorder.written)

The `LLM` must run its engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that
its model runner can be reached; for servers use the vLLM plugin (`tracekit.record.plugin`).
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tracekit.integrations.vllm.engine import find_runner
from tracekit.record.recorder import DEFAULT_MAX_BUNDLES, Recorder
from tracekit.record.triggers import TriggerSet


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
) -> Iterator[Recorder]:
    """Arm a recorder on `llm` for the block; bundles are all written when it exits. `layers`:
    also store every decoder layer's output of a recorded step (eager engines only)."""
    recorder = Recorder(
        find_runner(llm),
        output,
        TriggerSet(steps=steps, when=when, events=tuple(on)),
        kv=kv,
        max_bundles=max_bundles,
        layers=layers,
    )
    with recorder:
        yield recorder
