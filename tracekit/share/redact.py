"""`redact(bundle, output)`: a bundle that still replays bit-exact but holds only what its steps'
forwards and sampling read, so that it can be shared (what is removed, what is kept and what a KV
cache still reveals: docs/GUIDE.md#redact). A bundle's steps are redacted as one (`plan_for`).
"""

import dataclasses
from pathlib import Path
from typing import Any

from tracekit import __version__
from tracekit.environment import numerics_relevant_env
from tracekit.errors import BundleError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, CarriedStep, RequestState, SchedulerOutputRecord, Step
from tracekit.integrations.vllm.records.spec_decode import drafter_reads
from tracekit.integrations.vllm.records.step_records import (
    history_readers,
    reads_next_prompt_token,
    rebuild_scheduler_output,
    redact_later_scheduler_output,
    redact_sampling_params,
)
from tracekit.outputs import require_parent

NEUTRAL_TOKEN_ID = 0


@dataclasses.dataclass
class RedactionRecord:
    """What was removed from one step, to be listed by `tracekit inspect`."""

    token_ids_blanked: dict[str, int] = dataclasses.field(default_factory=dict)
    history_kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    sampling_fields_removed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    request_ids_renamed: int = 0
    other_ids_renamed: int = 0
    unknown_fields_removed: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RedactionPlan:
    """What a redaction renames and keeps, decided over every step it covers: a single step, or
    each step of a window (a request keeps the token ids any of its steps reads)."""

    names: dict[str, str]  # the requests: req_id -> req-N, in order of first appearance
    other_names: dict[str, str]  # other ids the scheduler outputs name (finished, preempted): other-N
    kept: dict[str, set[int] | None]  # req_id -> positions of prompt + output kept (None: all)
    readers: dict[str, list[str]]  # req_id -> what reads its earlier token ids

    @property
    def mapping(self) -> dict[str, str]:
        return {**self.names, **self.other_names}

    def renamed_in_text(self, text: str) -> str:
        """A trigger (`req_id==ID`) or an error's message with the ids renamed."""
        for old, new in sorted(self.mapping.items(), key=lambda item: -len(item[0])):
            text = text.replace(old, new)
        return text


def _kept_positions(request: RequestState, drafter: str | None) -> set[int]:
    """Positions of `prompt + output` the step reads, where nothing reads the request's history
    (`drafter`: what the engine's drafter reads, `spec_decode.drafter_reads`)."""
    length = len(request.prompt_token_ids) + len(request.output_token_ids)
    start = request.num_computed_tokens
    end = start + request.num_scheduled_tokens
    kept = set(range(min(start, length), min(end, length)))  # a hostile count names no more positions
    if reads_next_prompt_token(request.sampling_params) or drafter == "next":
        kept.add(end)
    if drafter == "next":  # a padded drafter batch's backup token for a prefill chunk
        kept.add(length - 1)
    return kept


def plan_for(steps: list[Step], held: list[RequestState] = ()) -> RedactionPlan:
    """The plan for `steps` (one, or a window's in order, each with its requests' states) and the
    requests a window's runner held outside its first batch (`held`)."""
    names: dict[str, str] = {}
    kept: dict[str, set[int] | None] = {}
    readers: dict[str, list[str]] = {}
    for req_id in [*steps[0].batch_order, *(request.req_id for request in held),
                   *(req_id for step in steps[1:] for req_id in step.batch_order)]:
        names.setdefault(req_id, f"req-{len(names)}")
    for step in steps:
        drafter = drafter_reads(step.spec_decode)
        by_drafter = [f"{step.spec_decode.method} drafter"] if drafter == "history" else []
        for request in step.requests:
            # what reads its token ids before those the step computes: its sampling settings, the drafter
            reading = [*history_readers(request.sampling_params), *by_drafter]
            before = kept.get(request.req_id, set())
            kept[request.req_id] = None if reading or before is None else before | _kept_positions(request, drafter)
            for reader in reading:
                if reader not in readers.setdefault(request.req_id, []):
                    readers[request.req_id].append(reader)
    others = sorted(set().union(*(step.scheduler_output.outside_the_batch for step in steps)) - set(names))
    return RedactionPlan(names, {req_id: f"other-{number}" for number, req_id in enumerate(others)}, kept, readers)


def _blanked(req_id: Any, tokens: list[int], plan: RedactionPlan, record: RedactionRecord) -> list[int]:
    """Request `req_id`'s token ids (`tokens`: from position 0) with the positions the plan does
    not keep set to the neutral id, counted in the record."""
    kept = plan.kept.get(req_id, set())
    if kept is None:
        return list(tokens)
    name = plan.names.get(req_id, req_id)
    record.token_ids_blanked[name] = record.token_ids_blanked.get(name, 0) + sum(
        1 for position in range(len(tokens)) if position not in kept)
    return [token if position in kept else NEUTRAL_TOKEN_ID for position, token in enumerate(tokens)]


def _redact_request(request: RequestState, plan: RedactionPlan, record: RedactionRecord) -> RequestState:
    new_id = plan.names[request.req_id]
    if plan.readers.get(request.req_id):
        record.history_kept[new_id] = plan.readers[request.req_id]
    tokens = _blanked(request.req_id, request.prompt_token_ids + request.output_token_ids, plan, record)
    sampling_params, removed = redact_sampling_params(request.sampling_params)
    if removed:
        record.sampling_fields_removed[new_id] = removed
    if request.extras:
        record.unknown_fields_removed.extend(f"requests[].{name}" for name in sorted(request.extras))
    prompt_length = len(request.prompt_token_ids)
    return dataclasses.replace(
        request,
        req_id=new_id,
        prompt_token_ids=tokens[:prompt_length],
        output_token_ids=tokens[prompt_length:],
        sampling_params=sampling_params,
        extras={},
    )


