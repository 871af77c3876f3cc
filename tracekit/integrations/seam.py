"""What record and replay need from a serving engine's model runner, named once, without torch.

The recorder (`tracekit.record`) and the replay (`tracekit.replay`) sit above the engine
integrations and never touch an engine object themselves: they hold a runner adapter
(`tracekit.integrations.vllm.runners.runner_adapter.RunnerAdapter`) and talk to it through the types
here. Keeping them in one small module below `record/` means the layers only ever import
downward, and tools that must start fast (a shrink property run per trial, the test scheduler)
can read the runner kinds and phases without importing torch or vLLM.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Protocol


class RunnerKind(str, Enum):
    """vLLM's two model runners: V1 (`gpu_model_runner.py`) and Model Runner V2 (`gpu/`)."""

    V1 = "v1"
    V2 = "v2"


RUNNER_KINDS = tuple(kind.value for kind in RunnerKind)


class Phase(str, Enum):
    """Where a step can fail, in the order a step runs through them (`Step.error["phase"]`)."""

    PREPARE = "prepare"  # the runner applies the scheduler output and builds the inputs
    FORWARD = "forward"  # the model call
    LOGITS = "logits"  # hidden states to logits
    SAMPLING = "sampling"
    BOOKKEEPING = "bookkeeping"  # the runner updates its request states with the sampled ids
    OUTPUT = "output"  # the engine reads the sampled ids (async scheduling: a device fault surfaces here)


@dataclass(frozen=True)
class BatchFacts:
    """What trigger predicates can ask about a step's batch (read from host state only)."""

    num_reqs: int
    num_tokens: int
    num_prefills: int
    req_ids: frozenset[str]

    @property
    def num_decodes(self) -> int:
        return self.num_reqs - self.num_prefills

    @property
    def has_prefill(self) -> bool:
        return self.num_prefills > 0

    @property
    def has_decode(self) -> bool:
        return self.num_decodes > 0

    @property
    def mixed(self) -> bool:
        return self.has_prefill and self.has_decode


@dataclass(frozen=True)
class RequestProgress:
    """Where one request of a step stands, for a request trigger (`request==ID and ...`), read
    from host state only."""

    first_chunk: bool  # the step is the request's first: its first (or only) prefill chunk
    generated: int  # output tokens it had before the step: 0 while it prefills, N in the decode that feeds its Nth


@dataclass(frozen=True)
class OutputReceiver:
    """Where a step ends once `sample_tokens` returned: `received` takes its sampled ids when the
    engine reads them; `failed` takes the error reading them raised (under async scheduling a
    device fault of the step surfaces only there)."""

    received: Callable[[list[list[int]] | None], None]
    failed: Callable[[BaseException], None]


class StepObserver(Protocol):
    """What an adapter reports, in this order, while an armed runner runs a step.

    `tracking` is true while the current step is being captured; adapters skip work done only
    for a captured step (copying logits, waiting for sampled ids) when it is false.
    `before_forward` comes just before the model call, with the padded input ids and positions
    the model reads; `after_forward` just after it, with its output. `sampling` comes as
    `sample_tokens` is called. A step whose sampling has a structured-output grammar reports it
    as `sample_tokens` receives it (`grammar_received`, with a function that reads it as a
    `GrammarRecord`, copying its bitmask to host) and again once the mask is on the logits, just
    before sampling reads them (`grammar_applied`, the masked logits on the device; only where a
    grammar came in this step). `output_receiver()` is called once `sample_tokens` has returned:
    it detaches the step from the observer (the next step may start before an async output is
    read) and returns where the step ends (`OutputReceiver`). Under speculative decoding the
    drafter runs inside `sample_tokens`: each call of its model is reported (`drafter_called`,
    keyword inputs and output), and just before `output_receiver()` `drafts_proposed` gets a
    function that reads its proposals (an observer that does not keep them does not call it).
    `idle_step` reports a scheduler output without tokens (it only finishes requests; no step
    runs).
    """

    tracking: bool

    def step_started(self, scheduler_output: Any) -> None: ...

    def idle_step(self, scheduler_output: Any) -> None: ...

    def before_forward(self, input_ids: Any, positions: Any) -> None: ...

    def after_forward(self, hidden_states: Any) -> None: ...

    def logits_computed(self, logits: Any) -> None: ...

    def grammar_received(self, read: Callable[[], Any]) -> None: ...

    def grammar_applied(self, logits: Any) -> None: ...

    def phase_entered(self, phase: Phase) -> None: ...

    def drafter_called(self, inputs: dict[str, Any], output: Any) -> None: ...

    def drafts_proposed(self, read: Callable[[], Any]) -> None: ...

    def sampling(self) -> None: ...

    def output_receiver(self) -> "OutputReceiver": ...

    def step_failed(self, error: BaseException) -> None: ...


@dataclass
class ObservedStep:
    """What a replayed step produced, in the shapes the recorder stored (tensors on host)."""

    batch_order: list[str] = field(default_factory=list)
    input_ids: Any = None  # padded, as the model read them
    positions: Any = None
    hidden_states: Any = None
    logits: Any = None
    grammar_bitmask: Any = None  # the grammar mask as it reached the logits (`StepOutputs.grammar_bitmask`)
    sampled_token_ids: list[list[int]] | None = None
    kv_after: list[dict[str, Any]] = field(default_factory=list)  # per KV group: layer -> written blocks
    # Per KV group, layer -> the blocks a step rebuilt on the KV cache as earlier steps left it
    # reads, as its forward read them (None: not asked for)
    kv_read: list[dict[str, Any]] | None = None
    # KV blocks the forward changed beyond those the step writes (per group, sorted)
    kv_changed_elsewhere: list[list[int]] = field(default_factory=list)
    # A window's later step: per KV cache group, the digest of the KV it wrote (`KVWritten`)
    kv_written: list[Any] = field(default_factory=list)
    forward_us: float | None = None  # the checked (first) forward
    dispatch: Any = None  # the GraphDispatch this replay's engine chose for the step
    # speculative decoding: the drafter's proposals ([requests, proposed]) and its model calls
    proposals: Any = None
    drafter_calls: list[Any] = field(default_factory=list)  # DrafterPass records
    # the recorded orders to the drafter this vLLM could not give it (`name=value`): a step of
    # another release; its proposals are then this vLLM's own, not comparable with the recording
    drafter_orders_dropped: list[str] = field(default_factory=list)


# The replay driver's stand-in for the runner's model call: (original, args, kwargs) -> output.
ModelCall = Callable[[Callable[..., Any], tuple, dict], Any]
