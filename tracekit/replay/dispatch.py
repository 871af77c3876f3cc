"""What the engine chose for a step when it was recorded and when it was replayed, side by side.

A graph bug often lives in the choice, not the kernels: the dispatcher picks another graph mode
or padded size at replay than at capture, or pads the request count differently. The recorder
stores the engine's capture tables and the step's dispatch (`GraphDispatch`); the replay reads
its own engine's dispatch of the same step, and every difference is named.
"""

from typing import Any

from tracekit.format.schema import GraphDispatch

# GraphDispatch fields that describe the step's dispatch (the rest describe the engine).
STEP_FIELDS = ("runtime_mode", "num_tokens", "num_tokens_padded", "batch_descriptor")
ENGINE_FIELDS = ("compilation_mode", "cudagraph_mode", "capture_sizes", "max_capture_size")


def _view(dispatch: GraphDispatch) -> dict[str, Any]:
    view = {name: getattr(dispatch, name) for name in (*STEP_FIELDS, *ENGINE_FIELDS)}
    descriptor = view["batch_descriptor"]
    if isinstance(descriptor, dict):  # the $type tag says nothing the field names do not
        view["batch_descriptor"] = {k: v for k, v in descriptor.items() if not k.startswith("$")}
    return view


def audit(recorded: GraphDispatch, replayed: GraphDispatch | None) -> dict[str, Any]:
    """{"recorded", "replayed", "differences"}: each difference one line, the step's first."""
    if replayed is None:
        return {"recorded": _view(recorded), "replayed": None,
                "differences": ["the replay did not reach the model call, so its dispatch is unknown"]}
    before, after = _view(recorded), _view(replayed)
    differences = [
        f"{name}: recorded {before[name]!r}, here {after[name]!r}"
        for name in (*STEP_FIELDS, *ENGINE_FIELDS) if before[name] != after[name]
    ]
    return {"recorded": before, "replayed": after, "differences": differences}


def same_graph(audited: dict[str, Any]) -> bool:
    """Whether the replay ran the step as the engine did: same graph mode at the same padded size."""
    differences = audited.get("differences", [])
    return not any(line.split(":")[0] in ("runtime_mode", "num_tokens_padded") for line in differences) and \
        audited.get("replayed") is not None
