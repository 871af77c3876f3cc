"""Comparing a replayed step with what the engine recorded, item by item, in forward order.

Items come in the order the forward produces them (batch order, inputs, KV written, hidden
states, logits, sampled ids), so the first one that differs is where to start looking: if the
KV written already differs, the hidden states will too.
"""

from dataclasses import dataclass
from typing import Any

from tracekit.format.schema import Step
from tracekit.integrations.vllm.step_driver import ObservedStep
from tracekit.numerics import compare_tensors


@dataclass
class CheckedItem:
    name: str
    bit_exact: bool
    within_tolerance: bool
    details: dict[str, Any]

    def to_plain(self) -> dict[str, Any]:
        return {"item": self.name, "bit_exact": self.bit_exact, "within_tolerance": self.within_tolerance, **self.details}


def _tensor_item(name: str, actual: Any, expected: Any, tolerance: float) -> CheckedItem | None:
    if expected is None:
        return None
    if actual is None:
        return CheckedItem(name, False, False, {"problem": "not produced by the replay"})
    details = compare_tensors(actual, expected)
    bit_exact = details.pop("bit_exact")
    floating = expected.is_floating_point()
    within = bit_exact or (
        floating and "shape_mismatch" not in details and details["relative_rms"] <= tolerance
    )
    return CheckedItem(name, bit_exact, within, details)


def _exact_item(name: str, actual: Any, expected: Any) -> CheckedItem | None:
    if expected is None:
        return None
    same = actual == expected
    details: dict[str, Any] = {}
    if not same and isinstance(expected, list):
        pairs = list(zip(actual or [], expected))
        details["agreement"] = sum(a == e for a, e in pairs) / max(len(expected), 1)
        details["first_difference"] = next(
            (i for i, (a, e) in enumerate(pairs) if a != e), min(len(actual or []), len(expected))
        )
    return CheckedItem(name, same, same, details)


def check_step(observed: ObservedStep, step: Step, tolerance: float = 0.0) -> list[CheckedItem]:
    """Every comparable item, in forward order; tolerance is a relative RMS for float tensors."""
    items = [
        _exact_item("batch_order", observed.batch_order, step.batch_order),
        _tensor_item("input_ids", observed.input_ids, step.input_ids, 0.0),
        _tensor_item("positions", observed.positions, step.positions, 0.0),
    ]
    for group_index, group in enumerate(step.kv.groups):
        live = observed.kv_after[group_index] if group_index < len(observed.kv_after) else {}
        for layer, expected in group.after.items():
            items.append(_tensor_item(f"kv_written/{layer}", live.get(layer), expected, tolerance))
    outputs = step.outputs
    if outputs is not None:
        items.append(_tensor_item("hidden_states", observed.hidden_states, outputs.hidden_states, tolerance))
        items.append(_tensor_item("logits", observed.logits, outputs.logits, tolerance))
        items.append(_exact_item("sampled_token_ids", observed.sampled_token_ids, outputs.sampled_token_ids))
    return [item for item in items if item is not None]


def first_divergence(items: list[CheckedItem]) -> CheckedItem | None:
    return next((item for item in items if not item.within_tolerance), None)

