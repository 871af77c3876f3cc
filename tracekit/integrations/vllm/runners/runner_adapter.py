"""The base of every model-runner adapter: what record and replay do alike on any runner.

Record and replay never touch a runner themselves; they hold its adapter. This base holds what
vLLM's two model runners share (the shadows of `step_shadows`, reading the engine's settings, KV
caches and device); a subclass per runner kind (`v1_runner`, `v2_runner`) says only where its
runner keeps things, and a release (`releases/`) picks the subclasses that fit it.

Recording: `observe(observer)` shadows the runner's methods for one armed session and reports
the step's progress to a `StepObserver`. Replay: `observe(observer, model_call=...)` with the
replay driver's model call in place of the model's, inside `replaying(step)`, which restores
what the runner keeps per request as the recorded requests are added.
"""

from collections.abc import Container, Iterable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from tracekit.format.schema import (
    EngineConfig,
    Environment,
    GraphDispatch,
    LoRAAdapter,
    ParallelRank,
    RequestState,
    SamplingParamsRecord,
    SchedulerOutputRecord,
    SpecDecodeRecord,
    Step,
    blocks_covering,
)
from tracekit.graphs.device import DeviceBackend, get_device_backend
from tracekit.integrations.seam import BatchFacts, ModelCall, RequestProgress, RunnerKind, StepObserver
from tracekit.integrations.vllm.records import serialize, spec_decode
from tracekit.integrations.vllm.records.step_features import not_replayable_in
from tracekit.integrations.vllm.runners import runner_state
from tracekit.integrations.vllm.runners.lora_adapters import resident_adapters, slot_table
from tracekit.integrations.vllm.runners.method_patch import call_shadowed, shadowed
from tracekit.integrations.vllm.runners.step_shadows import StepShadows

# (object, {method name: wrapper factory}) pairs, shadowed together for a session.
Shadows = list[tuple[Any, dict[str, Callable[[Callable], Callable]]]]


@dataclass
class StepMark:
    """A step as it stood just before its forward, kept cheaply: references to what the rest of
    the step leaves alone (the scheduler output, the live input buffers, the runner's request
    objects and forward context) and copies of only what the step itself changes (the global RNG
    states sampling draws from, seeded requests' generators, how many tokens each request knew).
    `RunnerAdapter.request_states(mark)` and `graph_dispatch(mark)` read the step from it later in
    the same step: after a failure, or once the step's outputs turned out not finite.

    The live input buffers are the runner's: valid until the next step prepares its inputs."""

    scheduler_output: Any
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    rng: dict[str, torch.Tensor]
    kept: Any  # what the runner kind needs to read its requests back (`kind_mark`)
    lora_slots: list[int | None] = field(default_factory=list)  # the adapter id in each LoRA slot


