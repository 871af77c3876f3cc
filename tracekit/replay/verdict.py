"""What a replay's outcome means, in one word: the report's first line, the JSON's `verdict`, the
exit code (each verdict: docs/GUIDE.md "Verdicts"; what each covers and how its bounds were
measured: docs/VERDICTS.md).

Off the recording platform "not bit-exact" alone says nothing: the verdict asks whether the
platform (or release) explains the difference (`tracekit.numerics.PLATFORM_BOUNDS`), and whether
replays of the step from the same restored state agree among themselves (`tracekit.replay.repeats`).
"""

from dataclasses import dataclass, field
from typing import Any

from tracekit.errors import EXIT_NOT_REPRODUCED, EXIT_OK
from tracekit.numerics import within_platform_bound
from tracekit.replay.checks import ERROR_ITEM, LAYER_PREFIX, CheckedItem
from tracekit.replay.repeats import Repeats
from tracekit.replay.verdict_names import VerdictName

__all__ = ["Verdict", "VerdictName", "decide", "describe_differing_row", "describe_mask_row"]


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
    releases: tuple[str, str] | None = None,
    repeats: Repeats | None = None,
    sampler_change: str | None = None,
) -> Verdict:
    """`items`: every check (step items and per-layer items; those that do not decide, the
    padding rows, are left out); `numeric_differences`: the environment fields that differ and
    affect numerics; the rest as `ReplayResult`'s fields of their names (`kv_recomputed`: the
    reason says so)."""
    items = [item for item in items if item.decides]
    if releases is not None:
        verdict = _decide_across_releases(items, numeric_differences, tolerance, error_step, releases, sampler_change)
    else:
        verdict = _decide(items, numeric_differences, tolerance, error_step)
    if repeats is not None and verdict.name == VerdictName.DIVERGED:
        verdict = _repeated(verdict, repeats)
    if kv_recomputed:
        verdict.reason += "; KV recomputed, not restored"
    return verdict


def _decide(items: list[CheckedItem], numeric_differences: list[str], tolerance: float, error_step: bool,
            explained_by: str = "platform") -> Verdict:
    if error_step:
        if all(item.bit_exact for item in items):
            return Verdict(VerdictName.ERROR_REPRODUCED, "the forward raised the recorded error again")
        return Verdict(VerdictName.ERROR_NOT_REPRODUCED, "the forward did not raise the recorded error")
    if all(item.bit_exact for item in items):
        return Verdict(VerdictName.BIT_EXACT, "every item is bit-identical to the recording")
    judged = [item for item in items if not item.digest_only]  # those with a magnitude
    if tolerance > 0 and all(item.within_tolerance for item in judged):
        return Verdict(VerdictName.WITHIN_TOLERANCE, f"every item within relative RMS {tolerance:g}")
    first = next(item for item in items if not item.within_tolerance)
    if not numeric_differences:
        return Verdict(VerdictName.DIVERGED, f"first divergence at {first.name} on the recording's own platform")
    beyond = [item.name for item in judged if not item.bit_exact
              and (item.float_dtype is None or not within_platform_bound(item.details, item.float_dtype))]
    if not beyond:
        return Verdict(
            VerdictName.PLATFORM_DIFFERENCE,
            f"not bit-exact, but this platform differs ({', '.join(numeric_differences)}); discrete items "
            "equal, float items within the calibrated per-dtype bounds",
        )
    reason = f"{beyond[0]} is beyond what the {explained_by} difference ({', '.join(numeric_differences)}) explains"
    sampled = next((item for item in items if item.name == "sampled_token_ids" and not item.bit_exact), None)
    if sampled is not None:  # whether the requests whose ids differ had near-tied top-2 logits when recorded
        reason += "; " + ("; ".join(map(describe_differing_row, sampled.details.get("differing_rows", [])))
                          or "sampled ids differ")
    return Verdict(VerdictName.DIVERGED, reason, beyond)


