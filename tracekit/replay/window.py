"""Replaying a window of steps as the engine ran them, and what it found (issue 32).

A window bundle (`record --window N`) holds its first step whole and each later step as the
engine handed it to the model runner. Its replay restores the first step, then feeds every later
step's recorded scheduler output to the runner in the engine's call order, letting the runner
carry its own state, and checks every step's items as a single step's are checked (a later step
recorded no KV blocks: its KV writes show in the next step's outputs). The verdict is the
window's: the first step and item that parted name it (`step 47/input_ids`).

`from_step` (`replay --from K`) rebuilds the runner's state at step K as a single-step replay
builds it, from the request states the bundle implies there, on the KV cache the steps before K
left (those steps still run, carried, and are checked): if the window parts with its state carried
and not from K, what parted lives in what the runner carried into K. Of the KV cache the runner
carries, each parted step says more without another replay: per request whose rows parted, the
steps whose KV it read and whether their rows had parted (`kv_sources`).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tracekit.errors import UsageError
from tracekit.format.schema import KVWritten, Step
from tracekit.integrations.vllm.replay_engine import ReplayEngine, WindowStep
from tracekit.replay import dispatch as dispatch_audit
from tracekit.replay.checks import CheckedItem, check_step, error_item, first_divergence, padding_findings
from tracekit.replay.kv_sources import KVSource, kv_sources
from tracekit.replay.result import ReplayResult, outcome_fields
from tracekit.replay.verdict import Verdict, VerdictName, decide


@dataclass
class WindowReplayResult:
    """Every step of a replayed window (a `ReplayResult` each, in order) and the window's verdict."""

    bundle: str
    steps: list[ReplayResult]  # the steps that ran
    requested: int  # the steps the recording asked for
    recorded: list[int]  # the window's steps, by engine step index
    rebuilt: list[int]  # steps whose runner state was rebuilt (the first; `from_step`)
    from_step: int | None = None
    not_run: list[int] = field(default_factory=list)  # steps after one that raised
    tolerance: float = 0.0
    strict: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # engine arguments given over the recorded ones
    engine_build: dict[str, Any] | None = None  # how the engine was built (`ReplayResult.engine_build`)
    # Per rebuilt step that had no KV blocks saved, the blocks it read as its forward read them
    # (asked for with `keep_kv_read`: a shrink makes such a step the first of a window); not written
    kv_read: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    # Per step that parted, per request whose rows parted: where the KV it read came from
    kv_sources: dict[int, dict[str, KVSource]] = field(default_factory=dict)
    # The window's Inductor kernels against the recorded choices (`ReplayResult.kernel_choices`)
    kernel_choices: dict[str, list[str]] = field(default_factory=dict)
    llm: Any = field(default=None, repr=False)

    @property
    def environment_differences(self) -> list[dict[str, Any]]:
        return self.steps[0].environment_differences if self.steps else []

    @property
    def step_index(self) -> int:
        return self.recorded[0]

    @property
    def trigger(self) -> str:
        return self.steps[0].trigger if self.steps else ""

    @property
    def reference_mode(self) -> str:
        return self.steps[0].reference_mode if self.steps else ""

    @property
    def modes(self) -> dict[str, Any]:
        """A window's forwards are checked, not timed (each step's checked run is in `steps`)."""
        return {}

    @property
    def recorded_timing(self) -> dict[str, Any]:
        return self.steps[0].recorded_timing if self.steps else {}

    @property
    def items(self) -> list[CheckedItem]:
        """Every step's items in order, each named with its step (`step 47/input_ids`)."""
        return [dataclasses.replace(item, name=f"step {result.step_index}/{item.name}")
                for result in self.steps for item in result.checks]

    @property
    def bit_exact(self) -> bool:
        return all(result.bit_exact for result in self.steps)

    @property
    def reproduced(self) -> bool:
        return self.verdict.exit_code() == 0

    @property
    def first_divergence(self) -> str | None:
        item = first_divergence([item for item in self.items if item.name.split("/", 1)[1] != "error"])
        return item.name if item else None

    @property
    def verdict(self) -> Verdict:
        """Decided over every step's items (the environment's differences are the first step's: one
        machine, one engine). A window whose last step raised when recorded ends in that step's
        error verdict, unless a step before it parted."""
        steps = self.steps
        numeric = [d["field"] for d in steps[0].environment_differences if d["affects_numerics"]] if steps else []
        items = [item for item in self.items if item.name.split("/", 1)[1] != "error"]
        verdict = decide(items, numeric, self.tolerance)
        failing = steps[-1] if steps and steps[-1].error_step else None
        if failing is not None and verdict.name != VerdictName.DIVERGED:
            verdict = failing.verdict
            verdict.reason = f"step {failing.step_index}: {verdict.reason}"
        return verdict

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code(self.strict)

    def window_fields(self, result: ReplayResult | None = None) -> dict[str, Any]:
        """What `--json` says of the window in every step's record (and in its summary)."""
        fields = {
            "first_step": self.recorded[0],
            "steps": self.recorded,
            "requested": self.requested,
            "rebuilt": self.rebuilt,
            "from_step": self.from_step,
            "not_run": self.not_run,
            "verdict": self.verdict.name.value,
            "first_divergence": self.first_divergence,
        }
        if result is not None:
            fields["position"] = self.recorded.index(result.step_index)
            fields["state"] = "rebuilt" if result.step_index in self.rebuilt else "carried"
            if result.step_index in self.kv_sources:
                fields["kv_sources"] = {req_id: source.to_plain()
                                        for req_id, source in self.kv_sources[result.step_index].items()}
        return fields

    def step_records(self) -> list[dict[str, Any]]:
        """One JSON record per step that ran (`tracekit replay --json`)."""
        return [{**result.to_plain(), "window": self.window_fields(result)} for result in self.steps]

    def to_plain(self) -> dict[str, Any]:
        """The window as one record: its verdict, and each step's record."""
        return {
            **outcome_fields(self),
            "window": self.window_fields(),
            "environment_differences": self.environment_differences,
            "overrides": self.overrides,
            "engine_build": self.engine_build,
            "kernel_choices": self.kernel_choices,
            "steps": [result.to_plain() for result in self.steps],
        }


