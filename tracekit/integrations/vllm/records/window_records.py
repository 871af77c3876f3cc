"""The request states of a window's later steps (which it records without them: docs/GUIDE.md,
"Windows"), derived from the first step's requests and those held outside its batch by the
runner's own bookkeeping (V1's `GPUModelRunner._update_states`, V2's `finish_requests`,
`add_requests` and `update_requests`), replayed on the recorded scheduler outputs step after step
(`RequestLedger`). A step that schedules a request the window does not hold by then is a bad bundle.
"""

import copy
from dataclasses import dataclass, field, replace

from tracekit.errors import BundleError
from tracekit.format.schema import (
    CarriedStep,
    GraphDispatch,
    KVGroupSnapshot,
    KVMode,
    KVSnapshot,
    NewRequestRecord,
    RequestState,
    SchedulerOutputRecord,
    Step,
    StepTiming,
)
from tracekit.integrations.vllm.records import spec_decode
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written


@dataclass
class WindowStep:
    """One step of a window as a replay needs it: the step whole (for a later step: its request
    states derived, no KV blocks saved), the requests the runner holds outside its batch before
    it, and those its scheduler output adds (the first step's: all of its requests)."""

    step: Step
    held: list[RequestState] = field(default_factory=list)
    new: list[RequestState] = field(default_factory=list)
    carried: CarriedStep | None = None  # as recorded; None for the first step

    @property
    def index(self) -> int:
        return self.step.index


class RequestLedger:
    """Every request the runner holds, by id, kept as its bookkeeping keeps it from one recorded
    scheduler output to the next. The blocks each step writes follow from the scheduler outputs
    alone (a recorder keeps them before any sampled id is read); the output tokens from the
    sampled ids too (`sampled`)."""

    def __init__(self, requests: list[RequestState], frees_preempted: bool):
        self.held = {request.req_id: copy.deepcopy(request) for request in requests}
        self.frees_preempted = frees_preempted

    def sampled(self, batch_order: list[str], sampled: list[list[int]] | None) -> None:
        """A step's sampled ids appended to its requests' outputs: the real ids (where V1 under
        async scheduling holds -1 placeholders, a request rebuilt from these gets the ids)."""
        for req_id, ids in zip(batch_order, sampled or []):
            if req_id in self.held:
                self.held[req_id].output_token_ids.extend(ids)

    def apply(self, record: SchedulerOutputRecord, where: str) -> set[str]:
        """One recorded scheduler output applied to the held requests; returns the ids it adds.
        Finished requests are dropped (V2 also frees preempted ones; V1 keeps a preempted
        request's object until it resumes); new requests (and resumed ones a release sends whole)
        come from their `NewRequestData`; cached ones take their computed tokens and new blocks
        (one resumed replaces its table), their outputs from `all_token_ids` where the scheduler
        sent them (V1 under async scheduling), and drop outputs beyond `num_output_tokens`."""
        held = self.held
        for req_id in record.outside_the_batch if self.frees_preempted else record.finished_req_ids:
            held.pop(req_id, None)
        for entry in record.scheduled_new_reqs:
            held[entry.req_id] = _new_request(entry)
        cached = record.scheduled_cached_reqs
        for req_id, computed, blocks, outputs in zip(cached.req_ids, cached.num_computed_tokens,
                                                     cached.new_block_ids, cached.num_output_tokens):
            request = held.get(req_id)
            if request is None:
                raise BundleError(f"{where} schedules request {req_id!r}, which the window does not hold by then")
            request.num_computed_tokens = computed
            if req_id in cached.resumed_req_ids:
                request.block_ids = [list(ids) for ids in blocks] if blocks else [[] for _ in request.block_ids]
            elif blocks is not None:
                if len(blocks) != len(request.block_ids):
                    raise BundleError(f"{where}: request {req_id!r} gets blocks for {len(blocks)} KV cache groups, not "
                                      f"{len(request.block_ids)}")
                for ids, more in zip(request.block_ids, blocks):
                    ids.extend(more)
            tokens = cached.all_token_ids.get(req_id)
            if tokens is not None and outputs > 0:
                request.output_token_ids = list(tokens[-outputs:])
            elif outputs < len(request.output_token_ids):
                del request.output_token_ids[outputs:]
        return {entry.req_id for entry in record.scheduled_new_reqs}

    def scheduled(self, record: SchedulerOutputRecord, req_id: str, where: str) -> RequestState:
        """A request of the step's batch as the step runs it, with the tokens the record schedules
        for it (a copy: the ledger goes on)."""
        request = self.held.get(req_id)
        if request is None or req_id not in record.num_scheduled_tokens:
            raise BundleError(f"{where}: its batch order names {req_id!r}, which its scheduler output does not "
                              "schedule or the window does not hold")
        state = copy.deepcopy(request)
        state.num_scheduled_tokens = record.num_scheduled_tokens[req_id]
        state.draft_token_ids = []  # a step's own (`window_steps`), not those of the step that held it first
        return state

    def written(self, record: SchedulerOutputRecord, block_sizes: list[int]) -> list[list[int]]:
        """Per KV cache group, the blocks a step writes (those of its scheduled tokens), once its
        scheduler output is applied."""
        requests = [replace(self.held[req_id], num_scheduled_tokens=count)
                    for req_id, count in record.num_scheduled_tokens.items() if req_id in self.held]
        return [blocks_read_and_written(requests, group, size)[1] for group, size in enumerate(block_sizes)]

    def scheduled_blocks(self, record: SchedulerOutputRecord) -> dict[str, tuple[int, list[list[int]]]]:
        """Per request a step schedules, once its scheduler output is applied: its scheduled
        tokens and its blocks per KV cache group (copies: the ledger goes on)."""
        return {req_id: (count, [list(ids) for ids in self.held[req_id].block_ids])
                for req_id, count in record.num_scheduled_tokens.items() if req_id in self.held}

    def outside(self, batch: set[str]) -> list[RequestState]:
        """The requests held outside a batch, as they stand."""
        return [copy.deepcopy(request) for req_id, request in self.held.items() if req_id not in batch]