def _decide_across_releases(items: list[CheckedItem], numeric_differences: list[str], tolerance: float,
                            error_step: bool, releases: tuple[str, str], sampler_change: str | None) -> Verdict:
    """The verdict of a step recorded under vLLM `releases[0]` and replayed under `releases[1]`
    (`sampler_change`: how their samplers draw otherwise, where known)."""
    recorded, here = releases
    raised = next((item for item in items if item.name == ERROR_ITEM), None)
    if error_step and raised is not None and raised.details.get("raised") is None:
        return Verdict(VerdictName.ERROR_GONE, f"the recorded error is gone under vLLM {here}: the step ran through")
    if not error_step and raised is not None:
        return Verdict(VerdictName.ERROR_APPEARED,
                       f"under vLLM {here} the step raised {raised.details.get('raised')} (recorded under {recorded}: none)")
    change = _nonfinite_change(items)
    if change is not None:
        name = VerdictName.NONFINITE_APPEARED if change[0] == "appeared" else VerdictName.NONFINITE_GONE
        where = "recorded finite" if change[0] == "appeared" else "recorded NaN/inf"
        return Verdict(name, f"{change[1]} {where} under vLLM {recorded} is {'not ' if change[0] == 'appeared' else ''}"
                             f"finite under {here}")
    verdict = _decide(items, numeric_differences, tolerance, error_step, explained_by="release")
    if _drawn_otherwise(items, verdict):
        if sampler_change is not None:
            return Verdict(VerdictName.RELEASE_DIFFERENCE,
                           f"the sampled ids differ from bit-identical logits, only in rows sampled at a temperature: "
                           f"{sampler_change} (docs/RELEASES.md)")
        verdict.reason = (f"the sampled ids differ from bit-identical logits, only in rows sampled at a temperature, "
                          f"and no change of the sampler between vLLM {recorded} and {here} is known to tracekit; "
                          + verdict.reason)
    if verdict.name == VerdictName.PLATFORM_DIFFERENCE:
        layer = next((item.name.removeprefix(LAYER_PREFIX) for item in items
                      if item.name.startswith(LAYER_PREFIX) and not item.bit_exact), None)
        where = (f"first diverging layer {layer}" if layer is not None else
                 "record with --enforce-eager --layers to name the first diverging layer")
        return Verdict(
            VerdictName.RELEASE_DIFFERENCE,
            f"only float rounding moved between vLLM {recorded} (recorded) and {here}: discrete items equal, "
            f"float items within the calibrated per-dtype bounds; {where}",
        )
    return verdict


def _repeated(verdict: Verdict, repeats: Repeats) -> Verdict:
    """A diverged step's verdict, its replays from the same restored state told: `nondeterministic`
    where they disagree among themselves, else still `diverged`, saying they agreed."""
    disagreement = repeats.disagreement()
    unreplayed = f"; not replayed again in {'; '.join(repeats.failures)}" if repeats.failures else ""
    if disagreement is None:
        alone = "" if repeats.fresh else " (replay the bundle alone to repeat it in a fresh process too)"
        verdict.reason += (f"; replayed {len(repeats.runs)} times from the same restored state ({repeats.counts()}): "
                           f"every replay gave the same{alone}{unreplayed}")
        return verdict
    alike = (f"; every replay gave the same {', '.join(disagreement.alike_before)} before it"
             if disagreement.alike_before else "")
    return Verdict(
        VerdictName.NONDETERMINISTIC,
        f"replays of the step from the same restored state ({repeats.counts()}) disagree among themselves: first at "
        f"{disagreement.item} ({disagreement.results} different results){alike}; the engine does not repeat itself "
        f"there (against the recording: {verdict.reason}){unreplayed}",
        verdict.beyond_bound,
    )


def _drawn_otherwise(items: list[CheckedItem], verdict: Verdict) -> bool:
    """Whether a step parted only at its sampled ids, from bit-identical logits, in rows that
    sample at a temperature (a greedy row's argmax depends on the logits alone)."""
    logits = next((item for item in items if item.name == "logits"), None)
    sampled = next((item for item in items if item.name == "sampled_token_ids"), None)
    if verdict.beyond_bound != ["sampled_token_ids"] or logits is None or not logits.bit_exact or sampled is None:
        return False
    rows = sampled.details.get("differing_rows", [])
    return bool(rows) and all(row["sampling"] != "greedy" for row in rows)


def _nonfinite_change(items: list[CheckedItem]) -> tuple[str, str] | None:
    """("appeared", item) where an item recorded finite is not finite here, else ("gone", item)
    where one recorded with NaN/inf is finite here; None when neither."""
    counts = [(item.name, item.details.get("nonfinite") or {}) for item in items]
    for name, count in counts:
        if not count.get("recorded") and count.get("replayed"):
            return "appeared", name
    for name, count in counts:
        if count.get("recorded") and not count.get("replayed"):
            return "gone", name
    return None


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


def describe_mask_row(row: dict[str, Any]) -> str:
    """One logits row whose grammar mask differs (a row of `checks._grammar_item`), in words."""
    where = "its sampled token" if row["position"] == 0 else f"draft {row['position']}"
    return (
        f"grammar mask row {row['row']} (request {row['req_id']}, {where}): "
        f"{row['allowed_only_recorded']} token(s) allowed only in the recording {row['tokens_only_recorded']}, "
        f"{row['allowed_only_here']} only here {row['tokens_only_here']}"
    )
