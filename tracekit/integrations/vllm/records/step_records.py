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

from typing import Any, Callable

from tracekit.errors import BundleError
from tracekit.format.schema import RequestState, Step
from tracekit.format.typecheck import found
from tracekit.integrations.vllm.records.spec_decode import recorded_drafts

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


def history_readers(sampling_params: dict[str, Any] | None) -> list[str]:
    """The sampling settings of a request that read token ids before the ones it computes (a
    setting holding what no setting holds, a tensor, counts as set)."""
    params = sampling_params if isinstance(sampling_params, dict) else {}
    return [name for name, neutral in HISTORY_READERS.items() if name in params and _is_set(params[name], neutral)]


def _is_set(value: Any, neutral: Any) -> bool:
    """Whether a sampling setting differs from its neutral value."""
    if value is None or (isinstance(value, list) and not value):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, float):
        return value != neutral  # a penalty of 1 is 1.0
    return not isinstance(value, type(neutral)) or value != neutral


def reads_next_prompt_token(sampling_params: dict[str, Any] | None) -> bool:
    """Prompt logprobs score each computed prompt position against the token after it."""
    return (sampling_params or {}).get("prompt_logprobs") is not None


def redact_sampling_params(sampling_params: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """A copy without the user data sampling never reads, and the names of the fields blanked."""
    if sampling_params is None:
        return None, []
    redacted = dict(sampling_params)
    removed = []
    for name, blank in UNREAD_USER_FIELDS.items():
        if redacted.get(name) not in (None, [], {}):
            redacted[name] = blank
            removed.append(name)
    return redacted, removed


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


def _require_rewritable(record: dict[str, Any]) -> None:
    """The parts of a recorded `SchedulerOutput` a rebuild rewrites hold what vLLM's do, else a
    one-line BundleError: request entries with ids, lists of ids, token and block id lists."""
    where = "bundle content: the step's scheduler output record"
    new = record.get("scheduled_new_reqs")
    if new is not None and not (isinstance(new, list) and all(isinstance(entry, dict) and isinstance(
            entry.get("req_id"), str) and all(_is_token_list(entry.get(name)) for name in ("prompt_token_ids",
                                                                                        "prefill_token_ids"))
            for entry in new)):
        raise BundleError(f"{where}: scheduled_new_reqs should hold requests, each with an id and token id lists")
    cached = record.get("scheduled_cached_reqs")
    if cached is not None and not isinstance(cached, dict):
        raise BundleError(f"{where}: scheduled_cached_reqs should be a map, not {found(cached)}")
    cached = cached or {}
    ids = cached.get("req_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(req_id, str) for req_id in ids)):
        raise BundleError(f"{where}: scheduled_cached_reqs.req_ids should hold request ids")
    new_tokens = cached.get("new_token_ids")
    if isinstance(new_tokens, list) and not all(_is_token_list(tokens) for tokens in new_tokens):
        raise BundleError(f"{where}: scheduled_cached_reqs.new_token_ids should hold token id lists")
    every = cached.get("all_token_ids")
    if isinstance(every, dict) and not all(_is_token_list(tokens) for tokens in every.values()):
        raise BundleError(f"{where}: scheduled_cached_reqs.all_token_ids should hold token id lists")
    zeroed = record.get("new_block_ids_to_zero")
    if zeroed is not None and not (isinstance(zeroed, list) and all(type(block) is int for block in zeroed)):
        raise BundleError(f"{where}: new_block_ids_to_zero should hold block ids")


def _is_token_list(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(type(token) is int for token in value))


def rebuild_scheduler_output(
    record: dict[str, Any],
    requests: list[tuple[RequestState, RequestState]],
    other_ids: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The recorded `SchedulerOutput` for a changed batch.

    `requests` pairs each recorded request state kept in the batch with its new state (renamed,
    fewer tokens scheduled, token ids blanked); requests not listed are dropped. A request the
    record never had, paired with itself, is counted as scheduled (a filler of `tracekit
    invariance`). `other_ids`
    renames requests outside the batch (finished or preempted ones the record names).
    """
    _require_rewritable(record)
    other_ids = other_ids or {}
    by_old = {old.req_id: (old, new) for old, new in requests}

    def rename(req_id: str) -> str:
        return by_old[req_id][1].req_id if req_id in by_old else other_ids.get(req_id, req_id)

    def tokens(old: RequestState, new: RequestState, values: list[int] | None) -> list[int] | None:
        if values is None:
            return None
        return _same_slice(
            list(values),
            old.prompt_token_ids + old.output_token_ids,
            new.prompt_token_ids + new.output_token_ids,
        )

    result = dict(record)
    new_reqs = []
    for entry in record.get("scheduled_new_reqs") or []:
        if entry.get("req_id") not in by_old:
            continue
        old, new = by_old[entry["req_id"]]
        entry = dict(entry)
        entry["req_id"] = new.req_id
        entry["prompt_token_ids"] = tokens(old, new, entry.get("prompt_token_ids"))
        if entry.get("prefill_token_ids") is not None:
            entry["prefill_token_ids"] = tokens(old, new, entry["prefill_token_ids"])
        entry["sampling_params"] = new.sampling_params
        new_reqs.append(entry)
    result["scheduled_new_reqs"] = new_reqs

    cached = record.get("scheduled_cached_reqs")
    if isinstance(cached, dict):
        cached = dict(cached)
        old_ids = list(cached.get("req_ids") or [])
        kept = [i for i, req_id in enumerate(old_ids) if req_id in by_old]
        for name in ("new_block_ids", "num_computed_tokens", "num_output_tokens"):
            values = cached.get(name)
            if isinstance(values, list) and len(values) == len(old_ids):
                cached[name] = [values[i] for i in kept]
        new_token_ids = cached.get("new_token_ids")
        if isinstance(new_token_ids, list) and len(new_token_ids) == len(old_ids):
            cached["new_token_ids"] = [tokens(*by_old[old_ids[i]], new_token_ids[i]) for i in kept]
        cached["req_ids"] = [rename(old_ids[i]) for i in kept]
        resumed = cached.get("resumed_req_ids")
        if isinstance(resumed, dict) and "$set" in resumed:
            cached["resumed_req_ids"] = {"$set": sorted(rename(r) for r in _set_ids(resumed) if r in by_old)}
        all_token_ids = cached.get("all_token_ids")
        if isinstance(all_token_ids, dict):
            cached["all_token_ids"] = {
                rename(req_id): tokens(*by_old[req_id], values)
                for req_id, values in all_token_ids.items() if req_id in by_old
            }
        result["scheduled_cached_reqs"] = cached

    scheduled = {new.req_id: new.num_scheduled_tokens for _, new in requests}
    result["num_scheduled_tokens"] = scheduled
    result["total_num_scheduled_tokens"] = sum(scheduled.values())
    if isinstance(record.get("scheduled_encoder_inputs"), dict):
        result["scheduled_encoder_inputs"] = {rename(key): value for key, value in record["scheduled_encoder_inputs"].items()
                                              if key in by_old}
    _cut_drafts(record, result, by_old, rename)
    for name in ("finished_req_ids", "preempted_req_ids"):
        value = record.get(name)
        if isinstance(value, dict) and "$set" in value:
            result[name] = {"$set": sorted(rename(req_id) for req_id in _set_ids(value))}
    blocks = {block for _, new in requests for group in new.block_ids for block in group}
    zeroed = record.get("new_block_ids_to_zero")
    if isinstance(zeroed, list):
        result["new_block_ids_to_zero"] = [block for block in zeroed if block in blocks]
    common = record.get("num_common_prefix_blocks")
    if isinstance(common, list) and common and len(requests) != len(record.get("num_scheduled_tokens") or {}):
        # cascade attention's shared prefix: the blocks every request of the (smaller) batch shares
        result["num_common_prefix_blocks"] = [
            _common_prefix([new.block_ids[g] for _, new in requests]) for g in range(len(common))
        ]
    return result


def redact_later_scheduler_output(record: dict[str, Any], tokens: Callable[[Any, list[int]], list[int]]
                                  ) -> tuple[dict[str, Any], dict[Any, list[str]]]:
    """A window's later `SchedulerOutput` record with each request's token ids passed through
    `tokens(req_id, ids)` — new requests' prompt and prefill ids, resumed requests'
    `all_token_ids` — and the sampling fields no runner reads removed from new requests' sampling
    parameters. Returns it and, per request, the fields removed."""
    result, removed = dict(record), {}
    entries = []
    for entry in record.get("scheduled_new_reqs") or []:
        if isinstance(entry, dict):
            entry = dict(entry)
            for name in ("prompt_token_ids", "prefill_token_ids"):
                if isinstance(entry.get(name), list):
                    entry[name] = tokens(entry.get("req_id"), entry[name])
            if isinstance(entry.get("sampling_params"), dict):
                entry["sampling_params"], fields = redact_sampling_params(entry["sampling_params"])
                if fields:
                    removed[entry.get("req_id")] = fields
        entries.append(entry)
    if "scheduled_new_reqs" in record:
        result["scheduled_new_reqs"] = entries
    cached = record.get("scheduled_cached_reqs")
    if isinstance(cached, dict) and isinstance(cached.get("all_token_ids"), dict):
        result["scheduled_cached_reqs"] = {**cached, "all_token_ids": {
            req_id: tokens(req_id, ids) if isinstance(ids, list) else ids
            for req_id, ids in cached["all_token_ids"].items()}}
    return result, removed


def _cut_drafts(record: dict[str, Any], result: dict[str, Any],
                by_old: dict[str, tuple[RequestState, RequestState]], rename: Callable[[str], str]) -> None:
    """The drafts each kept request schedules (its last scheduled tokens): as many fewer as it
    schedules fewer tokens; a request left with none is not listed (as vLLM's scheduler does)."""
    drafts = record.get("scheduled_spec_decode_tokens")
    if isinstance(drafts, dict):
        kept = {}
        for req_id, tokens in drafts.items():
            if req_id not in by_old or not isinstance(tokens, list):
                continue
            old, new = by_old[req_id]
            count = max(len(tokens) - max(old.num_scheduled_tokens - new.num_scheduled_tokens, 0), 0)
            if count:
                kept[rename(req_id)] = tokens[:count]
        result["scheduled_spec_decode_tokens"] = kept
    invalid = record.get("num_invalid_spec_tokens")
    if isinstance(invalid, dict):
        counts = {key: len(tokens) for key, tokens in result.get("scheduled_spec_decode_tokens", {}).items()}
        result["num_invalid_spec_tokens"] = {
            rename(req_id): min(value, counts.get(rename(req_id), 0)) if isinstance(value, int) else value
            for req_id, value in invalid.items() if req_id in by_old}


def _set_ids(tagged: dict[str, Any]) -> list[str]:
    """The request ids of a recorded set (`{"$set": [...]}`); what is no id is not one."""
    items = tagged.get("$set")
    return [item for item in items if isinstance(item, str)] if isinstance(items, list) else []


def _common_prefix(block_lists: list[list[int]]) -> int:
    length = 0
    for column in zip(*block_lists):
        if len(set(column)) != 1:
            break
        length += 1
    return length


def prefix_cache_hits(record: dict[str, Any]) -> dict[str, int]:
    """Requests the scheduler sent for the first time with part of their prompt already computed
    (found in the prefix cache): req_id -> cached tokens."""
    hits = {}
    for entry in record.get("scheduled_new_reqs") or []:
        computed = entry.get("num_computed_tokens") if isinstance(entry, dict) else None
        if isinstance(computed, int) and computed > 0 and isinstance(entry.get("req_id"), str):
            hits[entry["req_id"]] = computed
    return hits


def ids_outside_the_batch(record: dict[str, Any]) -> set[str]:
    """Request ids of requests outside the batch that a recorded scheduler output names."""
    found = set()
    for name in ("finished_req_ids", "preempted_req_ids"):
        value = record.get(name)
        if isinstance(value, dict):
            found.update(_set_ids(value))
    return found


def logits_rows(step: Step) -> list[tuple[str, int]]:
    """Who each row of the step's sampling logits belongs to, in order: (request, position), a
    request's rows being its sampled token (position 0) and then each draft it verifies (1, 2,
    ...), in batch order — the rows vLLM's runners compute logits for."""
    drafts = recorded_drafts(step.scheduler_output)
    rows = []
    for req_id in step.batch_order:
        count = len(drafts.get(req_id, ()))
        rows.extend((req_id, position) for position in range(1 + count))
    return rows
