"""Live control of the recorders in a running server: arm, change the trigger, status, disarm
(docs/GUIDE.md, "Live control of a running server"; `tracekit.record.settings` checks every request).
Each worker process of the engine (one per rank) keeps one recorder on its model runner.

The server side is split where the layers split: `tracekit.integrations.vllm.serving` carries
requests from vLLM's API server to every worker (routes, API key, `collective_rpc`), and this
module decides what they do: `ServerControl` in the API server process (checks a request, turns
the workers' answers into one), `handle` in each worker process.
"""

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.errors import TracekitError, UsageError
from tracekit.record.persist import bundle_bytes
from tracekit.record.recorder import Recorder
from tracekit.record.settings import (
    ROUTE_NAMES,
    SERVE_DIR_VARIABLE,
    bundle_folder,
    bundles,
    check_settings,
    served_folder,
)

logger = logging.getLogger("tracekit.record")

BUNDLE_NAME = "step{step}.zst"


# -- the API server's side -------------------------------------------------------------------


class ServerControl:
    """What a live-control request does, seen from the API server process: `request` checks it
    and makes what every worker gets; `answer` turns the workers' results (in rank order) into
    the reply, and names a request to send them next where one is needed (ranks that armed
    while another refused are disarmed again)."""

    def __init__(self, served: Path):
        self.served = served

    def request(self, op: str, body: Any, route: str) -> dict[str, Any]:
        """For `op` ("arm", "status" or "disarm") what each worker is sent; a bad request is
        refused with `UsageError` before any worker hears of it."""
        if op == "arm":
            settings = check_settings(body)
            bundle_folder(self.served, settings.output)
            return {"settings": settings.plain(), "by": route, "set_id": uuid.uuid4().hex}
        if op in ("status", "disarm"):
            return {"by": route}
        raise UsageError(f"unknown live-control operation {op!r}")

    def answer(self, op: str, sent: dict[str, Any], results: list[dict[str, Any]]) -> tuple[int, dict[str, Any], str | None]:
        """(HTTP status, reply, the operation to send the workers next or None)."""
        refusals = [result["refused"] for result in results if result.get("refused")]
        reply = {"served_folder": str(self.served), "ranks": results}
        if refusals:
            armed_somewhere = op == "arm" and any(result.get("armed") for result in results)
            reply["error"] = refusals[0]
            return 400, reply, "disarm" if armed_somewhere else None
        if op == "arm":
            reply["output"] = str(Path(os.path.realpath(self.served)) / sent["settings"]["output"])
        return 200, reply, None


# -- each worker's side ----------------------------------------------------------------------


@dataclass
class _Armed:
    recorder: Recorder
    by: str  # the setting or route that armed it, as the user used it
    folder: str


# This worker process's recorder, by model runner (a worker has one).
_armed: dict[int, _Armed] = {}
_lock = threading.Lock()


def handle(runner: Any, op: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One live-control request in a worker process: its answer, plain data (`refused`: why
    not, one line). Never raises: the engine's loop is calling."""
    try:
        with _lock:
            if op == "arm":
                return _arm(runner, payload)
            if op == "disarm":
                return _disarm(runner, payload["by"])
            if op == "status":
                return status(runner)
            return {"refused": f"unknown live-control operation {op!r}"}
    except TracekitError as error:
        return {**status(runner), "refused": str(error)}
    except Exception as error:  # a tracekit bug: said, and the engine goes on
        logger.error("tracekit: live control failed: %s: %s", type(error).__name__, error)
        return {**status(runner), "refused": f"tracekit failed: {type(error).__name__}: {error}"}


def keep_armed_at_start(runner: Any, recorder: Recorder, by: str) -> None:
    """The recorder the plugin armed from environment variables, under live control too."""
    with _lock:
        _keep(runner, recorder, by, str(recorder.output.template))


def disarm_all() -> None:
    """At the process's exit: every recorder stops and its bundles are written."""
    with _lock:
        while _armed:
            _armed.popitem()[1].recorder.disarm()


def status(runner: Any) -> dict[str, Any]:
    armed = _armed.get(id(runner))
    if armed is None:
        return {"armed": False}
    recorder = armed.recorder
    return {
        "armed": recorder.armed,
        "by": armed.by,
        "trigger": recorder.triggers.describe(),
        "output": armed.folder,
        "max_bundles": recorder.max_bundles,
        "steps_seen": recorder.steps_seen,
        "written": [{"path": str(path), "bytes": bundle_bytes(path)} for path in recorder.written],
        "stopped": recorder.stopped or (recorder.failures[-1] if recorder.failures else None),
    }


def banner(recorder: Recorder, by: str) -> str:
    """The one line that says a recorder is armed in this server, and what it costs."""
    if recorder.triggers.events and recorder.triggers.steps is None and recorder.triggers.when is None:
        waiting = "a mark and a finite check on the device per step"
    elif recorder.triggers.request is not None:
        waiting = "one id look-up per scheduled request and step"
    else:
        waiting = "one comparison per step"
    most = ("1 bundle (a path without {step})" if recorder.output.single
            else f"at most {bundles(recorder.max_bundles)} ({recorder.names.max_bundles})")
    return (f"tracekit: ARMED by {by}: recording {recorder.triggers.describe()} to {recorder.output.template}, "
            f"{most}; cost while waiting: {waiting}; a step that fires stalls the engine while its inputs, "
            "outputs and the KV blocks it reads are copied to host (written on a background thread)")


def _arm(runner: Any, payload: dict[str, Any]) -> dict[str, Any]:
    settings = check_settings(payload["settings"])
    served = served_folder()
    if served is None:
        raise UsageError(f"live control is off in this process ({SERVE_DIR_VARIABLE} is not set)")
    folder = bundle_folder(served, settings.output)
    recorder = Recorder(runner, str(folder / BUNDLE_NAME), settings, set_id=payload.get("set_id"), names=ROUTE_NAMES)
    previous = _armed.pop(id(runner), None)
    if previous is not None and previous.recorder.armed:  # replaced at this step boundary
        previous.recorder.disarm(wait=False)
        _say(recorder, "tracekit: the recorder armed by %s is replaced by one armed by %s; it took %s",
             previous.by, payload["by"], bundles(previous.recorder.bundles_fired))
    recorder.arm()
    if not recorder.armed:
        raise UsageError(recorder.failures[-1] if recorder.failures else "the recorder did not arm")
    _keep(runner, recorder, payload["by"], str(folder))
    return status(runner)


def _keep(runner: Any, recorder: Recorder, by: str, folder: str) -> None:
    """The armed recorder of this worker, said once in the server's log."""
    _armed[id(runner)] = _Armed(recorder, by, folder)
    _say(recorder, banner(recorder, by))


def _say(recorder: Recorder, message: str, *args: Any) -> None:
    """A warning in the server's log, from the first rank only (every rank does the same)."""
    if recorder.rank.rank == 0:
        logger.warning(message, *args)


def _disarm(runner: Any, by: str) -> dict[str, Any]:
    """Stop the recorder; it stays in the status (the writer thread finishes its bundles) until
    the next arming replaces it."""
    armed = _armed.get(id(runner))
    if armed is None or not armed.recorder.armed:
        return status(runner)
    armed.recorder.disarm(wait=False)
    armed.recorder.stopped = f"disarmed by {by}"
    _say(armed.recorder, "tracekit: disarmed by %s (armed by %s); it took %s, written to %s", by, armed.by,
         bundles(armed.recorder.bundles_fired), armed.folder)
    return status(runner)
