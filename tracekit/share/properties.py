"""What `tracekit shrink --until PROPERTY` keeps true while it cuts a bundle down (docs/GUIDE.md#shrink).

Each property is decided from the replay of a candidate's steps (`replay_candidate`), one step
or several (`record --window`): a cut step has no recorded float outputs to compare with, so all
but `diverges` (a window's steps parting from the recording) look at the replay alone.
"""

import shlex
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from tracekit.errors import TracekitError, UsageError
from tracekit.format.schema import Step
from tracekit.numerics import compare_tensors
from tracekit.share.shrink_trials import EngineReplayer

PROPERTY_NAMES = ("raises", "nonfinite", "modes-differ", "command:CMD", "diverges")
# The items steps may part at for their requests to be cut: what the runner fed the model, which
# a smaller batch does not change.
FED_ITEMS = ("batch_order", "input_ids", "positions")


@dataclass
class PropertyOutcome:
    """The outcome of checking a property on one candidate: whether it holds, and what was seen
    (a line for the shrink log; `result`: the replay). Not a replay verdict
    (`tracekit.replay.verdict`)."""

    holds: bool
    detail: str
    result: Any = None


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class StepProperty:
    """What `--until` names: refused up front where the bundle cannot have it, judged per candidate."""

    def check_bundle(self, step: Step) -> None:
        """Refuse (exit 2) a property this bundle cannot have, before any engine starts."""

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        try:
            result = replayer.replay(step)
        except TracekitError:
            raise
        except Exception as error:  # a replay that crashes keeps no property but `raises`, which it records
            return PropertyOutcome(False, f"raised {_described(error)}")
        return self.judge(result)

    def judge(self, result: Any, before: int | None = None) -> PropertyOutcome:
        """Whether the replay keeps the property, the steps before `before` (a rebuilt step) bit-exact."""
        parted = [step.step_index for step in result.steps if before is not None and step.step_index < before
                  and not step.bit_exact]
        if parted:
            return PropertyOutcome(False, f"step {parted[0]} before the rebuilt one parted", result)
        outcome = self.decide(result)
        outcome.result = result
        return outcome

    def decide(self, result: Any) -> PropertyOutcome:
        raise NotImplementedError

    def aim(self, result: Any) -> tuple[int, str]:
        """The step the property is about in the bundle's own replay (`result`), which a window
        is cut down to end at, and how the derivation names it."""
        raise NotImplementedError

    def requests_kept(self, first: Step) -> str | None:
        """Why a window's requests cannot be cut (None: they can)."""
        if first.grammar is not None or any(carried.grammar is not None for carried in first.later):
            return "a step holds a grammar mask (structured outputs): its requests are kept"
        return None


class Raises(StepProperty):
    """The step that raised when recorded (a window's last) raises the same error again, no step
    before it parting."""

    def check_bundle(self, step: Step) -> None:
        if step.error is None and not any(carried.error for carried in step.later):
            raise UsageError("--until raises needs a bundle whose recorded forward raised (record with --on exception)")

    def decide(self, result: Any) -> PropertyOutcome:
        verdict = result.verdict.name.value
        return PropertyOutcome(verdict == "error_reproduced", verdict)

    def aim(self, result: Any) -> tuple[int, str]:
        last = result.steps[-1].step_index
        return last, f"step {last} raises"


def _nonfinite(step: Any) -> list[str]:
    """The outputs of a replayed step (a `ReplayResult`'s) holding a NaN or an inf: the hidden
    states' real rows, the logits."""
    observed = step.observed
    if observed is None:
        return []
    hidden = observed.hidden_states
    if hidden is not None and observed.dispatch is not None:
        hidden = hidden[:observed.dispatch.num_tokens]
    return [name for name, tensor in (("hidden_states", hidden), ("logits", observed.logits))
            if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]


class NonFinite(StepProperty):
    """A step's replayed hidden states (real rows) or logits hold a NaN or an inf."""

    def decide(self, result: Any) -> PropertyOutcome:
        found = [f"step {step.step_index} {name}" for step in result.steps for name in _nonfinite(step)]
        return PropertyOutcome(bool(found), f"non-finite {', '.join(found)}" if found else "all finite")

    def aim(self, result: Any) -> tuple[int, str]:
        first = next(step.step_index for step in result.steps if _nonfinite(step))
        return first, f"step {first} non-finite"


