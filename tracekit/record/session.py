"""One `tracekit record` run: build the engine, arm, run the workload, disarm.

Kept apart from the CLI so tests and tools drive exactly what a user's command does.
"""

import logging
import os
from pathlib import Path
from typing import Any

from tracekit.errors import TracekitError, one_line
from tracekit.integrations.vllm.recording import build_llm, installed_release, parse_engine_cli_args
from tracekit.models import tiny_model_path
from tracekit.record import workload
from tracekit.record.api import recording
from tracekit.record.persist import OutputTemplate
from tracekit.record.settings import RecordSettings

logger = logging.getLogger("tracekit.record")


def recording_engine_args(model: str | None, engine_argv: list[str] = (),
                          engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine a recording runs: the embedded tiny model with the small engine it is sized for
    (`workload.EMBEDDED_MODEL_ENGINE_ARGS`), a model the user names with vLLM's own defaults;
    the user's engine arguments on top."""
    return {
        **(workload.EMBEDDED_MODEL_ENGINE_ARGS if model is None else {}),
        "model": model or tiny_model_path(),
        **parse_engine_cli_args(list(engine_argv)),
        **(engine_args or {}),
    }


def record_workload(
    *,
    model: str | None = None,
    engine_argv: list[str] = (),
    engine_args: dict[str, Any] | None = None,
    prompts_file: str | None = None,
    max_tokens: int | None = None,
    events: tuple[str, ...] = (),
    output: str | Path = "tracekit-bundle.zst",
    force: bool = False,
    **settings: Any,
) -> list[Path]:
    """Record the steps the triggers pick from a workload run; returns the bundles written.
    Bundles that exist at the output are written over only with `force`. `events`: the event
    triggers (`--on`); `settings`: the other `RecordSettings`."""
    installed_release()
    # Outputs that exist, bad triggers and prompts are refused before an engine is started for nothing.
    OutputTemplate(output).claim(force)
    settings = RecordSettings(on=tuple(events), **settings)
    settings.check()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    requests = workload.load_prompts(prompts_file) if prompts_file else workload.BUILTIN_WORKLOAD
    llm = build_llm(recording_engine_args(model, engine_argv, engine_args))
    engine_failure = None
    with recording(llm, output, settings) as recorder:
        try:
            workload.run_workload(llm, requests, max_tokens or workload.DEFAULT_MAX_TOKENS)
        except TracekitError:
            raise
        except Exception as error:  # the engine's own failure: the reason some users record at all
            engine_failure = one_line(error)
    if recorder.failures:
        raise TracekitError(f"recording failed: {recorder.failures[0]}")
    if engine_failure and not recorder.written:
        hint = "" if "exception" in events else " (add --on exception to record the failing step)"
        raise TracekitError(f"the engine failed and no step was recorded{hint}: {engine_failure}")
    if engine_failure:
        logger.warning("tracekit: the engine failed: %s", engine_failure)
    return recorder.written