class RunnerAdapter:
    """One model runner seen through tracekit's seam. Subclasses set `kind` and supply the
    methods marked "per runner kind"."""

    kind: ClassVar[RunnerKind]
    # Whether the runner drops a preempted request's state (else it keeps it until it resumes).
    frees_preempted: ClassVar[bool] = False
    # The runner's method that updates its request states with the sampled ids.
    bookkeeping_method: ClassVar[str]
    # Every vLLM attribute the base touches; a subclass adds its runner's.
    foreign_attributes: ClassVar[frozenset[str]] = frozenset({
        "execute_model", "sample_tokens", "model", "compute_logits", "get_model", "device", "compilation_config",
        "vllm_config", "execute_model_state", "total_num_scheduled_tokens", "skip_compiled", "mode",
        "scheduler_config", "preempted_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs", "resumed_req_ids",
        "new_block_ids",
    })

    def __init__(self, runner: Any, release: Any):
        self.runner = runner
        self.release = release
        self.lora_requests: dict[int, Any] = {}  # int id -> the LoRARequest last seen with it

    # -- per runner kind ---------------------------------------------------------------------

    @classmethod
    def matches(cls, runner: Any) -> bool:
        raise NotImplementedError

    def model_call_shadows(self, model_call: Callable[[Callable], Callable]) -> list[AbstractContextManager]:
        """Contexts that route every model call of a step through `model_call(original)`."""
        raise NotImplementedError

    def forward_inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The live (padded) input ids and positions the model call about to run reads."""
        raise NotImplementedError

    def kind_shadows(self) -> Shadows:
        """Extra shadows this runner kind needs while observed (may be none)."""
        return []

    def grammar_shadows(self, applied: Callable[[torch.Tensor], None]) -> Shadows:
        """Shadows that call `applied(logits)` where this runner kind has masked the logits with
        the step's grammar and is about to sample from them."""
        raise NotImplementedError

    def replay_shadows(self, step: Step, held: list[RequestState] = ()) -> Shadows:
        """Shadows that put back what this runner keeps per request, as the step's requests (and
        `held`, requests added without being scheduled) are added."""
        raise NotImplementedError

    def sampled_ids_kept(self) -> bool:
        """Whether the runner's request states hold the token ids it sampled (if not, the
        recorder keeps them: `tracekit.record.sampled_ids`)."""
        return True

    def proposals(self) -> torch.Tensor | None:
        """Speculative decoding: the drafts the drafter proposed in the step that just sampled,
        `[requests in batch order, proposed]` (-1 where fewer; maybe on the device). None without."""
        return None

    def drafter_model(self) -> Any:
        """The speculative drafter's model (EAGLE, ...), whose calls a step's drafter makes; None
        where the engine has none (ngram drafts without a model)."""
        return None

    def new_req_ids(self, scheduler_output: Any) -> list[str]:
        """The requests a scheduler output starts."""
        return [request.req_id for request in scheduler_output.scheduled_new_reqs]

    def scheduled_req_ids(self, scheduler_output: Any) -> Iterable[str]:
        """The requests a scheduler output runs (a view: nothing copied)."""
        return scheduler_output.num_scheduled_tokens.keys()

    def client_request_matcher(self, client_id: str) -> Callable[[str], bool]:
        """Whether a request of this engine is one its API server's client knows as `client_id`."""
        return self.release.client_request_matcher(client_id)

    def live_req_ids(self) -> Container[str]:
        """The requests the runner holds state for (preempted ones too), before the next step's
        scheduler output is applied."""
        raise NotImplementedError

    def held_request_states(self, mark: StepMark) -> list[RequestState]:
        """The requests the runner holds outside the marked step's batch, as they stand (a window's
        later step may schedule them again), each with no tokens scheduled."""
        raise NotImplementedError

    def runner_states(self, mark: StepMark) -> dict[str, dict[str, Any]]:
        """Per request of the marked step, what only this runner kind keeps
        (`RequestState.runner_state`), from host memory (a window's later steps keep it)."""
        raise NotImplementedError

    def scheduler_output_seen(self, scheduler_output: Any) -> None:
        """Remember what the runner forgets about new requests: the LoRA adapters they named (the
        slots keep only ids), and whatever else the runner kind forgets."""
        for request in scheduler_output.scheduled_new_reqs:
            if request.lora_request is not None:
                self.lora_requests[request.lora_request.lora_int_id] = request.lora_request

    def batch_facts(self, scheduler_output: Any) -> BatchFacts:
        raise NotImplementedError

    def request_progress(self, scheduler_output: Any, req_ids: list[str]) -> list[RequestProgress]:
        """Where each of `req_ids` (requests of the step, once its batch is built) stands."""
        raise NotImplementedError

    def kind_mark(self) -> Any:
        """The runner kind's part of a `StepMark`: references to its request state and copies of
        what the step's later phases change in it; cheap (no per-request work, no device read)."""
        raise NotImplementedError

    def request_states(self, mark: StepMark, input_ids: torch.Tensor | None) -> list[RequestState]:
        """Each request of the marked step in batch order, as it stood before the forward, with
        every token the forward reads as the forward reads it (`input_ids`: the input ids of
        the model call, on host or device)."""
        raise NotImplementedError

    def graph_dispatch(self, num_tokens: int, num_tokens_padded: int, mark: StepMark | None = None,
                       attention: bool = True) -> GraphDispatch:
        """What the marked step (by default: the current one, during its model call) was
        dispatched to; `attention`: also summarise its attention metadata, which reads a few
        device tensors."""
        raise NotImplementedError

    def keep_only_graphs(self, keep: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """Cut the runner's table of CUDA graphs, before its `capture_model`, to the (mode name,
        padded size) pairs `keep` accepts: it captures those alone, and dispatches any other
        batch without a graph. Returns the pairs kept (a lean replay engine: `lean_build`)."""
        raise NotImplementedError

    def piecewise_graph_key(self, num_tokens_padded: int, context: Any) -> Any:
        """The key of vLLM's own PIECEWISE graph of `num_tokens_padded` tokens, captured by this
        engine, under which the step's model call (its forward `context`) can replay those graphs
        instead of the form it was dispatched to; None where the engine has none."""
        return None

    def batch_order_after_execute(self) -> list[str]:
        """The batch order the runner ran the step just executed in."""
        raise NotImplementedError

    def marked_req_ids(self, mark: StepMark) -> list[str]:
        """The marked step's requests, in batch order."""
        raise NotImplementedError

    def request_objects(self, mark: StepMark) -> list[tuple[str, Any]]:
        """Each request of the marked step with the vLLM object that describes it (what it was
        brought with: prompt embeds, multimodal features, LoRA, pooling), None where the runner
        keeps none; batch order."""
        raise NotImplementedError

    def preempted(self, scheduler_output: Any) -> frozenset[str]:
        """The requests a scheduler output preempts (their KV blocks may go to other requests)."""
        return frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())

    def mark(self, scheduler_output: Any, input_ids: torch.Tensor | None, positions: torch.Tensor | None) -> StepMark:
        """The step about to run its forward, kept cheaply (see `StepMark`)."""
        return StepMark(scheduler_output, input_ids, positions, self.rng_states(), self.kind_mark(),
                        slot_table(self.runner))

    def lora_adapters(self, mark: StepMark) -> list[LoRAAdapter]:
        """The adapters in the LoRA slots when the marked step ran (their files are read later)."""
        known = dict(self.lora_requests)
        for _, request in self.request_objects(mark):
            lora_request = getattr(request, "lora_request", None)
            if lora_request is not None:
                known[lora_request.lora_int_id] = lora_request
        return resident_adapters(mark.lora_slots, known)

    # -- the step, observed ------------------------------------------------------------------

    def observe(self, observer: StepObserver, model_call: ModelCall | None = None) -> AbstractContextManager:
        """Shadow the runner for a session reporting to `observer` (`StepShadows`). `model_call`
        (replay) takes the place of every model call; by default the model runs, reported before
        and after."""
        step = StepShadows(self, observer, model_call)
        shadows: Shadows = [
            (self.runner, {"execute_model": step.execute_model, "sample_tokens": step.sample_tokens,
                           self.bookkeeping_method: step.bookkeeping}),
            (self.runner.model, {"compute_logits": step.compute_logits}),
            *self.kind_shadows(),
            *self.grammar_shadows(step.grammar_applied),
        ]
        contexts = self.model_call_shadows(step.model_call)
        drafter = self.drafter_model()
        if drafter is not None:
            contexts.append(call_shadowed(drafter, step.drafter_call))
        return _entered(shadows, contexts)

    def step_begins(self) -> None:
        """A new step (not a dummy run) starts: forget the last one's per-step facts (none here)."""

    # -- replay ------------------------------------------------------------------------------

    def replaying(self, step: Step, held: list[RequestState] = ()) -> AbstractContextManager:
        """While the runner adds the step's requests (and `held`), put back what it keeps per request."""
        return _entered(self.replay_shadows(step, held))

    def scheduler_output_for(self, step: Step, held: list[RequestState] = (),
                             loras: dict[str, Any] | None = None) -> Any:
        """A `SchedulerOutput` in which every recorded request of the step is new, and `held`,
        requests the runner holds outside the batch, are added without being scheduled
        (`loras`: the LoRARequest of each adapter their requests name, `lora_adapters.lora_requests`)."""
        return self.release.new_requests_output(step, held, loras)

    def start_afresh(self) -> None:
        """Before a step is rebuilt from recorded requests (a single step; a window's first step
        or one it rebuilds): put back what the runner keeps beside its request states as a runner
        holds it that rebuilt no step before — what it kept of its last step, and what a finished
        request leaves in the runner (per runner kind; nothing here) — so that a step replayed on
        an engine that replayed other bundles runs as it runs alone in a fresh one."""

    def execute_and_sample(self, scheduler_output: Any) -> None:
        """Run a step's two halves outside any observed session (`--kv recompute`'s prefills)."""
        runner = self.runner
        try:
            if runner.execute_model(scheduler_output) is not None:
                raise RuntimeError("the runner produced no forward for the recorded step")
            output = runner.sample_tokens(None)
            if hasattr(output, "get_output"):  # async: done once it is read
                output.get_output()
        finally:
            runner.execute_model_state = None

    def finish(self, req_ids: list[str]) -> None:
        self.runner.execute_model(self.release.finishing_output(req_ids))

    # -- what record and replay read off the runner ------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def device_backend(self) -> DeviceBackend:
        return get_device_backend(self.runner.device)

    @property
    def model(self) -> torch.nn.Module:
        """The runner's model, unwrapped from vLLM's graph wrappers."""
        return self.runner.get_model()

    @property
    def compiled(self) -> bool:
        """Whether the engine runs the model through torch.compile (else eagerly)."""
        return int(self.runner.compilation_config.mode) != 0

    @property
    def reference_mode(self) -> str:
        return "compiled" if self.compiled else "eager"

    @property
    def compile_range_ends(self) -> list[int]:
        """The token counts where one of the engine's Inductor compile ranges ends (the release's
        `compile_range_ends`)."""
        return self.release.compile_range_ends(self.runner.compilation_config)

    def kv_groups(self) -> list[runner_state.KVGroup]:
        return self.release.kv_groups(self.runner)

    def num_scheduled_tokens(self, scheduler_output: Any) -> int:
        return int(scheduler_output.total_num_scheduled_tokens)

    def blocks_found_cached(self, scheduler_output: Any) -> list[set[int]]:
        """Per KV cache group, the blocks holding what a scheduler output's new and resumed
        requests found already computed (a prefix-cache hit): a step reads them although no step
        before it in a window wrote them."""
        sizes = [group.layout.block_size for group in self.kv_groups()]
        found: list[set[int]] = [set() for _ in sizes]

        def add(block_ids: Any, computed: int) -> None:
            for ids, size, blocks in zip(block_ids, sizes, found):
                blocks.update(ids[: blocks_covering(computed, size)])

        for request in scheduler_output.scheduled_new_reqs:
            if request.num_computed_tokens:
                add(request.block_ids, request.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for req_id, computed, blocks in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            if req_id in resumed and computed and blocks is not None:
                add(blocks, computed)
        return found

    def sampling_record(self, params: Any, path: str) -> SamplingParamsRecord | None:
        """A request's `SamplingParams` as recorded (None: it has none)."""
        return None if params is None else SamplingParamsRecord.from_plain(serialize.to_plain(params, path), path)

    def scheduler_output_record(self, scheduler_output: Any) -> SchedulerOutputRecord:
        """The scheduler output as recorded, tagged with the vLLM version."""
        return SchedulerOutputRecord.from_plain(
            serialize.to_versioned_plain(scheduler_output, self.release.version, "scheduler_output"))

    def spec_decode_record(self) -> SpecDecodeRecord | None:
        """A step's speculative decoding record, before its drafter ran (None: the engine decodes
        one token a step)."""
        return spec_decode.new_record(self.runner)

    def rng_states(self) -> dict[str, torch.Tensor]:
        """The global generators sampling may draw from."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def restore_rng_states(self, rng: dict[str, Any]) -> None:
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def engine_config(self) -> EngineConfig:
        return self.release.engine_config(self)

    def environment(self) -> Environment:
        from tracekit.integrations.vllm.engines.platform_facts import runner_environment

        return runner_environment(self.runner, self.release.version)

    def parallel_rank(self, set_id: str | None = None) -> ParallelRank:
        from tracekit.integrations.vllm.engines import ranks

        return ranks.rank_of(self.runner, set_id)

    def kinds_not_replayable(self) -> list[str]:
        """What this engine's steps may hold that tracekit records but cannot replay yet, in words."""
        return not_replayable_in(self.runner.vllm_config)


def _entered(shadows: Shadows, contexts: list[AbstractContextManager] = ()) -> ExitStack:
    """Every shadow (the same object named twice shadowed once, its methods together) and every
    context entered, as one context; if entering one fails, those entered are left again."""
    merged: dict[int, tuple[Any, dict]] = {}
    for obj, wrappers in shadows:
        merged.setdefault(id(obj), (obj, {}))[1].update(wrappers)
    stack = ExitStack()
    try:
        for obj, wrappers in merged.values():
            stack.enter_context(shadowed(obj, wrappers))
        for context in contexts:
            stack.enter_context(context)
    except BaseException:
        stack.close()
        raise
    return stack
