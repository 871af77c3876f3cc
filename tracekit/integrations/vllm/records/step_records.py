"""Editing the vLLM records of a recorded step for `tracekit shrink` and `tracekit redact`.

A step holds vLLM objects as typed records (`format/schema.py`): each request's `SamplingParams`
and the `SchedulerOutput` the runner received. Shrinking drops requests and shortens prefill
chunks; redacting renames requests and blanks token ids. Both must leave these records consistent
with the step's request states, and both must know what vLLM's sampling reads, which each release
module says (`Release.history_readers`, `unread_user_params`, `filler_params`; a bundle may
come from any series, so the tables of all of them count).
"""

import dataclasses
import os.path
from typing import Any, Callable

from tracekit.format.schema import RequestState, SamplingParamsRecord, SchedulerOutputRecord, Step
from tracekit.integrations.vllm.releases import release_classes
from tracekit.integrations.vllm.releases.base import every_release_fact


def _sampling_fact(name: str) -> dict[str, Any]:
    release_classes()  # every series' module imported: `every_release_fact` sees all of them
    return every_release_fact(name)


def history_readers(params: SamplingParamsRecord | None) -> list[str]:
    """The sampling settings of a request that read token ids before the ones it computes, as
    any series reads them (`Release.history_readers`)."""
    readers: dict[str, None] = {}
    for release in release_classes().values() if params is not None else ():
        readers.update(dict.fromkeys(release.history_readers(params)))
    return list(readers)


def reads_next_prompt_token(params: SamplingParamsRecord | None) -> bool:
    """Prompt logprobs score each computed prompt position against the token after it."""
    return params is not None and params.prompt_logprobs is not None


def redact_sampling_params(params: SamplingParamsRecord | None) -> tuple[SamplingParamsRecord | None, list[str]]:
    """A copy without the user data sampling never reads, and the names of the fields blanked."""
    unread = _sampling_fact("unread_user_params")
    removed = [name for name in unread if params is not None and getattr(params, name) not in (None, [], {})]
    return params and dataclasses.replace(params, **{name: unread[name] for name in removed}), removed


def filler_sampling(template: SamplingParamsRecord | None) -> SamplingParamsRecord | None:
    """`template` as a filler request samples (`filler_params`, where it has the field)."""
    plain = template.to_plain() if template is not None else {}
    filler = _sampling_fact("filler_params")
    return SamplingParamsRecord.from_plain({**plain, **{k: v for k, v in filler.items() if k in plain}}) \
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
        # (`os.path.commonprefix` compares any sequences element by element)
        common = [len(os.path.commonprefix([new.block_ids[g] for _, new in requests])) for g in range(len(common))]
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