def rebuilt_steps(steps: list[WindowStep], from_step: int | None) -> set[int]:
    """The steps whose runner state a replay rebuilds: the first, and `from_step` (a usage error
    when it is no step of the window)."""
    indices = [each.index for each in steps]
    if from_step is not None and from_step not in indices:
        raise UsageError(f"--from {from_step} is not a step of the window (its steps are {indices[0]}..{indices[-1]})")
    return {indices[0]} | ({from_step} if from_step is not None else set())


def run_window(engine: ReplayEngine, bundle: str, steps: list[WindowStep], first: Step, from_step: int | None,
               tolerance: float, strict: bool, differences: list[dict[str, Any]], overrides: dict[str, Any],
               until: int | None = None, keep_kv_read: bool = False,
               lora_paths: dict[int, str] | None = None) -> WindowReplayResult:
    """Run the window's steps on the engine (from the first, rebuilding at `from_step`, up to
    `until`) and check each against the recording (`keep_kv_read`: see `WindowReplayResult.kv_read`;
    `lora_paths`: where the first step's LoRA adapters are here, by int id)."""
    rebuild = rebuilt_steps(steps, from_step)
    try:
        run = engine.window_driver(steps, first.window, rebuild, until, keep_kv_read, lora_paths).run()
    finally:
        engine.forget_cached_prefixes()
    results, not_run = [], []
    for each in steps:
        observed = run.observed.get(each.index)
        if observed is None:
            continue  # past `until`
        failure = run.failure if run.failure is not None and run.failure[0] == each.index else None
        if failure is None and run.failure is not None and each.index > run.failure[0]:
            not_run.append(each.index)
            continue
        if failure is not None and each.step.error is None:
            raise failure[1]  # not the recording's failure: the replay crashed
        kv_written = each.carried.kv_written if each.carried is not None else []
        results.append(_step_result(bundle, each.step, observed, failure, engine.reference_mode, tolerance, strict,
                                    differences, kv_written))
    return WindowReplayResult(
        bundle=bundle, steps=results, requested=first.window.requested if first.window else 1,
        recorded=[each.index for each in steps], rebuilt=sorted(rebuild), from_step=from_step, not_run=not_run,
        tolerance=tolerance, strict=strict, overrides=dict(overrides),
        kv_read={index: observed.kv_read for index, observed in run.observed.items() if observed.kv_read is not None},
        kv_sources=kv_sources([each.step for each in steps], results),
        engine_build={**engine.build.to_plain(), "built_for_this_step": engine.built_here} if engine.build else None,
        llm=engine.llm,
    )


def _step_result(bundle: str, step: Step, observed: Any, failure: tuple[int, BaseException] | None, reference_mode: str,
                 tolerance: float, strict: bool, differences: list[dict[str, Any]],
                 kv_written: list[KVWritten]) -> ReplayResult:
    """One step of the window, checked as a single step is, and a later step's KV writes against
    their recorded digest."""
    if step.error is not None:
        checks = [error_item(step, failure[1] if failure is not None else None)]
    else:
        checks = check_step(observed, step, tolerance, kv_written)
    audited = dispatch_audit.audit(step.graph, observed.dispatch) if observed.dispatch is not None else {}
    return ReplayResult(
        bundle=bundle,
        step_index=step.index,
        trigger=step.trigger,
        reference_mode=reference_mode,
        checks=checks,
        recorded_timing=step.timing.to_plain(),
        replay_forward_us=observed.forward_us,
        environment_differences=differences,
        tolerance=tolerance,
        strict=strict,
        error_step=step.error is not None,
        dispatch=audited,
        padding_findings=padding_findings(observed, step) if observed.dispatch is not None else [],
    )

