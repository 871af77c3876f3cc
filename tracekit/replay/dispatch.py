"""What the engine chose for a step when it was recorded and when it was replayed, side by side
(docs/GUIDE.md, "Dispatch and modes"): a graph bug often lives in the choice, not the kernels.
"""

from typing import Any

from tracekit.format.schema import GraphDispatch

# GraphDispatch fields that describe the step's dispatch (the rest describe the engine).
STEP_FIELDS = ("runtime_mode", "num_tokens", "num_tokens_padded", "batch_descriptor")
ENGINE_FIELDS = ("compilation_mode", "cudagraph_mode", "capture_sizes", "max_capture_size")


def _view(dispatch: GraphDispatch) -> dict[str, Any]:
    view = {name: getattr(dispatch, name) for name in (*STEP_FIELDS, *ENGINE_FIELDS, "attention")}
    descriptor = view["batch_descriptor"]
    if isinstance(descriptor, dict):  # the $type tag says nothing the field names do not
        view["batch_descriptor"] = {k: v for k, v in descriptor.items() if not k.startswith("$")}
    return view


def audit(recorded: GraphDispatch, replayed: GraphDispatch | None) -> dict[str, Any]:
    """{"recorded", "replayed", "differences", "attention_differences"}: each difference one
    line, the step's first. The attention metadata's differences are leads, not faults: some
    backends keep addresses or scratch in it (vLLM's CPU backend does), so they are listed
    apart and printed when the replay is not bit-exact."""
    if replayed is None:
        return {"recorded": _view(recorded), "replayed": None, "attention_differences": [],
                "differences": ["the replay did not reach the model call, so its dispatch is unknown"]}
    before, after = _view(recorded), _view(replayed)
    differences = [
        f"{name}: recorded {before[name]!r}, here {after[name]!r}"
        for name in (*STEP_FIELDS, *ENGINE_FIELDS) if before[name] != after[name]
    ]
    return {"recorded": before, "replayed": after, "differences": differences,
            "attention_differences": _attention_differences(before["attention"], after["attention"])}


def _attention_differences(recorded: dict[str, Any] | None, here: dict[str, Any] | None) -> list[str]:
    """Field by field, where both sides have them (a bundle from before tracekit recorded the
    attention metadata has none: nothing to compare)."""
    if not recorded or not here:
        return []
    lines = []
    for key in sorted(set(recorded) | set(here)):
        before, after = recorded.get(key, {}), here.get(key, {})
        if not before or not after:
            lines.append(f"attention {key}: recorded {'yes' if before else 'no'}, here {'yes' if after else 'no'}")
            continue
        lines.extend(
            f"attention {key}.{field}: recorded {before.get(field)!r}, here {after.get(field)!r}"
            for field in sorted(set(before) | set(after)) if _differs(before.get(field), after.get(field))
        )
    return lines


def _differs(recorded: Any, here: Any) -> bool:
    """Whether a metadata field differs. A tensor is summarised as "dtype[shape]:digest", the
    digest perhaps of a kind ("live:...", its live entries alone); digests of two kinds (a bundle
    from a tracekit that digested the whole tensor) are not comparable, only the dtype and shape."""
    if isinstance(recorded, str) and isinstance(here, str) and recorded != here:
        recorded_shape, _, recorded_digest = recorded.partition(":")
        here_shape, _, here_digest = here.partition(":")
        if recorded_digest and here_digest and recorded_digest.rpartition(":")[0] != here_digest.rpartition(":")[0]:
            return recorded_shape != here_shape
    return recorded != here


def same_graph(audited: dict[str, Any]) -> bool:
    """Whether the replay ran the step as the engine did: same graph mode at the same padded size."""
    differences = audited.get("differences", [])
    return not any(line.split(":")[0] in ("runtime_mode", "num_tokens_padded") for line in differences) and \
        audited.get("replayed") is not None
