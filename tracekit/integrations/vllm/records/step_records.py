"""Editing the vLLM records of a recorded step for `tracekit shrink` and `tracekit redact`.

A step holds vLLM objects as plain maps (`serialize.py`): each request's `SamplingParams` and
the `SchedulerOutput` the runner received. Shrinking drops requests and shortens prefill chunks;
redacting renames requests and blanks token ids. Both must leave these records consistent with
the step's request states, and both must know what vLLM's sampling reads — which is what this
module knows, for the vLLM 0.32 series:

* The runner reads a request's token ids only at the positions it computes this step, except
  where sampling looks further: penalties (repetition: the prompt; presence/frequency: the
  outputs), bad words (the last tokens before the sampled one), the thinking-token budget (the
  outputs), and prompt logprobs (the prompt token after each computed one).
* `min_tokens`, `stop_token_ids`, `logit_bias`, `allowed_token_ids`, logprob counts and seeds
  are read as values, never through earlier tokens.
* `stop` strings and `bad_words` text are matched by the detokenizer and the frontend (the runner
  reads `_bad_words_token_ids`), `extra_args` by the scheduler and the API layer: none reach the
  forward or sampling.
"""

import dataclasses
from typing import Callable

from tracekit.format.schema import RequestState, SamplingParamsRecord, SchedulerOutputRecord, Step

# SamplingParams fields (and their neutral values) that make sampling read earlier token ids.
HISTORY_READERS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "bad_words": [],
    "_bad_words_token_ids": None,
    "thinking_token_budget": None,
}
# SamplingParams fields that hold user data nothing in the forward or sampling reads, and the
# value each is set to when redacted.
UNREAD_USER_FIELDS = {"stop": [], "bad_words": [], "extra_args": None}
# What a filler request of `tracekit invariance` samples with (over a recorded request's
# parameters, where its release has the field): greedy, no grammar, nothing that reads its
# tokens, so it draws no random numbers and changes no other request's sampling path.
FILLER_SAMPLING = {
    **HISTORY_READERS, "bad_words": [], "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
    "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "logit_bias": None, "allowed_token_ids": None,
    "logprob_token_ids": None, "prompt_logprob_token_ids": None, "structured_outputs": None, "extra_args": None,
}


def history_readers(params: SamplingParamsRecord | None) -> list[str]:
    """The sampling settings of a request that read token ids before the ones it computes."""
    return [name for name, neutral in HISTORY_READERS.items()
            if params is not None and getattr(params, name) not in (neutral, None, [])]


def reads_next_prompt_token(params: SamplingParamsRecord | None) -> bool:
    """Prompt logprobs score each computed prompt position against the token after it."""
    return params is not None and params.prompt_logprobs is not None


def redact_sampling_params(params: SamplingParamsRecord | None) -> tuple[SamplingParamsRecord | None, list[str]]:
    """A copy without the user data sampling never reads, and the names of the fields blanked."""
    removed = [name for name in UNREAD_USER_FIELDS if params is not None and getattr(params, name) not in (None, [], {})]
    return params and dataclasses.replace(params, **{name: UNREAD_USER_FIELDS[name] for name in removed}), removed


def filler_sampling(template: SamplingParamsRecord | None) -> SamplingParamsRecord | None:
    """`template` as a filler request samples (`FILLER_SAMPLING`, where it has the field)."""
    plain = template.to_plain() if template is not None else {}
    return SamplingParamsRecord.from_plain({**plain, **{k: v for k, v in FILLER_SAMPLING.items() if k in plain}}) \
        if plain else None


# The most token comparisons `_same_slice` makes looking for a run in the middle of a request's ids.
SEARCH_BUDGET = 10_000_000


def _same_slice(values: list[int], before: list[int], after: list[int]) -> list[int]:
    """`values` is a run of `before` (a request's token ids); the same run of `after`. A run found
    nowhere (or not within the search budget) comes back as neutral ids: nothing of it is kept."""
    width = len(values)
    ends = [0, len(before) - width]  # a prompt starts the ids, the newest tokens end them
    middle = range(len(before) - width - 1, 0, -1) if width * len(before) <= SEARCH_BUDGET else range(0)
    for start in [*ends, *middle]:
        if start >= 0 and before[start : start + width] == values:
            return after[start : start + width]
    return [0] * width


