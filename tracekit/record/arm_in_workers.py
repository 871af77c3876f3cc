"""Arming and disarming recorders inside an engine's worker processes (sent there through
`tracekit.integrations.vllm.engines.workers.on_every_worker`).

Each worker keeps its recorders by the session id the driver made; every rank arms at the same
step, so their step indices agree.
"""

from typing import Any

from tracekit.errors import TracekitError
from tracekit.integrations.vllm.recording import reported, runner_of
from tracekit.record.recorder import Recorder
from tracekit.record.settings import RecordSettings

_recorders: dict[str, Recorder] = {}


def arm_recorder(worker: Any, session: str, output: str, settings: RecordSettings) -> dict[str, Any]:
    try:
        recorder = Recorder(runner_of(worker), output, settings, set_id=session)
    except TracekitError as error:
        return reported(error)
    _recorders[session] = recorder.arm()  # a runner it cannot arm on: see `failures` at disarm
    return {"rank": recorder.rank.rank, "armed": recorder.armed}


def disarm_recorder(worker: Any, session: str) -> dict[str, Any]:
    recorder = _recorders.pop(session, None)
    if recorder is None:
        return {"rank": None, "written": [], "failures": [f"no recorder of session {session} in this worker"]}
    recorder.disarm()
    return {
        "rank": recorder.rank.rank,
        "written": [str(path) for path in recorder.written],
        "failures": list(recorder.failures),
    }
