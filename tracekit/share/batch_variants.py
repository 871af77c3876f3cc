"""The recorded step rebuilt in other batches, for `tracekit invariance`.

Each builder returns a `Step` the replay driver runs like a recorded one: the same request
states, only in another batch, its inputs, KV blocks and scheduler record to match
(`reduce_step.step_running`). Like a shrunk step, a variant holds no outputs: the engine that
recorded the step never ran it.
"""

import dataclasses
from typing import Any

import torch

from tracekit.errors import UsageError
from tracekit.format.schema import RequestState, Step, blocks_covering
from tracekit.integrations.vllm.records.step_records import filler_sampling
from tracekit.share.reduce_step import reduce_step, step_running

# The prefix of filler requests' ids (no recorded request id starts with it: checked).
FILLER_PREFIX = "tracekit-filler-"


def alone(step: Step, req_id: str) -> Step:
    """The step with request `req_id` only, scheduling what it scheduled."""
    return reduce_step(step, {req_id: step.request(req_id).num_scheduled_tokens})


def reordered(step: Step, order: list[str]) -> Step:
    """The same batch scheduled in `order` (a permutation of the recorded batch order)."""
    if sorted(order) != sorted(step.batch_order):
        raise UsageError(f"{order} is not an order of the step's batch {step.batch_order}")
    return _with_requests(step, [step.request(req_id) for req_id in order])


def recomputed(step: Step, req_id: str) -> Step:
    """The batch with request `req_id` computing its cached prefix again: it starts from no
    computed tokens and schedules its prefix and its recorded chunk, writing the prefix's KV
    into the same blocks instead of reading it."""
    old = step.request(req_id)
    new = dataclasses.replace(
        old, num_computed_tokens=0, num_scheduled_tokens=old.num_computed_tokens + old.num_scheduled_tokens,
        extras=dict(old.extras),
    )
    return _with_requests(step, [new if request.req_id == req_id else request for request in _in_order(step)])


def with_fillers(step: Step, extra_tokens: int, max_requests: int, max_model_len: int) -> Step:
    """The batch followed by new greedy prefills of `extra_tokens` tokens in all (each at most
    `max_model_len - 1`), in KV blocks no request of the step owns, so that the step schedules
    that many more tokens. Refused (UsageError) where the engine could not hold them."""
    requests = _in_order(step)
    if any(request.req_id.startswith(FILLER_PREFIX) for request in requests):
        raise UsageError(f"the step already holds a request whose id starts with {FILLER_PREFIX!r}")
    per_filler = max_model_len - 1
    count = -(-extra_tokens // per_filler)
    if extra_tokens < 1 or len(requests) + count > max_requests:
        raise UsageError(f"{extra_tokens} more token(s) need {count} filler request(s); the engine runs at most "
                         f"{max_requests} request(s) per step and the step has {len(requests)}")
    source = [token for request in requests for token in request.prompt_token_ids] or [0]
    template = next(iter(requests)).sampling_params
    free = [_free_blocks(step, group_index) for group_index in range(len(step.kv.groups))]
    fillers = []
    for index in range(count):
        length = min(per_filler, extra_tokens - index * per_filler)
        block_ids = []
        for group_index, group in enumerate(step.kv.groups):
            needed = blocks_covering(length, group.layout.block_size)
            if len(free[group_index]) < needed:
                raise UsageError(f"the KV cache has too few free blocks for {extra_tokens} filler token(s)")
            block_ids.append(free[group_index][:needed])
            free[group_index] = free[group_index][needed:]
        fillers.append(RequestState(
            req_id=f"{FILLER_PREFIX}{index}",
            prompt_token_ids=[source[position % len(source)] for position in range(length)],
            output_token_ids=[],
            block_ids=block_ids,
            num_computed_tokens=0,
            num_scheduled_tokens=length,
            sampling_params=filler_sampling(template),
        ))
    return _with_requests(step, [*requests, *fillers])


def is_filler(req_id: str) -> bool:
    return req_id.startswith(FILLER_PREFIX)


def _in_order(step: Step) -> list[RequestState]:
    return [step.request(req_id) for req_id in step.batch_order]


def _free_blocks(step: Step, group_index: int) -> list[int]:
    """Block ids of the group no request of the step owns, lowest first (block 0 is vLLM's null
    block, never handed to a request)."""
    used = {block for request in step.requests for block in request.block_ids[group_index]}
    layout = step.kv.groups[group_index].layout
    return [block for block in range(1, layout.num_blocks) if block not in used]


def _tokens(request: RequestState) -> tuple[list[int], list[int]]:
    """The input ids and positions of the tokens `request` schedules: a drafted request's last
    sampled token, then the drafts it verifies."""
    start, end = request.num_computed_tokens, request.num_computed_tokens + request.num_scheduled_tokens
    known = [*request.prompt_token_ids, *request.output_token_ids, *request.draft_token_ids]
    return known[start:end], list(range(start, end))


def _with_requests(step: Step, requests: list[RequestState]) -> Step:
    """`step` running `requests`, in this order: inputs, KV blocks read and scheduler record to match."""
    if isinstance(step.positions, torch.Tensor) and step.positions.dim() != 1:
        raise UsageError("the step's positions are not one per token (M-RoPE): only the requests alone can be built")
    recorded_ids = {request.req_id for request in step.requests}
    pairs = [(step.request(request.req_id) if request.req_id in recorded_ids else request, request)
             for request in requests]
    ids, positions = ([value for request in requests for value in _tokens(request)[part]] for part in (0, 1))
    return step_running(step, pairs, _like(torch.tensor(ids), step.input_ids), _like(torch.tensor(positions), step.positions))


def _like(values: torch.Tensor, recorded: Any) -> torch.Tensor:
    return values.to(recorded.dtype) if isinstance(recorded, torch.Tensor) else values