def window_steps(first: Step, frees_preempted: bool, num_kv_blocks: int) -> list[WindowStep]:
    """Every step of the window `first` opens, in order (just the first for a single step).
    `frees_preempted`: the runner kind drops a preempted request's state (Model Runner V2);
    `num_kv_blocks`: the recorded KV cache's, which every block id a step names lies below."""
    window = first.window
    steps = [WindowStep(first, list(window.held_requests) if window else [], list(first.requests))]
    if window is None:
        return steps
    ledger = RequestLedger([*first.requests, *window.held_requests], frees_preempted)
    previous = first
    for carried in window.steps:
        where = f"bundle content: step {carried.index} of the window"
        ledger.sampled(previous.batch_order, previous.outputs.sampled_token_ids if previous.outputs else None)
        new = ledger.apply(carried.scheduler_output, where)
        batch = []
        for req_id in carried.batch_order:
            request = ledger.scheduled(carried.scheduler_output, req_id, where)
            request.runner_state = dict(carried.runner_states.get(req_id, request.runner_state))
            ledger.held[req_id].runner_state = dict(request.runner_state)
            batch.append(request)
        if first.spec_decode is not None:  # the drafts and counts the forward read (`spec_decode`)
            spec_decode.add_drafts(batch, carried.scheduler_output.scheduled_spec_decode_tokens, carried.input_ids)
            spec_decode.align_to_positions(batch, carried.positions)
        _require_blocks_fit(batch, len(first.kv.groups), num_kv_blocks, where)
        step = _as_step(first, carried, batch)
        steps.append(WindowStep(step, held=ledger.outside(set(carried.batch_order)),
                                new=[request for request in batch if request.req_id in new], carried=carried))
        previous = step
    return steps


def _require_blocks_fit(requests: list[RequestState], num_groups: int, num_kv_blocks: int, where: str) -> None:
    """Each request of a later step holds a block list per KV cache group, every block in the cache."""
    for request in requests:
        if len(request.block_ids) != num_groups:
            raise BundleError(f"{where}: request {request.req_id!r} holds blocks for {len(request.block_ids)} KV cache "
                              f"group(s), not the {num_groups} of the first step")
        for ids in request.block_ids:
            if ids and max(ids) >= num_kv_blocks:
                raise BundleError(f"{where}: request {request.req_id!r} holds block {max(ids)}, beyond the "
                                  f"{num_kv_blocks} KV blocks of bundle.engine.num_kv_blocks")


def _new_request(entry: NewRequestRecord) -> RequestState:
    prompt = entry.prompt_token_ids or []
    return RequestState(
        req_id=entry.req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list((entry.prefill_token_ids or [])[len(prompt):]),
        block_ids=[list(ids) for ids in entry.block_ids],
        num_computed_tokens=entry.num_computed_tokens,
        num_scheduled_tokens=0,
        sampling_params=entry.sampling_params,
        lora_adapter=entry.lora_request.lora_name if entry.lora_request else None,
    )


def _as_step(first: Step, carried: CarriedStep, requests: list[RequestState]) -> Step:
    """A later step whole, from its record and its derived requests; the KV blocks saved are
    those it recorded (read from the prefix cache: no step of the window before it wrote them),
    the cache holds the rest as the steps before wrote it."""
    found = carried.kv.groups if carried.kv is not None else []
    groups = []
    for number, group in enumerate(first.kv.groups):
        read, written = blocks_read_and_written(requests, number, group.layout.block_size)
        saved = found[number] if number < len(found) else None
        groups.append(KVGroupSnapshot(group.layer_names, group.layout, read, written,
                                      list(saved.saved_block_ids) if saved else [], dict(saved.before) if saved else {}))
    graph = carried.graph or GraphDispatch(first.graph.compilation_mode, first.graph.cudagraph_mode)
    return Step(
        index=carried.index,
        trigger=f"window from step {first.index}",
        scheduler_output=carried.scheduler_output,
        batch_order=list(carried.batch_order),
        requests=requests,
        input_ids=carried.input_ids,
        positions=carried.positions,
        kv=KVSnapshot(mode=KVMode.NONE.value, groups=groups),
        graph=graph,
        rng=dict(carried.rng),
        outputs=carried.outputs,
        timing=carried.timing or StepTiming(),
        error=carried.error,
        grammar=carried.grammar,
        lora_adapters=list(first.lora_adapters),  # the slots as the first step left them
        # the window's speculative decoding, with the step's own proposals (its drafter's calls are not kept)
        spec_decode=first.spec_decode and replace(first.spec_decode, proposals=carried.proposals, drafter_calls=[]),
    )
