"""Running tracekit inside every worker of an engine whose runners live in other processes.

A tensor-parallel engine (and any engine with vLLM's multiprocessing) runs one worker process
per rank, out of reach of the process holding the `LLM`. `LLM.collective_rpc(fn, args=...)`
sends a function to every worker, calls it as `fn(worker, *args)` there and returns each
worker's result in rank order; the functions below are what tracekit sends. The calls are
sequenced with the engine's own steps, so a recorder armed this way starts counting steps at
the same step on every rank, and a replayed step runs on all ranks at once (its collectives
need them all).

A replay is prepared on every rank first (bundle read, runner checked) and run only when every
rank is ready: one rank failing alone inside the forward would leave the others waiting in a
collective.
"""

import os
import time
from typing import Any, Callable

from tracekit.errors import CannotRunHere, TracekitError, UsageError

RPC_TIMEOUT_S = 900.0

# Worker-process state, keyed by the session id the driver made.
_recorders: dict[str, Any] = {}
_prepared: dict[str, Any] = {}


def runner_in_this_process(llm: Any) -> bool:
    """Whether `llm`'s model runner can be reached directly (one rank, in-process engine core)."""
    from tracekit.integrations.vllm.engine import find_runner

    try:
        find_runner(llm)
    except UsageError:
        return False
    return True


def on_every_worker(llm: Any, function: Callable, *args: Any) -> list[Any]:
    """`function(worker, *args)` on every worker, results in rank order; a `TracekitError`
    raised in a worker is raised here again, with its exit code."""
    engine_core = llm.llm_engine.engine_core
    if not hasattr(engine_core, "engine_core") and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        raise UsageError(
            "this LLM's engine core runs in another process, which accepts tracekit's worker functions "
            "only with VLLM_ALLOW_INSECURE_SERIALIZATION=1: set it (or VLLM_ENABLE_V1_MULTIPROCESSING=0) "
            "before building the LLM"
        )
    results = llm.collective_rpc(function, timeout=RPC_TIMEOUT_S, args=args)
    for result in results:
        if isinstance(result, dict) and "tracekit_error" in result:
            error = CannotRunHere if result["exit_code"] == CannotRunHere.exit_code else UsageError
            raise error(result["tracekit_error"])
    return results


def _reported(error: TracekitError) -> dict[str, Any]:
    return {"tracekit_error": str(error), "exit_code": error.exit_code}


# --- recording -----------------------------------------------------------------------------

def arm_recorder(worker: Any, session: str, output: str, steps: str | None, when: str | None,
                 events: tuple[str, ...], kv: str, max_bundles: int, layers: bool) -> dict[str, Any]:
    from tracekit.record.recorder import Recorder
    from tracekit.record.triggers import TriggerSet

    try:
        recorder = Recorder(
            worker.model_runner,
            output,
            TriggerSet(steps=steps, when=when, events=tuple(events)),
            kv=kv,
            max_bundles=max_bundles,
            layers=layers,
            set_id=session,
        )
    except TracekitError as error:
        return _reported(error)
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


# --- replaying -----------------------------------------------------------------------------

def prepare_replay(worker: Any, session: str, bundles: list[str]) -> dict[str, Any]:
    """Read this rank's bundle and check it fits this rank's runner; nothing runs yet."""
    from tracekit.environment import current_environment, environment_differences
    from tracekit.integrations.vllm.ranks import rank_of
    from tracekit.integrations.vllm.step_driver import StepDriver
    from tracekit.replay.replayer import load_step

    runner = worker.model_runner
    rank = rank_of(runner).rank
    try:
        content, step = load_step(bundles[rank], None)
        if content.parallel.rank != rank:
            raise UsageError(f"{bundles[rank]} is rank {content.parallel.rank}'s bundle, not rank {rank}'s")
        if step.error is not None:
            raise CannotRunHere("replaying a multi-rank step whose forward raised is not supported yet")
        driver = StepDriver(runner, step)
    except TracekitError as error:
        return _reported(error)
    _prepared[session] = driver
    differences = [
        {"field": name, "recorded": before, "here": now, "affects_numerics": numeric}
        for name, before, now, numeric in environment_differences(
            content.environment, current_environment(runner.device)
        )
    ]
    return {"rank": rank, "environment_differences": differences}


def run_replay(worker: Any, session: str, tolerance: float, timed_runs: int) -> dict[str, Any]:
    """Run the prepared step (every rank at once), check it against this rank's recording, then
    run the forward `timed_runs` more times (the same count on every rank: each one runs the
    collectives) timing each."""
    from tracekit.graphs.device import get_device_backend
    from tracekit.replay.checks import check_step

    driver = _prepared.pop(session)
    backend = get_device_backend(driver.runner.device)
    times_us: list[float] = []

    def time_forwards(handle: Any) -> None:
        for _ in range(timed_runs):
            handle.restore()
            started = time.perf_counter()
            handle.forward()
            backend.synchronize()
            times_us.append((time.perf_counter() - started) * 1e6)

    observed = driver.run(time_forwards if timed_runs else None)
    return {
        "reference_mode": "eager" if int(driver.runner.compilation_config.mode) == 0 else "compiled",
        "checks": check_step(observed, driver.step, tolerance),
        "forward_us": observed.forward_us,
        "times_us": times_us,
        "recorded_timing": driver.step.timing.to_plain(),
    }
