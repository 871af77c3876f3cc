"""What a replay's outcome means, in one word: the report's last line, the JSON's `verdict`, the
exit code.

A replay on the recording platform is bit-exact or it is a bug. On another platform (other CPU
ISA, GPU model, torch/vLLM build, attention backend, thread count, numerics env vars) other
kernels round differently, so "not bit-exact" alone says nothing: there the verdict is
`platform_difference` when every discrete item (batch order, input ids, positions, sampled ids)
is equal and every float item stays within the calibrated per-dtype bound
(`tracekit.numerics.PLATFORM_BOUNDS`), and `diverged` otherwise.
"""

from dataclasses import dataclass, field
from typing import Any

from tracekit.errors import EXIT_NOT_REPRODUCED, EXIT_OK
from tracekit.numerics import within_platform_bound
from tracekit.replay.checks import CheckedItem
from tracekit.replay.verdict_names import NOT_REPLAYED, VerdictName

__all__ = ["NOT_REPLAYED", "Verdict", "VerdictName", "decide", "describe_differing_row", "near_tie_summary"]


@dataclass
class Verdict:
    name: VerdictName
    reason: str  # one line: why this verdict
    # Items beyond the platform bound (or unequal discrete items) when the platform differs.
    beyond_bound: list[str] = field(default_factory=list)

    def exit_code(self, strict: bool = False) -> int:
        if strict and self.name.exit_code == EXIT_OK and self.name != VerdictName.BIT_EXACT:
            return EXIT_NOT_REPRODUCED
        return self.name.exit_code

    def to_plain(self) -> dict[str, Any]:
        return {"verdict": self.name.value, "verdict_reason": self.reason, "beyond_platform_bound": self.beyond_bound}


def decide(
    items: list[CheckedItem],
    numeric_differences: list[str],
    tolerance: float = 0.0,
    error_step: bool = False,
    kv_recomputed: bool = False,
) -> Verdict:
    """`items`: every check (step items and per-layer items; those that do not decide, the
    padding rows, are left out); `numeric_differences`: the environment fields that differ and
    affect numerics; `error_step`: the recorded forward raised; `kv_recomputed`: the KV the step
    read was rebuilt by prefilling its tokens, not restored (the reason says so)."""
    verdict = _decide(items, numeric_differences, tolerance, error_step)
    if kv_recomputed:
        verdict.reason += "; KV recomputed, not restored"
    return verdict


def _decide(items: list[CheckedItem], numeric_differences: list[str], tolerance: float, error_step: bool) -> Verdict:
    items = [item for item in items if item.decides]
    if error_step:
        if all(item.bit_exact for item in items):
            return Verdict(VerdictName.ERROR_REPRODUCED, "the forward raised the recorded error again")
        return Verdict(VerdictName.ERROR_NOT_REPRODUCED, "the forward did not raise the recorded error")
    if all(item.bit_exact for item in items):
        return Verdict(VerdictName.BIT_EXACT, "every item is bit-identical to the recording")
    if tolerance > 0 and all(item.within_tolerance for item in items):
        return Verdict(VerdictName.WITHIN_TOLERANCE, f"every item within relative RMS {tolerance:g}")
    first = next(item for item in items if not item.within_tolerance)
    if not numeric_differences:
        return Verdict(VerdictName.DIVERGED, f"first divergence at {first.name} on the recording's own platform")
    beyond = [item.name for item in items if not _platform_explains(item)]
    if not beyond:
        return Verdict(
            VerdictName.PLATFORM_DIFFERENCE,
            f"not bit-exact, but this platform differs ({', '.join(numeric_differences)}); discrete items "
            "equal, float items within the calibrated per-dtype bounds",
        )
    reason = f"{beyond[0]} is beyond what the platform difference ({', '.join(numeric_differences)}) explains"
    sampled = next((item for item in items if item.name == "sampled_token_ids" and not item.bit_exact), None)
    if sampled is not None:
        reason += "; " + near_tie_summary(sampled)
    return Verdict(VerdictName.DIVERGED, reason, beyond)


def near_tie_summary(sampled: CheckedItem) -> str:
    """Whether the requests whose sampled ids differ had near-tied top-2 logits when recorded."""
    return "; ".join(map(describe_differing_row, sampled.details.get("differing_rows", []))) or "sampled ids differ"


def describe_differing_row(row: dict[str, Any]) -> str:
    """One request whose sampled ids differ (a row of `checks._sampled_item`), in words."""
    if "logits_max_abs_here" not in row:
        return f"request {row['req_id']}: sampled ids differ; no logits to judge a near tie"
    if "near_tie" not in row:
        return (
            f"request {row['req_id']}: sampled ids differ under {row['sampling']} sampling, whose draw "
            f"depends on every probability: logits moved up to {row['logits_max_abs_here']:.3g} here"
        )
    kind = "a near tie" if row["near_tie"] else "not a near tie"
    return (
        f"request {row['req_id']}: sampled ids differ, recorded top-2 logit margin "
        f"{row['top2_margin']:.3g} vs logits moved up to {row['logits_max_abs_here']:.3g} here: {kind}"
    )


def _platform_explains(item: CheckedItem) -> bool:
    if item.bit_exact:
        return True
    return item.float_dtype is not None and within_platform_bound(item.details, item.float_dtype)