class Diverges(StepProperty):
    """A window's steps part from the recording at the same step and item as the bundle's own
    replay (before `aim`: anywhere)."""

    target: str | None = None  # where the bundle's own replay parts (`step S/item`), once `aim` saw it

    def decide(self, result: Any) -> PropertyOutcome:
        found = result.first_divergence
        return PropertyOutcome(found is not None and found == (self.target or found), f"first divergence {found or 'none'}")

    def aim(self, result: Any) -> tuple[int, str]:
        self.target = result.first_divergence
        return int(self.target.split("/", 1)[0].removeprefix("step ")), self.target

    def requests_kept(self, first: Step) -> str | None:
        """Requests are cut only where the steps part first in what the runner fed the model (why:
        docs/GUIDE.md#windows-bugs-that-live-between-steps, "Shrinking")."""
        if self.target.split("/", 1)[1] not in FED_ITEMS:
            return (f"the window parts first at {self.target}, which a smaller batch may change by itself "
                    "(float rounding, random draws): its requests are kept")
        return super().requests_kept(first)


class ModesDiffer(StepProperty):
    """The forward as the engine runs it (compiled, or its graph) and the eager one differ in
    their hidden states by more than the tolerance (relative RMS; 0: any bit)."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        if replayer.engine().adapter.reference_mode == "eager" and step.graph.runtime_mode == "NONE":
            raise UsageError(
                "--until modes-differ compares the engine's compiled (or graph) forward with the eager one, "
                "but this engine runs eagerly: record the step with compilation on"
            )
        from tracekit.integrations.vllm.runners.runner_state import hidden_states_of

        rows = step.num_real_rows
        outputs: dict[str, Any] = {}

        def both_modes(handle: Any) -> None:
            for mode, form in (("eager", "eager"), ("engine", "compiled")):
                handle.restore()
                outputs[mode] = hidden_states_of(handle.forward(form))[:rows].detach().to("cpu", copy=True)

        try:
            replayer.run(step, both_modes)
        except Exception as error:
            return PropertyOutcome(False, f"raised {_described(error)}")
        comparison = compare_tensors(outputs["engine"], outputs["eager"])
        if comparison["bit_exact"]:
            return PropertyOutcome(False, "bit-exact")
        rms = comparison["relative_rms"]
        return PropertyOutcome(rms > self.tolerance, f"relative RMS {rms:.3g} (tolerance {self.tolerance:g})")


class Command(StepProperty):
    """The command exits 0 on the cut bundle (no engine needed here)."""

    def __init__(self, command: str):
        if not command.strip():
            raise UsageError("--until command:CMD needs a command after 'command:'")
        self.command = command

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        path = shlex.quote(str(replayer.write(step)))
        line = self.command.replace("{bundle}", path) if "{bundle}" in self.command else f"{self.command} {path}"
        finished = subprocess.run(line, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return PropertyOutcome(finished.returncode == 0, f"exit {finished.returncode}")


def parse_property(text: str, tolerance: float = 0.0, several: bool = False) -> StepProperty:
    """The property `--until` names, for a single step or for several (`several`)."""
    if text.startswith("command:"):
        return Command(text.removeprefix("command:"))
    if text == "raises":
        return Raises()
    if text == "nonfinite":
        return NonFinite()
    if text == "diverges":
        if not several:
            raise UsageError("--until diverges is a window's (record --window N): a cut single step holds no "
                             "recorded outputs to part from; choose raises, nonfinite, modes-differ or command:CMD")
        return Diverges()
    if text == "modes-differ":
        if several:
            raise UsageError("--until modes-differ runs one step's forward twice (compiled and eager), which a "
                             "window's replay does only for its first step: record the step alone (no --window)")
        if tolerance < 0:
            raise UsageError("--tolerance must be at least 0")
        return ModesDiffer(tolerance)
    raise UsageError(f"unknown --until {text!r}: choose one of {', '.join(PROPERTY_NAMES)}")
