"""What a step's requests used beyond token ids and sampling settings, and which of it this
tracekit can replay: one table.

vLLM steps carry more than tokens: a structured-output grammar, a LoRA adapter, drafts to verify,
images and audio (multimodal inputs), prompt embeddings, pooling. The recorder names, per step,
which requests used which (`Step.features`, read off the runner's own request state, so a decode
of a multimodal request counts too, not only the step that brought it). A replay that cannot put
one of them back would run another step than the one recorded; it refuses such a bundle before
building anything (`NotReplayableYet`, exit 5: no machine can replay it with this tracekit), and
the recorder says at arming which of them its engine may produce ("can be recorded but not yet
replayed"). Bundles recorded before the field existed are judged from what they do hold.

Supporting one more kind: a row in `FEATURES`, how to see it in a request (`_USES`) and in an
engine's config (`_ENABLED_BY`), and `replayable=True` once the replay puts it back.
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


def _structured(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "structured_outputs", None) is not None


# How a request (V1's CachedRequestState, or the NewRequestData that brought it) shows each kind.
_USES: dict[str, Callable[[Any], bool]] = {
    "structured_outputs": _structured,
    "lora": lambda request: getattr(request, "lora_request", None) is not None,
    "multimodal": lambda request: bool(getattr(request, "mm_features", None)),
    "prompt_embeds": lambda request: getattr(request, "prompt_embeds", None) is not None,
    "pooling": lambda request: getattr(request, "pooling_params", None) is not None,
}

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
    order) used which kind; drafts from the scheduler output."""
    used: dict[str, list[str]] = {}
    for req_id, request in requests:
        if request is None:
            continue
        for name, uses in _USES.items():
            if uses(request):
                used.setdefault(name, []).append(req_id)
    drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    drafted = [req_id for req_id, _ in requests if drafts.get(req_id)]
    if drafted:
        used["speculative_decoding"] = drafted
    return used


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
    used: dict[str, list[str]] = {}
    for entry in step.scheduler_output.scheduled_new_reqs:
        for name, value in (("multimodal", entry.mm_features), ("prompt_embeds", entry.prompt_embeds),
                            ("lora", entry.lora_request), ("pooling", entry.pooling_params)):
            if _present(value):
                used.setdefault(name, []).append(entry.req_id)
    drafted = [req_id for req_id, tokens in step.scheduler_output.scheduled_spec_decode_tokens.items() if tokens]
    if drafted:
        used["speculative_decoding"] = drafted
    structured = [request.req_id for request in step.requests
                  if request.sampling_params is not None and _present(request.sampling_params.structured_outputs)]
    if structured:
        used["structured_outputs"] = structured
    return used


def _present(value: Any) -> bool:
    """A recorded field that holds something (a tensor, as loaded, is never compared)."""
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
