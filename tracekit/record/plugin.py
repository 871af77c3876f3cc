"""The vLLM general plugin: arms a recorder inside any vLLM engine from environment variables.

    TRACEKIT_RECORD_OUTPUT=/tmp/step{step}.zst TRACEKIT_RECORD_STEPS=5 vllm serve MODEL

vLLM loads `vllm.general_plugins` entry points in every process it starts; this one does
nothing unless `TRACEKIT_RECORD_OUTPUT` is set. It then arms a recorder on each model runner
once its worker has finished compiling and warming up (those runs are not steps), and flushes
the writer thread when the process exits.

    TRACEKIT_RECORD_OUTPUT  bundle path; `{step}` in it records every firing step; each rank of a
                            multi-rank engine writes its own (`{rank}`, else `.rank{rank}` inserted)
    TRACEKIT_RECORD_STEPS   e.g. `7`, `5:9`, `3,7`
    TRACEKIT_RECORD_WHEN    a predicate, e.g. `num_reqs>=2 and has_prefill`
    TRACEKIT_RECORD_ON      `exception`, `nonfinite` or both, comma separated
    TRACEKIT_RECORD_KV      `read` (default), `written` or `none`
    TRACEKIT_RECORD_MAX_BUNDLES  with `{step}`: the most bundles one process writes (default 16)
    TRACEKIT_RECORD_WINDOW  consecutive steps per bundle from a firing step on (default 1)
    TRACEKIT_RECORD_LORA_WEIGHTS `1`: keep every LoRA adapter's files in the bundles, whatever
                            their size (by default only adapters up to 64 MiB are kept)
"""

import atexit
import logging
import os
from typing import Any

from tracekit.errors import TracekitError

logger = logging.getLogger("tracekit.record")

_armed: list[Any] = []


def register() -> None:
    if not os.environ.get("TRACEKIT_RECORD_OUTPUT"):
        return
    from tracekit.integrations.vllm.recording import installed_release

    try:
        release = installed_release()
    except TracekitError as error:  # a vLLM this tracekit does not know: serve unrecorded
        logger.error("tracekit: recorder not armed: %s", error)
        return
    release.on_each_runner_ready(_arm_on)


def _arm_on(runner: Any) -> None:
    if any(recorder.runner is runner for recorder in _armed):
        return
    from tracekit.record.recorder import DEFAULT_MAX_BUNDLES, Recorder
    from tracekit.record.triggers import TriggerSet

    events = tuple(e.strip() for e in os.environ.get("TRACEKIT_RECORD_ON", "").split(",") if e.strip())
    try:
        recorder = Recorder(
            runner,
            os.environ["TRACEKIT_RECORD_OUTPUT"],
            TriggerSet(
                steps=os.environ.get("TRACEKIT_RECORD_STEPS"),
                when=os.environ.get("TRACEKIT_RECORD_WHEN"),
                events=events,
            ),
            kv=os.environ.get("TRACEKIT_RECORD_KV", "read"),
            max_bundles=_int_env("TRACEKIT_RECORD_MAX_BUNDLES", DEFAULT_MAX_BUNDLES),
            window=_int_env("TRACEKIT_RECORD_WINDOW", 1),
            keep_lora_weights=os.environ.get("TRACEKIT_RECORD_LORA_WEIGHTS", "") == "1",
        ).arm()
    except Exception as error:  # bad settings, or anything else: the engine starts unrecorded
        logger.error("tracekit: recorder not armed: %s", error)
        return
    if not recorder.armed:  # it logged why
        return
    _armed.append(recorder)
    if len(_armed) == 1:
        atexit.register(_disarm_all)
    logger.info("tracekit: recorder armed, writing to %s", recorder.output.template)


def _disarm_all() -> None:
    while _armed:
        _armed.pop().disarm()


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise TracekitError(f"{name} must be a whole number, not {value!r}")
    return int(value)
