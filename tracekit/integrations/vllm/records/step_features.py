"""What a step's requests used beyond token ids and sampling settings, and which of it this
tracekit can replay: one table.

A replay that cannot put one of them back would run another step than the one recorded, so it
refuses such a bundle before building anything (`NotReplayableYet`, exit 5; docs/GUIDE.md, "Said
at arm time, named right", says what is recorded and said when). Bundles recorded before
`Step.features` existed are judged from what they do hold.

Supporting one more kind: a row in `FEATURES`, how to see it in a request (`_REQUEST_FIELDS`)
and in an engine's config (`_ENABLED_BY`), and `replayable=True` once the replay puts it back.
"""

from dataclasses import dataclass
from typing import Any, Callable

from tracekit import __version__
from tracekit.format.schema import Step


@dataclass(frozen=True)
class StepFeature:
    name: str  # as recorded in `Step.features`
    words: str  # in messages: "steps with {words}"
    replayable: bool


FEATURES = {
    feature.name: feature
    for feature in (
        StepFeature("structured_outputs", "structured outputs (a grammar mask)", True),
        StepFeature("lora", "LoRA adapters", True),
        StepFeature("speculative_decoding", "speculative decoding (drafts to verify)", True),
        StepFeature("multimodal", "multimodal inputs", False),
        StepFeature("prompt_embeds", "prompt embeddings", False),
        StepFeature("pooling", "pooling requests", False),
    )
}


# The field in which a request (V1's CachedRequestState, the NewRequestData that brought it, or
# its record) shows each kind; a grammar shows in its sampling settings.
_REQUEST_FIELDS = {"lora": "lora_request", "multimodal": "mm_features", "prompt_embeds": "prompt_embeds",
                   "pooling": "pooling_params"}


def _uses(request: Any) -> list[str]:
    """The kinds `request` (None: a request the runner holds no object for) shows."""
    used = [name for name, field in _REQUEST_FIELDS.items() if _present(getattr(request, field, None))]
    if _present(getattr(getattr(request, "sampling_params", None), "structured_outputs", None)):
        used.append("structured_outputs")
    return used


# How an engine's config says its steps may have each kind (structured outputs: any engine).
_ENABLED_BY: dict[str, Callable[[Any], bool]] = {
    "lora": lambda config: getattr(config, "lora_config", None) is not None,
    "speculative_decoding": lambda config: getattr(config, "speculative_config", None) is not None,
    "multimodal": lambda config: bool(getattr(config.model_config, "is_multimodal_model", False)),
    "prompt_embeds": lambda config: bool(getattr(config.model_config, "enable_prompt_embeds", False)),
    "pooling": lambda config: getattr(config.model_config, "runner_type", None) == "pooling",
}


def step_features(requests: list[tuple[str, Any]], scheduler_output: Any) -> dict[str, list[str]]:
    """Which of the step's requests (`(req_id, the runner's request object or None)`, batch
    order; an id may come with several objects) used which kind; drafts from the scheduler output."""
    used: dict[str, dict[str, None]] = {}
    for req_id, request in requests:
        for name in _uses(request):
            used.setdefault(name, {})[req_id] = None
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    drafted = {req_id: None for req_id, _ in requests if drafts.get(req_id)}
    if drafted:
        used["speculative_decoding"] = drafted
    return {name: list(req_ids) for name, req_ids in used.items()}


def not_replayable_in(vllm_config: Any) -> list[str]:
    """The kinds an engine of this config may put in its steps that this tracekit cannot replay."""
    return [FEATURES[name].words for name, enabled in _ENABLED_BY.items()
            if not FEATURES[name].replayable and enabled(vllm_config)]


def not_replayable_reason(step: Step) -> str | None:
    """Why this tracekit cannot replay `step` in kind (None: it can)."""
    used = step.features if step.features is not None else _inferred(step)
    blocked = []
    for name, req_ids in sorted(used.items()):
        feature = FEATURES.get(name)
        if feature is None:
            blocked.append(f"{name!r} (a kind this tracekit does not know; requests {', '.join(req_ids[:4])})")
        elif not feature.replayable:
            blocked.append(f"{feature.words} (requests {', '.join(req_ids[:4])}{', ...' if len(req_ids) > 4 else ''})")
    if blocked:
        return f"steps with {'; '.join(blocked)} can be recorded but not yet replayed (tracekit {__version__})"
    missing = _records_missing(step, used)
    if missing:
        return (f"the bundle lacks {missing}, which its replay needs (recorded by a tracekit that did not keep "
                f"it): record the step again with tracekit {__version__}")
    return None


def _inferred(step: Step) -> dict[str, list[str]]:
    """What a bundle from before `Step.features` shows of the kinds: the requests the step's
    scheduler output brought (later steps of theirs show nothing), drafts, and grammar requests
    by their sampling settings."""
    brought = [(entry.req_id, entry) for entry in step.scheduler_output.scheduled_new_reqs]
    return step_features([*brought, *((request.req_id, request) for request in step.requests)], step.scheduler_output)


def _present(value: Any) -> bool:
    """A field that holds something (a tensor is never compared)."""
    return value is not None and not (isinstance(value, (list, dict, str)) and not value)


def _records_missing(step: Step, used: dict[str, list[str]]) -> str | None:
    """What the replay of a kind it can replay needs but the bundle lacks, in words."""
    sampling = [request.req_id for request in step.requests if request.samples]
    if step.features is None and step.grammar is None and set(used.get("structured_outputs", ())) & set(sampling):
        return "the grammar mask its structured-output requests sampled under"
    adapters = {adapter.name for adapter in step.lora_adapters}
    unnamed = [request.req_id for request in step.requests
               if request.req_id in used.get("lora", ()) and request.lora_adapter not in adapters]
    if unnamed:
        return f"the LoRA adapter of request(s) {', '.join(unnamed[:4])}"
    return None
