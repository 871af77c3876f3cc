"""Where vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`, and its CPU subclass)
keeps a step, for the shared adapter base.

V2 keeps no per-request objects: each request owns a slot (`req_states.req_id_to_index`, not
stable between runs) in persistent arrays: `all_token_ids` (prompt, then outputs, up to the
device-only `total_len`), `prompt_len`, `prefill_len` (tokens given when the request was added,
larger than the prompt on resume), the sampler's `seeds` (an explicit seed, or one drawn from
NumPy's global RNG when unseeded: sampling depends only on seed, position and token id) and the
block tables. Its `SamplingParams` are not kept, so the adapter remembers them from
`scheduled_new_reqs`.

A slot outlives its request (`SLOT_STATE_LEFT_BEHIND`): the recorder keeps the entry a step's
drafter reads (`runner_state["last_sampled"]`), the replay puts it back, and `start_afresh` leaves
a later bundle's requests nothing of an earlier one's.

The step's inputs are built into persistent buffers; `model_state.prepare_inputs(input_batch,
...)` is called with them on every path just before the model runs. The model call is
`runner.model(**inputs)` eagerly and for PIECEWISE graphs (through
`cudagraph_manager.run_pw_graph`), and `cudagraph_manager.run_fullgraph(descriptor)` — a graph
replay that reads those buffers — for FULL graphs. Logits come from `model.compute_logits` inside
`sample_tokens`, which returns an async output.
"""

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tracekit.format.schema import GraphDispatch, RequestState, Step, is_prefill
from tracekit.integrations.seam import BatchFacts, RequestProgress, RunnerKind
from tracekit.integrations.vllm.records import spec_decode
from tracekit.integrations.vllm.runners import runner_state
from tracekit.integrations.vllm.runners.lora_adapters import request_adapter_name
from tracekit.integrations.vllm.runners.method_patch import call_shadowed, shadowed
from tracekit.integrations.vllm.runners.runner_adapter import RunnerAdapter, Shadows, StepMark


@dataclass
class _V2Mark:
    """V2's part of a `StepMark`: the step's own objects, which the next step replaces."""

    input_batch: Any  # the step's InputBatch (None before it was built)
    scheduled: list[str]  # req_ids in the scheduler's order
    dispatched: Any  # the BatchExecutionDescriptor
    attention: Any  # the attention metadata
    # Each slot's last sampled token as the step began (a copy on the device; where the engine
    # drafts): the step's sampling overwrites it, and the drafter reads it after.
    last_sampled: torch.Tensor | None = None


# The per-slot buffers of `req_states` that `add_request` leaves as the slot's last request left
# them, and that a step may read: the last sampled token (a decode's input; an ngram proposal of a
# row that sampled none), the prefill tokens after a chunk (a model drafter's next input), the
# drafts. (The sampler's per-slot states are written for every request added; its penalty counts
# are read only through a zero penalty unless recounted.) The same in vLLM 0.26 to 0.34.
SLOT_STATE_LEFT_BEHIND = ("last_sampled_tokens", "next_prefill_tokens", "draft_tokens")
# Those buffers as each runner held them when tracekit first met it (`_keep_fresh_slot_state`).
_fresh_slot_state: "weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


