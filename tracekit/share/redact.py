"""`redact(bundle, output)`: a bundle that still replays bit-exact but holds only what the
step's forward and sampling read.

Removed:
* token ids the step does not compute: those already in the KV cache (before
  `num_computed_tokens`) and those of the prompt after this step's chunk, replaced by the neutral
  id `NEUTRAL_TOKEN_ID` so every length stays (the runner decides prefill vs decode, and whether a
  request samples, from the prompt and output lengths). Kept in full for requests whose sampling
  reads earlier tokens (penalties, bad words, a thinking budget) or the engine's drafter does (an
  n-gram drafter proposes from them), listed in the record; the token after the chunk is kept
  for requests that ask for prompt logprobs, and with a model drafter (EAGLE, MTP) also a prefill
  chunk's request's newest token (its drafter reads one of the two);
* request ids, replaced in batch order by `req-0`, `req-1`, ... everywhere they occur; other
  requests the scheduler output names (finished, preempted) become `other-0`, ...;
* sampling fields no runner reads: `stop` strings, `bad_words` text (their token ids stay),
  `extra_args`;
* environment variables that do not shape the numbers (`tracekit.environment`), and fields of
  the step this tracekit does not know (they might hold anything).

Kept: the scheduled tokens, KV blocks, block tables, sampling parameters sampling reads, the
generator and RNG states, the recorded outputs (needed to check the replay), the engine
configuration and the error of a failing step. What a KV cache still reveals is in the README.
"""

import dataclasses
from pathlib import Path
from typing import Any

from tracekit import __version__
from tracekit.environment import numerics_relevant_env
from tracekit.errors import UsageError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, RequestState, Step
from tracekit.integrations.vllm.spec_decode import drafter_reads
from tracekit.integrations.vllm.step_records import (
    history_readers,
    ids_outside_the_batch,
    reads_next_prompt_token,
    rebuild_scheduler_output,
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


def _history_readers(request: RequestState, drafter: str | None, method: str | None) -> list[str]:
    """What reads the request's token ids before those the step computes: sampling settings, the drafter."""
    return [*history_readers(request.sampling_params), *([f"{method} drafter"] if drafter == "history" else [])]


def _kept_positions(request: RequestState, drafter: str | None) -> set[int] | None:
    """Positions of `prompt + output` the step reads (`drafter`: what the engine's drafter reads,
    `spec_decode.drafter_reads`); None: all of them."""
    if history_readers(request.sampling_params) or drafter == "history":
        return None
    start = request.num_computed_tokens
    end = start + request.num_scheduled_tokens
    kept = set(range(start, end))
    if reads_next_prompt_token(request.sampling_params) or drafter == "next":
        kept.add(end)
    if drafter == "next":  # a padded drafter batch's backup token for a prefill chunk
        kept.add(len(request.prompt_token_ids) + len(request.output_token_ids) - 1)
    return kept


def _redact_request(request: RequestState, new_id: str, record: RedactionRecord, drafter: str | None,
                    method: str | None) -> RequestState:
    readers = _history_readers(request, drafter, method)
    if readers:
        record.history_kept[new_id] = readers
    tokens = request.prompt_token_ids + request.output_token_ids
    kept = _kept_positions(request, drafter)
    if kept is not None:
        record.token_ids_blanked[new_id] = sum(1 for position in range(len(tokens)) if position not in kept)
        tokens = [token if position in kept else NEUTRAL_TOKEN_ID for position, token in enumerate(tokens)]
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


def redact_step(step: Step) -> tuple[Step, RedactionRecord]:
    record = RedactionRecord()
    names = {req_id: f"req-{position}" for position, req_id in enumerate(step.batch_order)}
    others = sorted(ids_outside_the_batch(step.scheduler_output) - set(names))
    other_names = {req_id: f"other-{position}" for position, req_id in enumerate(others)}
    record.request_ids_renamed, record.other_ids_renamed = len(names), len(other_names)
    drafter, method = drafter_reads(step.spec_decode), step.spec_decode.method if step.spec_decode else None
    pairs = [(request, _redact_request(request, names[request.req_id], record, drafter, method))
             for request in step.requests]
    ordered_pairs = sorted(pairs, key=lambda pair: step.batch_order.index(pair[0].req_id))
    mapping = {**names, **other_names}
    scheduler_output = _renamed_strings(rebuild_scheduler_output(step.scheduler_output, ordered_pairs, other_names),
                                        mapping)

    def renamed_in_text(text: str) -> str:  # the trigger (`req_id==ID`), an error's message
        for old, new in sorted(mapping.items(), key=lambda item: -len(item[0])):
            text = text.replace(old, new)
        return text

    error = step.error and {key: renamed_in_text(value) if isinstance(value, str) else value
                            for key, value in step.error.items()}
    record.unknown_fields_removed.extend(f"steps[].{name}" for name in sorted(step.extras))
    grammar = step.grammar and dataclasses.replace(
        step.grammar, request_ids=[mapping.get(req_id, req_id) for req_id in step.grammar.request_ids], extras={})
    redacted = dataclasses.replace(
        step,
        trigger=renamed_in_text(step.trigger),
        scheduler_output=scheduler_output,
        batch_order=[names[req_id] for req_id in step.batch_order],
        requests=[new for _, new in pairs],
        error=error,
        grammar=grammar,
        features=_renamed_strings(step.features, mapping),
        extras={},
    )
    return redacted, record


def redact_content(content: BundleContent) -> BundleContent:
    """The content with every step redacted, environment trimmed, and a `redact` derivation."""
    steps, records = [], []
    for step in content.steps:
        redacted, record = redact_step(step)
        steps.append(redacted)
        records.append(dataclasses.asdict(record))
    environment = content.environment
    removed_env = sorted(name for name in environment.env_vars if not numerics_relevant_env(name))
    environment = dataclasses.replace(
        environment,
        env_vars={name: value for name, value in environment.env_vars.items() if numerics_relevant_env(name)},
        extras={},
    )
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
        "env_vars_removed": removed_env,
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
    if any(step.window is not None for step in content.steps):
        # Its later steps' scheduler outputs carry new requests' prompts and resumed requests' tokens.
        raise UsageError(f"{bundle} holds a window of steps, which redact does not rewrite yet: redact single-step "
                         "bundles (record the steps one by one, --steps A:B)")
    redacted = redact_content(content)
    write_content(output, redacted)
    return redacted.derivations[-1]
