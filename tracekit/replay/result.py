"""What one replay found: the checks, the dispatch, the timings, the verdict — and its JSON form.

A bundle is a sequence of N >= 1 steps: its replay's result is its first step's, with the steps
after it (`later`, each checked as the first is) and what the sequence was (`SequenceFacts`);
the verdict is decided over every step. Everything a report or a suite row prints comes from
`ReplayResult.to_plain()`, so the human report, `--json` and a replay that ran in a child process
say the same thing.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tracekit.replay.checks import ERROR_ITEM, LAYER_PREFIX, CheckedItem, first_divergence
from tracekit.replay.repeats import Repeats
from tracekit.replay.verdict import Verdict, VerdictName, decide


def outcome_fields(result: Any) -> dict[str, Any]:
    """The head of a replay's JSON record (of a step's, a sequence's or a multi-rank step's): what
    was replayed and what it came to."""
    return {
        "bundle": result.bundle,
        "step": result.step_index,
        "trigger": result.trigger,
        **result.verdict.to_plain(),
        "exit_code": result.exit_code,
        "reproduced": result.reproduced,
        "bit_exact": result.bit_exact,
        "first_divergence": result.first_divergence,
    }


@dataclass
class SequenceFacts:
    """What a replay ran of a bundle's steps (`record --window N`: N asked for)."""

    requested: int = 1  # the steps the recording asked for
    recorded: list[int] = field(default_factory=list)  # the bundle's steps, by engine step index
    rebuilt: list[int] = field(default_factory=list)  # steps whose runner state was rebuilt (the first; `--from`)
    from_step: int | None = None
    not_run: list[int] = field(default_factory=list)  # steps after one that raised
    # Per step that parted, per request whose rows parted: where the KV it read came from
    # (`kv_sources.KVSource`)
    kv_sources: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Per rebuilt step that had no KV blocks saved, the blocks it read as its forward read them
    # (asked for with `keep_kv_read`: a shrink makes such a step the first); not written
    kv_read: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)


