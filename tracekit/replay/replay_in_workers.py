"""Replaying one rank's part of a multi-rank step inside its worker process (sent there through
`ReplayEngine.on_every_worker`).

A replay is prepared on every rank first (bundle read, runner checked) and run only when every
rank is ready: one rank failing alone inside the forward would leave the others waiting in a
collective.
"""

import time
from typing import Any

from tracekit.environment import environment_records
from tracekit.errors import CannotRunHere, TracekitError, UsageError
from tracekit.format.content import load_step
from tracekit.integrations.vllm.replay_engine import (
    LocatedAdapters,
    SequenceDriver,
    WindowStep,
    locate_lora_adapters,
    worker_adapter,
    worker_error,
)
from tracekit.replay.checks import check_step

# Worker-process state, keyed by the session id the driver made: the step's driver, and where
# its LoRA adapters are here (a folder of kept files is removed after the run).
_prepared: dict[str, tuple[SequenceDriver, LocatedAdapters]] = {}


def prepare_replay(worker: Any, session: str, bundles: list[str]) -> dict[str, Any]:
    """Read this rank's bundle and check it fits this rank's runner; nothing runs yet."""
    try:
        adapter = worker_adapter(worker)
        rank = adapter.parallel_rank().rank
        content, step = load_step(bundles[rank], None)
        if content.parallel.rank != rank:
            raise UsageError(f"{bundles[rank]} is rank {content.parallel.rank}'s bundle, not rank {rank}'s")
        if step.error is not None:
            raise CannotRunHere("replaying a multi-rank step whose forward raised is not supported yet")
        located = locate_lora_adapters(step, {}, allow_mismatch=False)
        try:
            driver = SequenceDriver(adapter, [WindowStep(step)], lora_paths=located.paths)
        except BaseException:
            located.close()
            raise
    except TracekitError as error:
        return worker_error(error)
    _prepared[session] = driver, located
    return {"rank": rank, "environment_differences": environment_records(content.environment, adapter.environment())}


def run_replay(worker: Any, session: str, tolerance: float, timed_runs: int) -> dict[str, Any]:
    """Run the prepared step (every rank at once), check it against this rank's recording, then
    run the forward `timed_runs` more times (the same count on every rank: each one runs the
    collectives) timing each."""
    driver, located = _prepared.pop(session)
    backend = driver.adapter.device_backend
    times_us: list[float] = []

    def time_forwards(handle: Any) -> None:
        for _ in range(timed_runs):
            handle.restore()
            started = time.perf_counter()
            handle.forward()
            backend.synchronize()
            times_us.append((time.perf_counter() - started) * 1e6)

    driver.on_forward = time_forwards if timed_runs else None
    with located:
        observed = driver.run_one()
    return {
        "reference_mode": driver.adapter.reference_mode,
        "checks": check_step(observed, driver.step, tolerance),
        "forward_us": observed.forward_us,
        "times_us": times_us,
        "recorded_timing": driver.step.timing.to_plain(),
    }
