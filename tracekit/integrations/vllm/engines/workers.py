"""Running tracekit's functions inside every worker of an engine whose runners live in other
processes: the transport, and nothing it carries.

A tensor-parallel engine (and any engine with vLLM's multiprocessing) runs one worker process
per rank, out of reach of the process holding the `LLM`; `LLM.collective_rpc` runs a function in
every worker, sequenced with the engine's own steps, so a function sent to arm a recorder runs
at the same step on every rank, and a replayed step runs on all ranks at once (its collectives
need them all). The functions sent live with their use cases (`tracekit.record.arm_in_workers`,
`tracekit.replay.replay_in_workers`).
"""

import os
from typing import Any, Callable

from tracekit.errors import CannotRunHere, TracekitError, UsageError

RPC_TIMEOUT_S = 900.0


def runner_in_this_process(llm: Any) -> bool:
    """Whether `llm`'s model runner can be reached directly (one rank, in-process engine core)."""
    from tracekit.integrations.vllm.engines.build import find_runner

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


def reported(error: TracekitError) -> dict[str, Any]:
    """A worker's refusal, as `on_every_worker` raises it again in the driver."""
    return {"tracekit_error": str(error), "exit_code": error.exit_code}


def runner_of(worker: Any) -> Any:
    """The model runner of a vLLM worker."""
    return worker.model_runner