def _renamed_strings(value: Any, mapping: dict[str, str]) -> Any:
    """Every string (and map key) equal to a mapped id replaced; tensors and the rest untouched."""
    if isinstance(value, str):
        return mapping.get(value, value)
    if isinstance(value, dict):
        return {mapping.get(key, key) if isinstance(key, str) else key: _renamed_strings(item, mapping)
                for key, item in value.items()}
    if isinstance(value, list):
        return [_renamed_strings(item, mapping) for item in value]
    return value


def _renamed(step: Step | CarriedStep, where: str, scheduler_output: SchedulerOutputRecord, plan: RedactionPlan,
             record: RedactionRecord, **more: Any) -> Any:
    """A step (the first or a later one, `where` in the bundle) with `scheduler_output`, every
    request id renamed by the plan (in the scheduler output wherever it is, vLLM's fields tracekit
    does not read too), and the fields this tracekit does not know dropped."""
    record.unknown_fields_removed.extend(f"{where}.{name}" for name in sorted(step.extras))
    error = step.error and {key: plan.renamed_in_text(value) if isinstance(value, str) else value
                            for key, value in step.error.items()}
    grammar = step.grammar and dataclasses.replace(
        step.grammar, request_ids=[plan.mapping.get(req_id, req_id) for req_id in step.grammar.request_ids], extras={})
    renamed_output = SchedulerOutputRecord.from_plain(_renamed_strings(scheduler_output.to_plain(), plan.mapping))
    return dataclasses.replace(step, scheduler_output=renamed_output,
                               batch_order=[plan.mapping.get(req_id, req_id) for req_id in step.batch_order],
                               error=error, grammar=grammar, extras={}, **more)


def redact_steps(first: Step, content: BundleContent) -> tuple[Step, RedactionRecord]:
    """A bundle's steps redacted as one (`first` and those after it; what of each:
    docs/GUIDE.md#redact, "A window")."""
    from tracekit.integrations.vllm.replay_engine import expand_window

    # one request state per request of the batch, and none besides (a replay refuses a bundle without them too)
    if sorted(first.batch_order) != sorted(request.req_id for request in first.requests):
        raise BundleError(f"bundle content: step {first.index}'s request states and batch order name different "
                          "requests: redact rewrites them request by request")
    plan = plan_for([each.step for each in expand_window(first, content)], first.held_requests)
    record = RedactionRecord(request_ids_renamed=len(plan.names), other_ids_renamed=len(plan.other_names))
    pairs = [(request, _redact_request(request, plan, record)) for request in first.requests]
    ordered_pairs = sorted(pairs, key=lambda pair: first.batch_order.index(pair[0].req_id))
    redacted = _renamed(first, "steps[]", rebuild_scheduler_output(first.scheduler_output, ordered_pairs,
                                                                   plan.other_names), plan, record,
                        trigger=plan.renamed_in_text(first.trigger), requests=[new for _, new in pairs],
                        features=_renamed_strings(first.features, plan.mapping))
    held = [_redact_request(request, plan, record) for request in first.held_requests]
    later = [_renamed(carried, "window.steps[]", _blanked_scheduler_output(carried.scheduler_output, plan, record),
                      plan, record, runner_states={plan.mapping.get(req_id, req_id): state
                                                   for req_id, state in carried.runner_states.items()})
             for carried in first.later]
    record.unknown_fields_removed.extend(f"window.{name}" for name in sorted(first.window_extras))
    return redacted.with_later(later, held), record


def _blanked_scheduler_output(output: SchedulerOutputRecord, plan: RedactionPlan, record: RedactionRecord
                              ) -> SchedulerOutputRecord:
    """A later step's scheduler output with the token ids its requests' steps never read blanked
    and their sampling parameters redacted."""
    result, removed = redact_later_scheduler_output(output, lambda req_id, tokens: _blanked(req_id, tokens, plan, record))
    for req_id, fields in removed.items():
        record.sampling_fields_removed[plan.names.get(req_id, req_id)] = fields
    return result


def redact_content(content: BundleContent) -> BundleContent:
    """The content with every step redacted, environment trimmed, and a `redact` derivation."""
    steps, records = [], []
    for step in content.steps:
        redacted, record = redact_steps(step, content)
        steps.append(redacted)
        records.append(dataclasses.asdict(record))
    env_vars = content.environment.env_vars
    kept_env = {name: value for name, value in env_vars.items() if numerics_relevant_env(name)}
    environment = dataclasses.replace(content.environment, env_vars=kept_env, extras={})
    removed = [
        "token ids the step does not compute (set to the neutral id; lengths kept), except where sampling reads them",
        "request ids (renamed in batch order)",
        "sampling fields no runner reads (stop strings, bad_words text, extra_args)",
        "environment variables that do not shape the numbers",
    ]
    derivation = {
        "kind": "redact",
        "tool": f"tracekit {__version__}",
        "neutral_token_id": NEUTRAL_TOKEN_ID,
        "removed": removed,
        "env_vars_removed": sorted(set(env_vars) - set(kept_env)),
        "steps": records,
    }
    if content.extras:
        derivation["unknown_fields_removed"] = sorted(content.extras)
    return dataclasses.replace(content, environment=environment, steps=steps,
                               derivations=[*content.derivations, derivation], extras={})


def redact(bundle: str | Path, output: str | Path) -> dict[str, Any]:
    """Write the redacted bundle; returns its `redact` derivation record."""
    from tracekit.format.content import write_content

    require_parent(output)
    with open_bundle(bundle) as reader:
        content = BundleContent.from_plain(reader.resolve(reader.metadata, to="torch"))
    redacted = redact_content(content)
    write_content(output, redacted)
    return redacted.derivations[-1]