@dataclass
class ReplayResult:
    """One step's replay (and, of several steps, the sequence's: `later`, `sequence`). A field
    is the `--json` record's of its name (docs/GUIDE.md, "JSON fields"); `recorded_timing` is
    `recorded`, `kv_recomputed` is `kv`."""

    bundle: str
    step_index: int
    trigger: str
    reference_mode: str
    checks: list[CheckedItem]
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    recorded_timing: dict[str, Any] = field(default_factory=dict)
    replay_forward_us: float | None = None
    environment_differences: list[dict[str, Any]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tolerance: float = 0.0
    error_step: bool = False  # the recorded forward raised
    kv_recomputed: bool = False  # the KV the step read was rebuilt by prefilling, not restored
    strict: bool = False  # exit 0 for a bit-exact replay only
    layer_checks: list[CheckedItem] = field(default_factory=list)
    layers_bundle: str | None = None
    dispatch: dict[str, Any] = field(default_factory=dict)  # `replay.dispatch.audit`
    padding_findings: list[str] = field(default_factory=list)
    mode_agreement: dict[str, Any] | None = None  # `timed_modes.mode_agreement`
    engine_build: dict[str, Any] | None = None  # None for an engine tracekit did not build
    # The autotuned Triton kernels of this process against the bundle's kernel choices
    # (`kernel_choices.compare`: same, other, unrecorded).
    kernel_choices: dict[str, list[str]] = field(default_factory=dict)
    # (recorded, here) vLLM versions where the bundle comes from another release series.
    releases: tuple[str, str] | None = None
    # Across releases: how their samplers draw a token at a temperature otherwise, where known.
    sampler_change: str | None = None
    repeats: Repeats | None = None
    later: list["ReplayResult"] = field(default_factory=list)  # the steps after this one that ran, each checked
    sequence: SequenceFacts = field(default_factory=SequenceFacts)
    llm: Any = field(default=None, repr=False)  # the engine, for reuse; not serialised
    # what the step's forward produced (`ObservedStep`), kept by `replay_candidate` only: a
    # shrink's property looks at it; not serialised
    observed: Any = field(default=None, repr=False)

    @property
    def several(self) -> bool:
        """Whether the bundle holds several steps (a window, `record --window N`)."""
        return len(self.sequence.recorded) > 1

    @property
    def steps(self) -> list["ReplayResult"]:
        """Every step that ran, in order, each alone: the first, then `later`."""
        if not self.several:
            return [self]
        return [dataclasses.replace(self, later=[], sequence=SequenceFacts()), *self.later]

    @property
    def items(self) -> list[CheckedItem]:
        """Every step's items in order; of several steps, each named with its step (`step 47/input_ids`)."""
        if not self.several:
            return self.checks
        return [dataclasses.replace(item, name=f"step {result.step_index}/{item.name}")
                for result in self.steps for item in result.checks]

    @property
    def bit_exact(self) -> bool:
        return all(item.bit_exact for result in self.steps for item in result.checks if item.decides)

    @property
    def reproduced(self) -> bool:
        return all(item.within_tolerance for result in self.steps for item in result.checks if item.decides)

    @property
    def first_divergence(self) -> str | None:
        """The first item that parted (of several steps: before the last step's recorded failure)."""
        items = [item for item in self.items if not (self.several and item.name.endswith("/" + ERROR_ITEM))]
        item = first_divergence(items)
        return item.name if item else None

    @property
    def first_diverging_layer(self) -> CheckedItem | None:
        return first_divergence(self.layer_checks)

    @property
    def verdict(self) -> Verdict:
        """Decided over every step's items (the environment's differences are the first step's: one
        machine, one engine). Steps whose last raised when recorded end in that step's error
        verdict, unless a step before it parted."""
        numeric = [d["field"] for d in self.environment_differences if d["affects_numerics"]]
        if not self.several:
            return decide(self.checks + self.layer_checks, numeric, self.tolerance, self.error_step,
                          self.kv_recomputed, self.releases, self.repeats, self.sampler_change)
        items = [item for item in self.items if not item.name.endswith("/" + ERROR_ITEM)]
        verdict = decide(items, numeric, self.tolerance)
        failing = self.steps[-1]
        if failing.error_step and verdict.name != VerdictName.DIVERGED:
            verdict = failing.verdict
            verdict.reason = f"step {failing.step_index}: {verdict.reason}"
        return verdict

    @property
    def exit_code(self) -> int:
        """0 unless the verdict is diverged or error_not_reproduced; `strict`: 0 only if bit-exact."""
        return self.verdict.exit_code(self.strict)

    @classmethod
    def of_steps(cls, results: list["ReplayResult"], facts: SequenceFacts) -> "ReplayResult":
        """The result of the steps that ran (each alone, in order) of the sequence `facts` tells."""
        return dataclasses.replace(results[0], later=results[1:], sequence=facts)

    def sequence_fields(self, result: "ReplayResult | None" = None) -> dict[str, Any]:
        """What `--json` says of the steps a bundle of several holds, in every step's record (and
        in its summary)."""
        facts = self.sequence
        fields = {
            "first_step": facts.recorded[0],
            "steps": facts.recorded,
            "requested": facts.requested,
            "rebuilt": facts.rebuilt,
            "from_step": facts.from_step,
            "not_run": facts.not_run,
            "verdict": self.verdict.name.value,
            "first_divergence": self.first_divergence,
        }
        if result is not None:
            fields["position"] = facts.recorded.index(result.step_index)
            fields["state"] = "rebuilt" if result.step_index in facts.rebuilt else "carried"
            if result.step_index in facts.kv_sources:
                fields["kv_sources"] = {req_id: source.to_plain()
                                        for req_id, source in facts.kv_sources[result.step_index].items()}
        return fields

    def step_records(self) -> list[dict[str, Any]]:
        """One JSON record per step that ran (`tracekit replay --json`); of several steps, each
        with the sequence's fields (`window`)."""
        if not self.several:
            return [self.to_plain()]
        return [{**result.step_plain(), "window": self.sequence_fields(result)} for result in self.steps]

    def to_plain(self) -> dict[str, Any]:
        """The replay as one record; of several steps, their verdict and each step's record."""
        if not self.several:
            return self.step_plain()
        return {
            **outcome_fields(self),
            "window": self.sequence_fields(),
            "environment_differences": self.environment_differences,
            "overrides": self.overrides,
            "engine_build": self.engine_build,
            "kernel_choices": self.kernel_choices,
            "steps": [result.step_plain() for result in self.steps],
        }

    def step_plain(self) -> dict[str, Any]:
        """This step's record, alone."""
        first_layer = self.first_diverging_layer
        return {
            **outcome_fields(self),
            "kv": "recomputed" if self.kv_recomputed else "restored",
            "tolerance_relative_rms": self.tolerance,
            "reference_mode": self.reference_mode,
            "checks": [item.to_plain() for item in self.checks],
            "padding_findings": self.padding_findings,
            "dispatch": self.dispatch,
            "first_diverging_layer": None if first_layer is None else first_layer.name.removeprefix(LAYER_PREFIX),
            "layer_checks": [item.to_plain() for item in self.layer_checks],
            "layers_bundle": self.layers_bundle,
            "modes": self.modes,
            "mode_agreement": self.mode_agreement,
            "recorded": self.recorded_timing,
            "replay_forward_us": self.replay_forward_us,
            "environment_differences": self.environment_differences,
            "overrides": self.overrides,
            "notes": self.notes,
            "engine_build": self.engine_build,
            "kernel_choices": self.kernel_choices,
            "releases": None if self.releases is None else {"recorded": self.releases[0], "here": self.releases[1]},
            "repeats": None if self.repeats is None else self.repeats.to_plain(),
        }