class V2Adapter(RunnerAdapter):
    kind = RunnerKind.V2
    frees_preempted = True  # `finish_requests` frees a preempted request's slot; it comes back new
    bookkeeping_method = "postprocess_sampled"
    foreign_attributes = RunnerAdapter.foreign_attributes | {
        "model_state", "prepare_inputs", "cudagraph_manager", "dispatch", "run_fullgraph", "postprocess_sampled",
        "update_requests", "req_states", "block_tables", "sampler", "sampling_states", "seeds", "prefill_len",
        "prompt_len", "total_len", "all_token_ids", "last_sampled_tokens", "index_to_req_id", "req_id_to_index",
        "idx_mapping_np", "num_computed_tokens_np", "prefill_len_np", "num_reqs", "input_ids", "positions", "cg_mode",
        "scheduled_new_reqs", "preempted_req_ids", "finished_req_ids", "num_blocks", "gpu", "np", "copy_to_uva",
        "input_batch", "req_ids", "num_scheduled_tokens", "sampling_params", "add_request", "prepare_attn",
        "cudagraph_runtime_mode", "batch_descriptor", "speculator", "draft_tokens", "draft_logits", "_capture_descs",
        "_candidates", "num_tokens", "structured_outputs_worker", "apply_grammar_bitmask", "next_prefill_tokens",
    }

    def __init__(self, runner: Any, release: Any):
        super().__init__(runner, release)
        self._new_requests: dict[str, Any] = {}  # req_id -> NewRequestData (its SamplingParams)
        self._input_batch: Any = None  # the step's InputBatch, seen at model_state.prepare_inputs
        self._dispatched: Any = None  # the step's BatchExecutionDescriptor
        self._attention: Any = None  # the step's attention metadata (layer -> metadata)
        self._scheduled: list[str] = []  # the step's req_ids in the scheduler's order
        if hasattr(runner, "req_states"):  # the runner as built, before tracekit rebuilds a step on it
            self._keep_fresh_slot_state()

    def _keep_fresh_slot_state(self) -> dict[str, torch.Tensor]:
        """The slot buffers of `SLOT_STATE_LEFT_BEHIND` as this runner held them when tracekit
        first met it (copied then, once a runner)."""
        fresh = _fresh_slot_state.get(self.runner)
        if fresh is None:
            states = self.runner.req_states
            fresh = _fresh_slot_state[self.runner] = {name: getattr(states, name).clone()
                                                      for name in SLOT_STATE_LEFT_BEHIND}
        return fresh

    @classmethod
    def matches(cls, runner: Any) -> bool:
        try:
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        except ImportError:
            return False
        return isinstance(runner, GPUModelRunner)

    def step_begins(self) -> None:
        super().step_begins()
        self._input_batch = self._dispatched = self._attention = None

    def kind_shadows(self) -> Shadows:
        adapter = self

        def prepare_inputs(original: Callable) -> Callable:
            def wrapper(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
                adapter._input_batch = input_batch
                return original(input_batch, *args, **kwargs)

            return wrapper

        def dispatch(original: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                adapter._dispatched = original(*args, **kwargs)
                return adapter._dispatched

            return wrapper

        def prepare_attn(original: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                adapter._attention = original(*args, **kwargs)
                return adapter._attention

            return wrapper

        shadows: Shadows = [(self.runner.model_state, {"prepare_inputs": prepare_inputs, "prepare_attn": prepare_attn})]
        if self.runner.cudagraph_manager is not None:
            shadows.append((self.runner.cudagraph_manager, {"dispatch": dispatch}))
        return shadows

    def grammar_shadows(self, applied: Callable[[torch.Tensor], None]) -> Shadows:
        """`sample` computes the logits, masks them (`structured_outputs_worker.apply_grammar_bitmask`,
        in place) and samples: reported once the mask is on (a runner without structured outputs
        has no worker)."""
        worker = getattr(self.runner, "structured_outputs_worker", None)
        if worker is None:
            return []

        def apply_grammar_bitmask(original: Callable) -> Callable:
            def wrapper(logits: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(logits, *args, **kwargs)
                applied(logits)
                return result

            return wrapper

        return [(worker, {"apply_grammar_bitmask": apply_grammar_bitmask})]

    def model_call_shadows(self, model_call: Callable[[Callable], Callable]) -> list[AbstractContextManager]:
        contexts = [call_shadowed(self.runner.model, model_call)]
        if self.runner.cudagraph_manager is not None:
            contexts.append(shadowed(self.runner.cudagraph_manager, {"run_fullgraph": model_call}))
        return contexts

    def forward_inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's padded input buffers (a FULL graph replay reads them, no arguments)."""
        batch = self._input_batch
        if batch is None:
            return kwargs.get("input_ids"), kwargs.get("positions")
        return batch.input_ids, batch.positions

    def scheduler_output_seen(self, scheduler_output: Any) -> None:
        """Remember what V2 forgets: each new (or resumed) request's sampling params."""
        super().scheduler_output_seen(scheduler_output)
        self._scheduled = list(scheduler_output.num_scheduled_tokens)
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self._new_requests.pop(req_id, None)
        for request in scheduler_output.scheduled_new_reqs:
            self._new_requests[request.req_id] = request

    def kind_mark(self) -> _V2Mark:
        last_sampled = self.runner.req_states.last_sampled_tokens.clone() if self._speculator is not None else None
        return _V2Mark(self._input_batch, self._scheduled, self._dispatched, self._attention, last_sampled)

    def _rows(self, kept: _V2Mark | None = None) -> list[tuple[int, str, int]]:
        """(batch row, req_id, slot) of the step's batch, in batch order; before the batch is
        built (a step that failed preparing it), in the scheduler's order."""
        kept = kept or self.kind_mark()
        batch = kept.input_batch
        if batch is None:
            slots = self.runner.req_states.req_id_to_index
            return [(row, req_id, slots[req_id]) for row, req_id in enumerate(kept.scheduled) if req_id in slots]
        return [(row, req_id, int(batch.idx_mapping_np[row])) for row, req_id in enumerate(batch.req_ids)]

    def _num_computed_tokens(self, kept: _V2Mark, row: int, slot: int) -> int:
        batch = kept.input_batch
        if batch is None:
            return int(self.runner.req_states.num_computed_tokens_np[slot])
        return int(batch.num_computed_tokens_np[row])

    def batch_facts(self, scheduler_output: Any) -> BatchFacts:
        """From host arrays only (no device read): a row below its `prefill_len` still prefills,
        one past it decodes, and so it has sampled `computed - prompt + 1` outputs."""
        batch, states = self._input_batch, self.runner.req_states
        num_prefills = 0
        for row, _, slot in self._rows():
            computed, prompt = int(batch.num_computed_tokens_np[row]), int(states.prompt_len.np[slot])
            num_prefills += is_prefill(computed, prompt, self._outputs(row, slot))
        return BatchFacts(batch.num_reqs, int(scheduler_output.total_num_scheduled_tokens), num_prefills, frozenset(batch.req_ids))

    def request_progress(self, scheduler_output: Any, req_ids: list[str]) -> list[RequestProgress]:
        new, wanted = set(self.new_req_ids(scheduler_output)), set(req_ids)
        return [RequestProgress(req_id in new, self._outputs(row, slot)) for row, req_id, slot in self._rows()
                if req_id in wanted]

    def _outputs(self, row: int, slot: int) -> int:
        """The outputs a batch row's request had before the step (see `batch_facts`)."""
        batch = self._input_batch
        computed, prompt = int(batch.num_computed_tokens_np[row]), int(self.runner.req_states.prompt_len.np[slot])
        prefill_len = int(batch.prefill_len_np[row])
        return computed - prompt + 1 if computed >= prefill_len else prefill_len - prompt

    def batch_order_after_execute(self) -> list[str]:
        return list(self.runner.execute_model_state.input_batch.req_ids)

    def marked_req_ids(self, mark: StepMark) -> list[str]:
        return [req_id for _, req_id, _ in self._rows(mark.kept)]

    def request_objects(self, mark: StepMark) -> list[tuple[str, Any]]:
        """The `NewRequestData` each request came with (V2 keeps no request objects); None for
        a request that started before the adapter saw it."""
        return [(req_id, self._new_requests.get(req_id)) for req_id in self.marked_req_ids(mark)]

    def request_states(self, mark: StepMark, input_ids: torch.Tensor | None) -> list[RequestState]:
        """Each request's tokens as they stood before the step: its `prefill_len` tokens, or
        through the tokens the step computes when it is past them (bookkeeping appends the
        sampled token behind those)."""
        kept, scheduled = mark.kept, mark.scheduler_output.num_scheduled_tokens
        result = [self._request_state(req_id, slot, self._num_computed_tokens(kept, row, slot), int(scheduled[req_id]),
                                      kept.last_sampled)
                  for row, req_id, slot in self._rows(kept)]
        if spec_decode.speculative_config(self.runner) is not None:
            spec_decode.add_drafts(result, mark.scheduler_output.scheduled_spec_decode_tokens, input_ids)
            if input_ids is not None:
                spec_decode.align_to_positions(result, mark.positions)
                self._add_draft_logits(result)
        return result

    def held_request_states(self, mark: StepMark) -> list[RequestState]:
        """The requests holding a slot outside the marked batch (running, not scheduled in this
        step; V2 frees a preempted request's slot), as they stand."""
        batch = set(self.marked_req_ids(mark))
        states = self.runner.req_states
        last_sampled = states.last_sampled_tokens if self._speculator is not None else None
        return [self._request_state(req_id, slot, int(states.num_computed_tokens_np[slot]), 0, last_sampled)
                for req_id, slot in states.req_id_to_index.items() if req_id not in batch]

    def _request_state(self, req_id: str, slot: int, num_computed: int, num_scheduled: int,
                       last_sampled: torch.Tensor | None = None) -> RequestState:
        """The request in `slot` before a step that computes `num_scheduled` of its tokens after
        its first `num_computed` (its token ids read from the device); `last_sampled`: each
        slot's last sampled token as the step began, kept where the engine drafts."""
        states, tables = self.runner.req_states, self.runner.block_tables
        before_step = max(int(states.prefill_len.np[slot]), num_computed + num_scheduled)
        prompt_len = int(states.prompt_len.np[slot])
        total_len = min(int(states.total_len.gpu[slot]), before_step)
        tokens = states.all_token_ids.gpu[slot, :total_len].tolist()
        new_request = self._new_requests.get(req_id)
        params = new_request.sampling_params if new_request is not None else None
        runner_state = self._runner_state(slot)
        if last_sampled is not None:
            runner_state["last_sampled"] = int(last_sampled[slot, 0])
        return RequestState(
            req_id=req_id,
            prompt_token_ids=tokens[:prompt_len],
            output_token_ids=tokens[prompt_len:],
            block_ids=[
                table.gpu[slot, : int(tables.num_blocks.np[group, slot])].tolist()
                for group, table in enumerate(tables.block_tables)
            ],
            num_computed_tokens=num_computed,
            num_scheduled_tokens=num_scheduled,
            sampling_params=self.sampling_record(params, f"{req_id}.sampling_params"),
            runner_state=runner_state,
            lora_adapter=request_adapter_name(new_request),
        )

    def runner_states(self, mark: StepMark) -> dict[str, dict[str, Any]]:
        """Each request's `prefill_len` and sampling seed, read off host arrays."""
        return {req_id: self._runner_state(slot) for _, req_id, slot in self._rows(mark.kept)}

    def _runner_state(self, slot: int) -> dict[str, Any]:
        sampling = self.runner.sampler.sampling_states if self.runner.sampler is not None else None
        kept = {"prefill_len": int(self.runner.req_states.prefill_len.np[slot])}
        if sampling is not None:
            kept["seed"] = int(sampling.seeds.np[slot])
        return kept

    def live_req_ids(self) -> dict[str, int]:
        return self.runner.req_states.req_id_to_index

    def _add_draft_logits(self, requests: list[RequestState]) -> None:
        """Probabilistic drafting: each drafted request's rows of the drafter's logits, which the
        rejection sampler reads by slot (`runner_state["draft_logits"]`, `[drafts, vocab]`)."""
        logits = self.release.draft_logits_by_slot(self._speculator)
        slots = self.runner.req_states.req_id_to_index
        if logits is None:
            return
        for request in requests:
            if request.draft_token_ids and request.req_id in slots:
                request.runner_state["draft_logits"] = logits[slots[request.req_id], : len(request.draft_token_ids)]

    def proposals(self) -> torch.Tensor | None:
        """The drafts the speculator proposed in the step that just sampled, kept by slot on the
        device (`req_states.draft_tokens`), in the step's batch order."""
        if self._speculator is None or self._input_batch is None:
            return None
        return self.runner.req_states.draft_tokens[self._input_batch.idx_mapping]

    def drafter_model(self) -> Any:
        return getattr(self._speculator, "model", None)

    @property
    def _speculator(self) -> Any:
        """The runner's drafter (None: the engine decodes one token a step)."""
        return getattr(self.runner, "speculator", None)

    def graph_dispatch(self, num_tokens: int, num_tokens_padded: int, mark: StepMark | None = None,
                       attention: bool = True) -> GraphDispatch:
        kept = mark.kept if mark is not None else self.kind_mark()
        descriptor = kept.dispatched
        return runner_state.graph_dispatch(
            self.runner,
            num_tokens,
            descriptor.cg_mode.name if descriptor is not None else "NONE",
            num_tokens_padded,
            descriptor,
            kept.attention if attention else None,
        )

    def piecewise_graph_key(self, num_tokens_padded: int, context: Any) -> Any:
        """V2 dispatches through its own graph manager: a step it ran under PIECEWISE graphs has
        their key in its forward context; other steps are not offered another graph here."""
        from vllm.config import CUDAGraphMode

        if context is None or context.cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            return None
        return context.batch_descriptor

    def keep_only_graphs(self, keep: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """The graph manager's descriptors to capture, and each token count's candidates for
        dispatch (a runner without a graph manager captures none)."""
        manager = self.runner.cudagraph_manager
        if manager is None:
            return []
        kept = []
        for mode, descs in list(manager._capture_descs.items()):
            descs[:] = [desc for desc in descs if keep(desc.cg_mode.name, desc.num_tokens)]
            kept.extend((desc.cg_mode.name, desc.num_tokens) for desc in descs)
            if not descs:
                del manager._capture_descs[mode]
        candidates = {key: [desc for desc in descs if keep(desc.cg_mode.name, desc.num_tokens)]
                      for key, descs in manager._candidates.items()}
        manager._candidates = {key: descs for key, descs in candidates.items() if descs}
        return sorted(set(kept))

    def start_afresh(self) -> None:
        """The slot buffers vLLM leaves behind a finished request (`SLOT_STATE_LEFT_BEHIND`),
        as the runner held them when tracekit first met it (`_keep_fresh_slot_state`): before any
        replayed step (after a `--kv recompute` bundle's prefills too)."""
        states = self.runner.req_states
        for name, values in self._keep_fresh_slot_state().items():
            getattr(states, name).copy_(values)

    def replay_shadows(self, step: Step, held: list[RequestState] = ()) -> Shadows:
        """Put back each request's seed as the sampler adds it, and its `prefill_len` and last
        sampled token before the runner decides which rows prefill (so decodes run as decodes,
        with their last sampled token as input, and a drafter reads the slot as recorded: a
        bundle from before tracekit kept that token has it from the request's outputs, or for a
        request that sampled none, as the fresh engine holds it); the same for `held`, requests
        added without being scheduled."""
        runner = self.runner
        recorded = {request.req_id: request for request in [*step.requests, *held]}
        states = runner.req_states

        def sampler_add_request(original: Callable) -> Callable:
            def wrapper(slot: int, *args: Any, **kwargs: Any) -> Any:
                result = original(slot, *args, **kwargs)
                request = recorded.get(states.index_to_req_id.get(slot))
                seed = request.runner_state.get("seed") if request is not None else None
                if seed is not None:
                    runner.sampler.sampling_states.seeds.np[slot] = seed
                return result

            return wrapper

        def update_requests(original: Callable) -> Callable:
            def wrapper(scheduler_output: Any) -> Any:
                for req_id, request in recorded.items():
                    slot = states.req_id_to_index.get(req_id)
                    prefill_len = request.runner_state.get("prefill_len")
                    if slot is None or prefill_len is None:
                        continue
                    states.prefill_len.np[slot] = prefill_len
                    last_sampled = request.runner_state.get("last_sampled")
                    if last_sampled is None and request.output_token_ids and request.num_computed_tokens >= prefill_len:
                        last_sampled = request.output_token_ids[-1]
                    if last_sampled is not None:
                        states.last_sampled_tokens[slot, 0] = last_sampled
                    self._restore_drafts(slot, request)
                states.prefill_len.copy_to_uva()
                return original(scheduler_output)

            return wrapper

        shadows: Shadows = [(runner, {"update_requests": update_requests})]
        if runner.sampler is not None:
            shadows.append((runner.sampler, {"add_request": sampler_add_request}))
        return shadows

    def _restore_drafts(self, slot: int, request: RequestState) -> None:
        """The drafts V2 keeps by slot for the next step (and, probabilistic drafting, their
        logits), which its inputs and rejection sampler read: the scheduler sends only their number."""
        drafts = request.draft_token_ids
        if not drafts:
            return
        tokens = self.runner.req_states.draft_tokens
        tokens[slot, : len(drafts)] = torch.tensor(drafts, dtype=tokens.dtype).to(tokens.device)
        logits = request.runner_state.get("draft_logits")
        kept = self.release.draft_logits_by_slot(self._speculator) if logits is not None else None
        if kept is not None:
            kept[slot, : logits.shape[0]] = logits.to(kept.device, kept.dtype)
