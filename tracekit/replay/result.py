"""What one replay found: the checks, the dispatch, the timings, the verdict — and its JSON form.

Everything a report or a suite row prints comes from `ReplayResult.to_plain()`, so the human
report, `--json` and a replay that ran in a child process say the same thing.
"""

from dataclasses import dataclass, field
from typing import Any

from tracekit.replay.checks import CheckedItem, first_divergence
from tracekit.replay.repeats import Repeats
from tracekit.replay.verdict import Verdict, decide


def outcome_fields(result: Any) -> dict[str, Any]:
    """The head of a replay's JSON record (of a step's, or of a window's): what was replayed and
    what it came to."""
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
class ReplayResult:
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
    # The recorded per-layer outputs (`record --layers`) against this replay's eager forward.
    layer_checks: list[CheckedItem] = field(default_factory=list)
    layers_bundle: str | None = None  # where `--layers` wrote this replay's per-layer outputs
    # What the engine chose for the step when recorded and here (`replay.dispatch`).
    dispatch: dict[str, Any] = field(default_factory=dict)
    # What the padding rows of a graph step may have done to its real outputs, in words.
    padding_findings: list[str] = field(default_factory=list)
    # Whether the modes timed (`--mode all`) gave the same real rows (`timed_modes.mode_agreement`).
    mode_agreement: dict[str, Any] | None = None
    # How the engine it ran on was built (`lean_build.EngineBuild`: lean or full, what it
    # captured), and whether this replay built it; None for an engine tracekit did not build.
    engine_build: dict[str, Any] | None = None
    # The autotuned Triton kernels of this process against the bundle's kernel choices
    # (`kernel_choices.compare`: same, other, unrecorded).
    kernel_choices: dict[str, list[str]] = field(default_factory=dict)
    # (recorded, here) vLLM versions where the bundle comes from another release series.
    releases: tuple[str, str] | None = None
    # Across releases: how their samplers draw a token at a temperature otherwise, where known.
    sampler_change: str | None = None
    # The step replayed again where it did not reproduce (`tracekit.replay.repeats`).
    repeats: Repeats | None = None
    llm: Any = field(default=None, repr=False)  # the engine, for reuse; not serialised

    @property
    def bit_exact(self) -> bool:
        return all(item.bit_exact for item in self.checks if item.decides)

    @property
    def reproduced(self) -> bool:
        return all(item.within_tolerance for item in self.checks if item.decides)

    @property
    def first_divergence(self) -> str | None:
        item = first_divergence(self.checks)
        return item.name if item else None

    @property
    def first_diverging_layer(self) -> CheckedItem | None:
        return first_divergence(self.layer_checks)

    @property
    def verdict(self) -> Verdict:
        numeric = [d["field"] for d in self.environment_differences if d["affects_numerics"]]
        return decide(self.checks + self.layer_checks, numeric, self.tolerance, self.error_step, self.kv_recomputed,
                      self.releases, self.repeats, self.sampler_change)

    @property
    def exit_code(self) -> int:
        """0 unless the verdict is diverged or error_not_reproduced; `strict`: 0 only if bit-exact."""
        return self.verdict.exit_code(self.strict)

    def to_plain(self) -> dict[str, Any]:
        first_layer = self.first_diverging_layer
        return {
            **outcome_fields(self),
            "kv": "recomputed" if self.kv_recomputed else "restored",
            "tolerance_relative_rms": self.tolerance,
            "reference_mode": self.reference_mode,
            "checks": [item.to_plain() for item in self.checks],
            "padding_findings": self.padding_findings,
            "dispatch": self.dispatch,
            "first_diverging_layer": None if first_layer is None else first_layer.name.removeprefix("layer/"),
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
