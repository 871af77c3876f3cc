"""What a step of a speculatively decoding engine holds, read alike on both model runners: the
drafts from the input ids the forward reads, where every runner puts them (docs/GUIDE.md,
"Speculative decoding"), and a request's computed tokens from the positions it reads
(`align_to_positions`).
"""

from typing import Any, Callable

import torch

from tracekit.format.schema import DrafterPass, RequestState, SpecDecodeRecord, draft_rows, token_runs
from tracekit.integrations.vllm.runners.runner_state import PLACEHOLDER_TOKEN, hidden_states_of

# Drafters that propose from a request's own token ids (an n-gram lookup over its prompt and
# output, suffix decoding's tree of them): they read every token id a drafting request holds.
HISTORY_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix"})
# Drafters whose proposals depend on what they kept from earlier requests (suffix decoding's tree
# of past outputs, a user's class), which no bundle holds: their proposals are shown, not decisive.
STATEFUL_DRAFTERS = frozenset({"suffix", "custom_class"})


def drafter_reads(record: SpecDecodeRecord | None) -> str | None:
    """What of a request's token ids the step's drafter reads beyond those the step computes:
    "history" (all of them: `HISTORY_DRAFTERS`), "next" (a model drafter reads the target's
    tokens shifted by one; a prefill chunk's last row reads the prompt token after the chunk, or
    with vLLM's padded drafter batch the request's newest token), None (the engine does not
    draft)."""
    if record is None:
        return None
    return "history" if record.method in HISTORY_DRAFTERS else "next"


def speculative_config(runner: Any) -> Any:
    """The engine's speculative decoding config (None: it decodes one token a step)."""
    return getattr(runner.vllm_config, "speculative_config", None)


def new_record(runner: Any) -> SpecDecodeRecord | None:
    """The record of a step of `runner`'s engine, before its drafter ran (None without speculative decoding)."""
    config = speculative_config(runner)
    if config is None:
        return None
    return SpecDecodeRecord(method=str(config.method), num_speculative_tokens=int(config.num_speculative_tokens),
                            padded_drafter_batch=not getattr(config, "disable_padded_drafter_batch", False))


def add_drafts(requests: list[RequestState], scheduled: dict[str, list[int]], input_ids: torch.Tensor | None) -> None:
    """Each request's drafts this step (`draft_token_ids`): the last `n` of its scheduled input ids,
    `n` its drafts in the scheduler output (`scheduled`); the scheduler's ids themselves where
    there are no input ids (a step that failed before preparing them)."""
    flat = input_ids.tolist() if input_ids is not None and scheduled else None
    for request, run in zip(requests, token_runs(requests)):
        count = min(len(scheduled.get(request.req_id, ())), len(run) - 1)  # its last sampled token comes first
        if count <= 0:
            continue
        drafts = [flat[row] for row in draft_rows(run, count)] if flat is not None else scheduled[request.req_id]
        request.draft_token_ids = [int(token) for token in drafts]


def first_positions(requests: list[RequestState], positions: torch.Tensor | None) -> list[tuple[RequestState, int, int]]:
    """Each request (batch order) with the first position its forward read, and the step's row
    count; none where the positions are no token counts (M-RoPE's, or not whole numbers)."""
    if positions is None or positions.dim() != 1 or positions.is_floating_point() or positions.is_complex():
        return []
    flat = positions.tolist()
    return [(request, int(flat[run.start]), len(flat)) for request, run in zip(requests, token_runs(requests))
            if run and run.start < len(flat)]


def align_to_positions(requests: list[RequestState], positions: torch.Tensor | None) -> None:
    """Where a request's first position in the forward is not the computed-token count the runner
    holds (under async scheduling the count assumes every draft of the previous step was accepted,
    corrected on the device while the forward runs), take the position: such a request decodes, and
    keeps exactly the outputs before that position and the one there (its last sampled token, the
    forward's first input), `-1` where the runner held none. (A bundle's positions are not trusted:
    a position that would add more placeholders than the step has input rows is no correction.)"""
    for request, position, rows in first_positions(requests, positions):
        known = position + 1 - len(request.prompt_token_ids)
        if position < 0 or position == request.num_computed_tokens or known - len(request.output_token_ids) > rows:
            continue
        request.num_computed_tokens = position
        outputs = request.output_token_ids[:max(known, 0)]
        request.output_token_ids = outputs + [PLACEHOLDER_TOKEN] * (max(known, 0) - len(outputs))


def proposals_tensor(proposed: Any, num_requests: int) -> torch.Tensor:
    """The drafter's proposals for the next step as `[requests, proposed]` int64, `-1` where a
    request got fewer: a device tensor as it is (its copy to host is the caller's), or vLLM's
    host lists (ngram) packed."""
    if isinstance(proposed, torch.Tensor):
        return proposed.reshape(num_requests, -1)
    rows = [list(row) for row in (proposed or [])][:num_requests]
    rows += [[]] * (num_requests - len(rows))
    width = max((len(row) for row in rows), default=0)
    packed = torch.full((num_requests, width), PLACEHOLDER_TOKEN, dtype=torch.int64)
    for index, row in enumerate(rows):
        if row:
            packed[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return packed


def fill_drafts_from_inputs(step: Any) -> None:
    """A bundle recorded before tracekit kept each request's drafts: take them from its
    scheduler output record's counts and its input ids, where the forward read them."""
    if step.input_ids is not None and not any(request.draft_token_ids for request in step.requests):
        add_drafts([step.request(req_id) for req_id in step.batch_order],
                   step.scheduler_output.scheduled_spec_decode_tokens, step.input_ids)


def drafter_pass(inputs: dict[str, Any], output: Any, to_host: Callable[[torch.Tensor], torch.Tensor]) -> DrafterPass:
    """A drafter model call's inputs (`input_ids`, `positions`, and the target's `hidden_states`
    an EAGLE drafter reads) and its output, each tensor through `to_host`."""

    def copied(tensor: Any) -> Any:
        return to_host(tensor) if isinstance(tensor, torch.Tensor) else None

    return DrafterPass(
        input_ids=copied(inputs.get("input_ids")),
        positions=copied(inputs.get("positions")),
        hidden_states_in=copied(inputs.get("hidden_states")),
        hidden_states=copied(hidden_states_of(output)),
    )
