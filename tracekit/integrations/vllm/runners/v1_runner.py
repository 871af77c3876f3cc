"""Where vLLM's V1 model runner (`vllm/v1/worker/gpu_model_runner.py` and its CPU subclass)
keeps a step, for the shared adapter base.

V1 keeps each request in `runner.requests[req_id]` (a `CachedRequestState`: prompt and output
tokens, block ids, sampling params, a `torch.Generator` for seeded requests) and the batch in the
persistent `runner.input_batch`. The model call is `runner._model_forward(input_ids=...,
positions=...)` on every path: eager, compiled, and CUDA graphs (vLLM's graph wrapper sits inside
`runner.model`). Under async scheduling the last sampled token of a decode is a placeholder
(-1) in the request state until the engine reads the async output; the forward reads the real
id from the previous step's device tensor.
"""

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tracekit.format.schema import GraphDispatch, RequestState, Step, is_prefill
from tracekit.integrations.seam import BatchFacts, RequestProgress, RunnerKind
from tracekit.integrations.vllm.records import spec_decode
from tracekit.integrations.vllm.runners import runner_state
from tracekit.integrations.vllm.runners.lora_adapters import request_adapter_name
from tracekit.integrations.vllm.runners.method_patch import shadowed
from tracekit.integrations.vllm.runners.runner_adapter import RunnerAdapter, Shadows, StepMark
from tracekit.integrations.vllm.runners.runner_state import PLACEHOLDER_TOKEN


@dataclass
class _V1Mark:
    """V1's part of a `StepMark` (see `V1Adapter.kind_mark`)."""

    req_ids: list[str]
    states: list[Any]  # the CachedRequestState of each, in batch order
    num_computed: Any  # numpy copies, in batch order
    num_known: Any  # prompt + output tokens each request had (`num_tokens_no_spec`)
    generator_states: dict[int, torch.Tensor]  # batch row -> state, for seeded requests
    context: Any  # the model call's ForwardContext (None outside one)
    # probabilistic drafting: the drafter's probabilities for this step's drafts, and whose rows
    # they are (`runner._draft_probs`, `_draft_prob_req_ids`: set by the previous step's drafter)
    draft_probs: tuple[Any, list[str]] | None = None