def rebuild_scheduler_output(
    record: SchedulerOutputRecord,
    requests: list[tuple[RequestState, RequestState]],
    other_ids: dict[str, str] | None = None,
) -> SchedulerOutputRecord:
    """The recorded `SchedulerOutput` for a changed batch.

    `requests` pairs each recorded request state kept in the batch with its new state (renamed,
    fewer tokens scheduled, token ids blanked); requests not listed are dropped. A request the
    record never had, paired with itself, is counted as scheduled (a filler of `tracekit
    invariance`). `other_ids` renames requests outside the batch (finished or preempted ones the
    record names).
    """
    other_ids = other_ids or {}
    by_old = {old.req_id: (old, new) for old, new in requests}

    def rename(req_id: str) -> str:
        return by_old[req_id][1].req_id if req_id in by_old else other_ids.get(req_id, req_id)

    def tokens(req_id: str, values: list[int] | None) -> list[int] | None:
        old, new = by_old[req_id]
        return None if values is None else _same_slice(
            values, old.prompt_token_ids + old.output_token_ids, new.prompt_token_ids + new.output_token_ids)

    new_reqs = [dataclasses.replace(entry, req_id=rename(entry.req_id), sampling_params=by_old[entry.req_id][1].sampling_params,
                                    prompt_token_ids=tokens(entry.req_id, entry.prompt_token_ids),
                                    prefill_token_ids=tokens(entry.req_id, entry.prefill_token_ids))
                for entry in record.scheduled_new_reqs if entry.req_id in by_old]
    cached = record.scheduled_cached_reqs
    kept = [i for i, req_id in enumerate(cached.req_ids) if req_id in by_old]
    columns = {name: [getattr(cached, name)[i] for i in kept] for name in cached.COLUMNS}
    if len(cached.new_token_ids) == len(cached.req_ids):
        columns["new_token_ids"] = [tokens(cached.req_ids[i], cached.new_token_ids[i]) for i in kept]
    cached = dataclasses.replace(
        cached, **columns, req_ids=[rename(cached.req_ids[i]) for i in kept],
        resumed_req_ids=sorted(rename(req_id) for req_id in cached.resumed_req_ids if req_id in by_old),
        all_token_ids={rename(req_id): tokens(req_id, values) for req_id, values in cached.all_token_ids.items()
                       if req_id in by_old})
    scheduled = {new.req_id: new.num_scheduled_tokens for _, new in requests}
    blocks = {block for _, new in requests for group in new.block_ids for block in group}
    common = record.num_common_prefix_blocks
    if common and len(requests) != len(record.num_scheduled_tokens):
        # cascade attention's shared prefix: the blocks every request of the (smaller) batch shares
        common = [_common_prefix([new.block_ids[g] for _, new in requests]) for g in range(len(common))]
    drafts = _cut_drafts(record, by_old)
    return dataclasses.replace(
        record, scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_encoder_inputs={rename(key): value for key, value in record.scheduled_encoder_inputs.items()
                                  if key in by_old},
        scheduled_spec_decode_tokens={rename(req_id): ids for req_id, ids in drafts.items()},
        num_invalid_spec_tokens=None if record.num_invalid_spec_tokens is None else {
            rename(req_id): min(value, len(drafts.get(req_id, ()))) for req_id, value in record.num_invalid_spec_tokens.items()
            if req_id in by_old},
        finished_req_ids=sorted(map(rename, record.finished_req_ids)),
        preempted_req_ids=None if record.preempted_req_ids is None else sorted(map(rename, record.preempted_req_ids)),
        new_block_ids_to_zero=None if record.new_block_ids_to_zero is None else [
            block for block in record.new_block_ids_to_zero if block in blocks],
        num_common_prefix_blocks=common,
    )


def redact_later_scheduler_output(record: SchedulerOutputRecord, tokens: Callable[[str, list[int]], list[int]]
                                  ) -> tuple[SchedulerOutputRecord, dict[str, list[str]]]:
    """A window's later `SchedulerOutput` record with each request's token ids passed through
    `tokens(req_id, ids)` — new requests' prompt and prefill ids, resumed requests'
    `all_token_ids` — and the sampling fields no runner reads removed from new requests' sampling
    parameters. Returns it and, per request, the fields removed."""
    removed, entries = {}, []
    for entry in record.scheduled_new_reqs:
        params, fields = redact_sampling_params(entry.sampling_params)
        if fields:
            removed[entry.req_id] = fields
        entries.append(dataclasses.replace(
            entry, sampling_params=params,
            **{name: tokens(entry.req_id, ids) for name in ("prompt_token_ids", "prefill_token_ids")
               if (ids := getattr(entry, name)) is not None}))
    cached = record.scheduled_cached_reqs
    cached = dataclasses.replace(cached, all_token_ids={req_id: tokens(req_id, ids)
                                                        for req_id, ids in cached.all_token_ids.items()})
    return dataclasses.replace(record, scheduled_new_reqs=entries, scheduled_cached_reqs=cached), removed


def _cut_drafts(record: SchedulerOutputRecord, by_old: dict[str, tuple[RequestState, RequestState]]
                ) -> dict[str, list[int]]:
    """The drafts each kept request schedules (its last scheduled tokens), by its recorded id: as
    many fewer as it schedules fewer tokens; a request left with none is not listed (as vLLM's
    scheduler does)."""
    kept = {}
    for req_id, tokens in record.scheduled_spec_decode_tokens.items():
        if req_id in by_old:
            old, new = by_old[req_id]
            count = max(len(tokens) - max(old.num_scheduled_tokens - new.num_scheduled_tokens, 0), 0)
            if count:
                kept[req_id] = tokens[:count]
    return kept


def _common_prefix(block_lists: list[list[int]]) -> int:
    length = 0
    for column in zip(*block_lists):
        if len(set(column)) != 1:
            break
        length += 1
    return length


def prefix_cache_hits(record: SchedulerOutputRecord) -> dict[str, int]:
    """Requests the scheduler sent for the first time with part of their prompt already computed
    (found in the prefix cache): req_id -> cached tokens."""
    return {entry.req_id: entry.num_computed_tokens for entry in record.scheduled_new_reqs if entry.num_computed_tokens}


def logits_rows(step: Step) -> list[tuple[str, int]]:
    """Who each row of the step's sampling logits belongs to, in order: (request, position), a
    request's rows being its sampled token (position 0) and then each draft it verifies (1, 2,
    ...), in batch order — the rows vLLM's runners compute logits for."""
    drafts = step.scheduler_output.scheduled_spec_decode_tokens
    rows = []
    for req_id in step.batch_order:
        count = len(drafts.get(req_id, ()))
        rows.extend((req_id, position) for position in range(1 + count))
    return rows