class V1Adapter(RunnerAdapter):
    kind = RunnerKind.V1
    bookkeeping_method = "_bookkeeping_sync"
    foreign_attributes = RunnerAdapter.foreign_attributes | {
        "input_batch", "requests", "_model_forward", "_bookkeeping_sync", "num_reqs", "num_computed_tokens_cpu",
        "num_prompt_tokens", "num_tokens_no_spec", "req_ids", "req_id_to_index", "generator", "prompt_token_ids",
        "output_token_ids", "block_ids", "sampling_params", "num_scheduled_tokens", "cudagraph_runtime_mode",
        "batch_descriptor", "add_request", "get_state", "set_state", "attn_metadata", "cudagraph_dispatcher",
        "dispatch", "num_tokens", "generators", "cudagraph_keys", "drafter", "_draft_token_ids", "_draft_probs",
        "_draft_prob_req_ids", "scheduled_spec_decode_tokens", "num_computed_tokens", "manual_seed", "seed",
        "prev_sampled_token_ids", "prev_req_id_to_index", "_sample", "sampled_token_ids_cpu",
        "async_copy_ready_event",
    }

    @classmethod
    def matches(cls, runner: Any) -> bool:
        return hasattr(runner, "input_batch") and hasattr(runner, "requests") and hasattr(type(runner), "_model_forward")

    def grammar_shadows(self, applied: Callable[[torch.Tensor], None]) -> Shadows:
        """`sample_tokens` masks the logits (`apply_grammar_bitmask`) and hands them straight to
        `_sample`."""
        def sample(original: Callable) -> Callable:
            def wrapper(logits: Any, *args: Any, **kwargs: Any) -> Any:
                applied(logits)
                return original(logits, *args, **kwargs)

            return wrapper

        return [(self.runner, {"_sample": sample})]

    def model_call_shadows(self, model_call: Callable[[Callable], Callable]) -> list[AbstractContextManager]:
        return [shadowed(self.runner, {"_model_forward": model_call})]

    def forward_inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return kwargs.get("input_ids"), kwargs.get("positions")

    def batch_facts(self, scheduler_output: Any) -> BatchFacts:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        prompts = batch.num_prompt_tokens[:num_reqs]
        known = batch.num_tokens_no_spec[:num_reqs]
        num_prefills = sum(
            is_prefill(int(c), int(p), int(k) - int(p)) for c, p, k in zip(computed, prompts, known)
        )
        return BatchFacts(num_reqs, int(scheduler_output.total_num_scheduled_tokens), num_prefills, frozenset(batch.req_ids))

    def request_progress(self, scheduler_output: Any, req_ids: list[str]) -> list[RequestProgress]:
        batch, new = self.runner.input_batch, set(self.new_req_ids(scheduler_output))
        rows = [batch.req_id_to_index[req_id] for req_id in req_ids]
        return [RequestProgress(req_id in new, int(batch.num_tokens_no_spec[row]) - int(batch.num_prompt_tokens[row]))
                for req_id, row in zip(req_ids, rows)]

    def batch_order_after_execute(self) -> list[str]:
        return list(self.runner.input_batch.req_ids)

    def sampled_ids_kept(self) -> bool:
        """Not under async scheduling: every sampled id is a placeholder in the request states."""
        return not self.runner.scheduler_config.async_scheduling

    def live_req_ids(self) -> dict[str, Any]:
        return self.runner.requests

    def held_request_states(self, mark: StepMark) -> list[RequestState]:
        """The requests the runner holds outside the marked batch — not scheduled in it, or
        preempted (V1 is not told; it keeps their request objects) — as their objects hold them
        (under async scheduling with placeholders for the ids the engine had not read yet)."""
        batch = set(mark.kept.req_ids)
        return [self._request_state(req_id, state, state.output_token_ids, int(state.num_computed_tokens), 0,
                                    {"generator_state": state.generator.get_state()} if state.generator is not None else {})
                for req_id, state in self.runner.requests.items() if req_id not in batch]

    def _request_state(self, req_id: str, state: Any, outputs: list[int], num_computed: int, num_scheduled: int,
                       runner_state: dict[str, Any]) -> RequestState:
        """The request object `state` (a `CachedRequestState`) as a recorded request, with these
        output tokens, token counts and runner state."""
        return RequestState(
            req_id=req_id,
            prompt_token_ids=list(state.prompt_token_ids or []),
            output_token_ids=list(outputs),
            block_ids=[list(ids) for ids in state.block_ids],
            num_computed_tokens=num_computed,
            num_scheduled_tokens=num_scheduled,
            sampling_params=self.sampling_record(state.sampling_params, f"{req_id}.sampling_params"),
            runner_state=runner_state,
            lora_adapter=request_adapter_name(state),
        )

    def runner_states(self, mark: StepMark) -> dict[str, dict[str, Any]]:
        """Seeded requests' generator states at the marked step (the mark copied them)."""
        kept: _V1Mark = mark.kept
        return {kept.req_ids[row]: {"generator_state": state} for row, state in kept.generator_states.items()}

    def kind_mark(self) -> "_V1Mark":
        """The batch's request objects (the runner only appends to them), how many tokens each
        knew (bookkeeping appends the sampled ones), seeded requests' generator states (sampling
        advances them) and the forward context of the model call, if in one."""
        batch, requests = self.runner.input_batch, self.runner.requests
        req_ids = list(batch.req_ids)
        num_reqs = len(req_ids)
        generators = batch.generators
        return _V1Mark(
            req_ids=req_ids,
            states=[requests[req_id] for req_id in req_ids],
            num_computed=batch.num_computed_tokens_cpu[:num_reqs].copy(),
            num_known=batch.num_tokens_no_spec[:num_reqs].copy(),
            generator_states={index: generator.get_state() for index, generator in generators.items()} if generators else {},
            context=runner_state.forward_context(),
            draft_probs=_draft_probs(self.runner),
        )

    def marked_req_ids(self, mark: StepMark) -> list[str]:
        return list(mark.kept.req_ids)

    def request_objects(self, mark: StepMark) -> list[tuple[str, Any]]:
        return list(zip(mark.kept.req_ids, mark.kept.states))

    def request_states(self, mark: StepMark, input_ids: torch.Tensor | None) -> list[RequestState]:
        """Per-request state in batch order, prompt and output tokens kept apart; an output
        still a placeholder (async scheduling) is taken from the input ids the forward reads."""
        kept: _V1Mark = mark.kept
        scheduled = mark.scheduler_output.num_scheduled_tokens
        runner_states = self.runner_states(mark)
        states = []
        for index, (req_id, state) in enumerate(zip(kept.req_ids, kept.states)):
            outputs = state.output_token_ids
            known = int(kept.num_known[index]) - len(state.prompt_token_ids or [])  # before this step's bookkeeping
            states.append(self._request_state(req_id, state, outputs[:known] if 0 <= known <= len(outputs) else outputs,
                                              int(kept.num_computed[index]), int(scheduled[req_id]),
                                              runner_states.get(req_id, {})))
        if spec_decode.speculative_config(self.runner) is not None:
            spec_decode.add_drafts(states, mark.scheduler_output.scheduled_spec_decode_tokens, input_ids)
            if input_ids is not None:
                spec_decode.align_to_positions(states, mark.positions)
                _add_draft_probs(states, kept.draft_probs)
        fill_placeholders(states, input_ids)
        return states

    def proposals(self) -> torch.Tensor | None:
        """The drafts the drafter proposed in the step that just sampled (`_draft_token_ids`: host
        lists from ngram, a device tensor from a model drafter; zeros where the step did not fit
        the drafter), as `[requests, proposed]`."""
        if spec_decode.speculative_config(self.runner) is None:
            return None
        return spec_decode.proposals_tensor(self.runner._draft_token_ids, len(self.runner.input_batch.req_ids))

    def drafter_model(self) -> Any:
        return getattr(getattr(self.runner, "drafter", None), "model", None)

    def graph_dispatch(self, num_tokens: int, num_tokens_padded: int, mark: StepMark | None = None,
                       attention: bool = True) -> GraphDispatch:
        """Read from the forward context the runner set for the model call (a step that failed
        before its forward has none: it was dispatched to nothing)."""
        context = mark.kept.context if mark is not None else runner_state.forward_context()
        if context is None:
            return runner_state.graph_dispatch(self.runner, num_tokens, "NONE", num_tokens_padded)
        return runner_state.graph_dispatch(
            self.runner,
            num_tokens,
            context.cudagraph_runtime_mode.name,
            num_tokens_padded,
            context.batch_descriptor,
            context.attn_metadata if attention else None,
        )

    def piecewise_graph_key(self, num_tokens_padded: int, context: Any) -> Any:
        """Asked of the runner's graph dispatcher with FULL graphs excluded: it answers with the
        PIECEWISE key only where that graph was captured (its padded size must be the step's:
        the model call's input buffers are that long)."""
        dispatcher = getattr(self.runner, "cudagraph_dispatcher", None)
        if dispatcher is None or context is None:
            return None
        from vllm.config import CUDAGraphMode

        mode, key = dispatcher.dispatch(num_tokens_padded, valid_modes={CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE})
        return key if mode == CUDAGraphMode.PIECEWISE and key.num_tokens == num_tokens_padded else None

    def keep_only_graphs(self, keep: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """The graph dispatcher's keys are the graphs `capture_model` captures and the ones it
        dispatches to (a runner without a dispatcher captures none).

        A model drafter (EAGLE, MTP) dispatches its own calls by its own keys, but its graphs are
        captured in the runner's capture loop, at the runner's sizes: with the runner's keys cut,
        the drafter would dispatch to graphs never captured, and vLLM refuses to capture one during
        a step ("CUDA graph capturing detected at an inappropriate time"). Such a runner keeps
        every graph."""
        dispatcher = getattr(self.runner, "cudagraph_dispatcher", None)
        if dispatcher is None:
            return []
        if getattr(getattr(self.runner, "drafter", None), "cudagraph_dispatcher", None) is not None:
            keep = lambda mode, size: True  # noqa: E731 - see the docstring
        kept = []
        for mode, keys in dispatcher.cudagraph_keys.items():
            for key in list(keys):
                if keep(mode.name, key.num_tokens):
                    kept.append((mode.name, key.num_tokens))
                else:
                    keys.discard(key)
        return sorted(set(kept))

    def scheduler_output_for(self, step: Step, held: list[RequestState] = (),
                             loras: dict[str, Any] | None = None) -> Any:
        """`held` go straight into the runner's request objects: V1 adds every new request of a
        scheduler output to its persistent batch, so the scheduler output cannot carry a request
        it does not schedule."""
        for request in held:
            self.runner.requests[request.req_id] = self._request_object(request, loras or {})
        return self.release.new_requests_output(step, loras=loras)

    def _request_object(self, request: RequestState, loras: dict[str, Any]) -> Any:
        """A `CachedRequestState` holding a recorded request, built as the runner builds one for a
        new request (its generator seeded, then set to the recorded state)."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        params = self.release.from_plain(request.sampling_params)
        generator = None
        if params is not None and params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
            recorded = request.runner_state.get("generator_state")
            if recorded is not None:
                generator.set_state(recorded)
        return CachedRequestState(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            mm_features=[],
            sampling_params=params,
            generator=generator,
            block_ids=tuple(list(ids) for ids in request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            lora_request=loras.get(request.lora_adapter) if request.lora_adapter is not None else None,
        )

    def start_afresh(self) -> None:
        """Drop what the runner keeps of its last step for the next one (under async scheduling
        the sampled ids on the device, by request id, and their copy on the host that repairs
        the -1 placeholders of output tokens before sampling): requests added again under the
        same ids take their inputs and output tokens from their recorded tokens instead. (With
        the host copy kept and the index dropped, vLLM's `update_async_output_token_ids` fails
        its assert on the next step that samples with penalties.)"""
        batch = self.runner.input_batch
        batch.prev_sampled_token_ids = None
        batch.prev_req_id_to_index = None
        batch.sampled_token_ids_cpu = None
        batch.async_copy_ready_event = None

    def replay_shadows(self, step: Step, held: list[RequestState] = ()) -> Shadows:
        """Put back each request's recorded output tokens and generator state as the runner
        adds it to its persistent batch (`held` requests are never added there: their request
        objects are made whole, `scheduler_output_for`)."""
        recorded = {request.req_id: request for request in step.requests}

        in_batch = [recorded[req_id] for req_id in step.batch_order if req_id in recorded]
        hold_tokens_up_to_the_inputs(in_batch, step.positions)
        fill_placeholders(in_batch, step.input_ids)

        def add_request(original: Callable) -> Callable:
            def wrapper(state: Any) -> Any:
                request = recorded.get(state.req_id)
                if request is not None:
                    state.output_token_ids.extend(request.output_token_ids)
                    generator_state = request.runner_state.get("generator_state")
                    if state.generator is not None and generator_state is not None:
                        state.generator.set_state(generator_state)
                return original(state)

            return wrapper

        _restore_draft_probs(self.runner, step)
        return [(self.runner.input_batch, {"add_request": add_request})]


def _draft_probs(runner: Any) -> tuple[Any, list[str]] | None:
    """What the rejection sampler of the step about to run reads of the drafter's probabilities."""
    probs = getattr(runner, "_draft_probs", None)
    return (probs, list(runner._draft_prob_req_ids or [])) if probs is not None else None


def _add_draft_probs(states: list[RequestState], draft_probs: tuple[Any, list[str]] | None) -> None:
    """Each drafted request's rows of the drafter's probabilities (`runner_state["draft_probs"]`,
    `[drafts, vocab]`), as `_get_spec_decode_draft_probs` hands them to the rejection sampler."""
    if draft_probs is None:
        return
    probs, req_ids = draft_probs
    for state in states:
        if state.draft_token_ids and state.req_id in req_ids:
            state.runner_state["draft_probs"] = probs[req_ids.index(state.req_id), : len(state.draft_token_ids)]


def _restore_draft_probs(runner: Any, step: Step) -> None:
    """Give the runner what the recorded step's rejection sampler read of the drafter's
    probabilities (probabilistic drafting), or nothing where it read none: not what an earlier
    step of the replay engine left."""
    if spec_decode.speculative_config(runner) is None:
        return
    rows = [(request.req_id, request.runner_state.get("draft_probs")) for request in step.requests]
    rows = [(req_id, probs) for req_id, probs in rows if probs is not None]
    if not rows:
        runner._draft_probs, runner._draft_prob_req_ids = None, None
        return
    width = max(probs.shape[0] for _, probs in rows)
    stacked = torch.zeros((len(rows), width, rows[0][1].shape[-1]), dtype=rows[0][1].dtype, device=runner.device)
    for row, (_, probs) in enumerate(rows):
        stacked[row, : probs.shape[0]] = probs.to(runner.device)
    runner._draft_probs, runner._draft_prob_req_ids = stacked, [req_id for req_id, _ in rows]


def hold_tokens_up_to_the_inputs(requests: list[RequestState], positions: torch.Tensor | None) -> None:
    """A decode whose tokens end before the first position its forward read gets placeholders up
    to and including it (requests in batch order). Under async scheduling with drafts, V1 holds
    the drafts the previous step accepted only once the engine reads that step's output, after
    this step was prepared: the runner of a replay, given the tokens as recorded, would put the
    step's last sampled token and drafts rows early (an MTP step on an H100 verified zeros). The
    tokens before that position are in the KV cache, never read again as inputs; the one at it is
    then filled from the input ids (`fill_placeholders`). A bundle's positions are not trusted:
    no request is padded by more than the step has rows."""
    for request, position, rows in spec_decode.first_positions(requests, positions):
        missing = position + 1 - len(request.prompt_token_ids) - len(request.output_token_ids)
        if position >= len(request.prompt_token_ids) and 0 < missing <= rows:
            request.output_token_ids.extend([PLACEHOLDER_TOKEN] * missing)


def fill_placeholders(requests: list[RequestState], input_ids: torch.Tensor | None) -> None:
    """Replace placeholder output tokens at positions the step computes by the input ids the
    forward reads there (requests in batch order; each one's scheduled tokens are a run of the
    flattened input ids): the forward read the real ids from the device (see the module
    docstring). Bundles recorded before tracekit filled them in hold the placeholders, so a
    replay fills them the same way."""
    if input_ids is None or not any(PLACEHOLDER_TOKEN in request.output_token_ids for request in requests):
        return
    flat = input_ids.tolist()
    offset = 0
    for request in requests:
        prompt = len(request.prompt_token_ids)
        for position in range(request.num_computed_tokens, request.num_computed_tokens + request.num_scheduled_tokens):
            output = position - prompt
            if 0 <= output < len(request.output_token_ids) and request.output_token_ids[output] == PLACEHOLDER_TOKEN:
                request.output_token_ids[output] = int(flat[offset + position - request.num_computed_tokens])
        offset += request.num_scheduled_tokens
