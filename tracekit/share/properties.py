"""What `tracekit shrink --until PROPERTY` keeps true while it cuts a bundle down (docs/GUIDE.md#shrink).

Of a single step, a cut batch has no recorded outputs to compare with, so every property is
judged from the replay alone; of several steps (`record --window`), the replay is checked
against the recording (`WindowProperty`).
"""

import shlex
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from tracekit.errors import UsageError
from tracekit.format.schema import Step
from tracekit.numerics import compare_tensors
from tracekit.share.shrink_trials import EngineReplayer

PROPERTY_NAMES = ("raises", "nonfinite", "modes-differ", "command:CMD")
WINDOW_PROPERTIES = ("diverges", "raises")
# The items steps may part at for their requests to be cut: what the runner fed the model, which
# a smaller batch does not change.
FED_ITEMS = ("batch_order", "input_ids", "positions")


@dataclass
class PropertyOutcome:
    """The outcome of checking a property on one candidate: whether it holds, and what was seen
    (a line for the shrink log; `result`: the replay of several steps). Not a replay verdict
    (`tracekit.replay.verdict`)."""

    holds: bool
    detail: str
    result: Any = None


class StepProperty:
    """What `--until` names: refused up front where the bundle cannot have it, judged per candidate."""

    def __init__(self, text: str):
        self.text = text

    def check_bundle(self, step: Step) -> None:
        """Refuse (exit 2) a property this bundle cannot have, before any engine starts."""

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        raise NotImplementedError

    def requests_kept(self, first: Step) -> str | None:
        """Why the requests cannot be cut (None: they can)."""
        return None


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Raises(StepProperty):
    """The forward raises the recorded error again (same type and message)."""

    def check_bundle(self, step: Step) -> None:
        if step.error is None:
            raise UsageError("--until raises needs a bundle whose recorded forward raised (record with --on exception)")

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        try:
            replayer.run(step, None)
        except Exception as error:  # the property is about exactly this
            same = step.raised_as_recorded(error)
            return PropertyOutcome(same, f"raised {_described(error)}" + ("" if same else " (not the recorded error)"))
        return PropertyOutcome(False, "did not raise")


def _first_rows(tensor: Any, rows: int) -> Any:
    return tensor[:rows] if tensor is not None and tensor.dim() >= 1 else tensor


class NonFinite(StepProperty):
    """The hidden states (real rows) or logits of the replayed forward hold a NaN or an inf."""

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        try:
            observed = replayer.run(step, None)
        except Exception as error:  # a forward that raises yields no values at all
            return PropertyOutcome(False, f"raised {_described(error)}")
        found = [
            name for name, tensor in (
                ("hidden_states", _first_rows(observed.hidden_states, step.num_real_rows)), ("logits", observed.logits)
            )
            if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
        ]
        return PropertyOutcome(bool(found), f"non-finite {', '.join(found)}" if found else "all finite")


class ModesDiffer(StepProperty):
    """The forward as the engine runs it (compiled, or its graph) and the eager one differ in
    their hidden states by more than the tolerance (relative RMS; 0: any bit)."""

    def __init__(self, text: str, tolerance: float):
        super().__init__(text)
        self.tolerance = tolerance

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        if replayer.adapter().reference_mode == "eager" and step.graph.runtime_mode == "NONE":
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

    def __init__(self, text: str, command: str):
        super().__init__(text)
        if not command.strip():
            raise UsageError("--until command:CMD needs a command after 'command:'")
        self.command = command

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        path = shlex.quote(str(replayer.write(step)))
        line = self.command.replace("{bundle}", path) if "{bundle}" in self.command else f"{self.command} {path}"
        finished = subprocess.run(line, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return PropertyOutcome(finished.returncode == 0, f"exit {finished.returncode}")


class WindowProperty(StepProperty):
    """`diverges` (the steps part from the recording at the same step and item as the bundle's
    own replay) or `raises` (the last step raises the recorded error again) on several steps."""

    def __init__(self, text: str):
        super().__init__(text)
        self.target: str | None = None  # where the bundle's own replay parts (`step S/item`), once `aim` saw it

    def check_bundle(self, step: Step) -> None:
        if self.text == "raises" and not any(carried.error for carried in step.later):
            raise UsageError("--until raises needs a window whose last step raised when it was recorded")

    def evaluate(self, step: Step, replayer: EngineReplayer) -> PropertyOutcome:
        return self.judge(replayer.replay(step))

    def judge(self, result: Any, before: int | None = None) -> PropertyOutcome:
        """Whether the replay keeps the property: the steps before `before` (a rebuilt step)
        bit-exact, and the target step and item parting (before `aim`: any), or the last step
        raising as recorded."""
        if before is not None:
            parted = [step.step_index for step in result.steps if step.step_index < before and not step.bit_exact]
            if parted:
                return PropertyOutcome(False, f"step {parted[0]} before the rebuilt one parted", result)
        if self.text == "raises":
            verdict = result.verdict.name.value
            return PropertyOutcome(verdict == "error_reproduced", verdict, result)
        found = result.first_divergence
        return PropertyOutcome(found is not None and found == (self.target or found),
                               f"first divergence {found or 'none'}", result)

    def aim(self, result: Any) -> int:
        """The step the property is about in the bundle's own replay (`result`): the one that
        raises, or the first that parts, which every later judgement must part at."""
        if self.text == "raises":
            return result.steps[-1].step_index
        self.target = result.first_divergence
        return int(self.target.split("/", 1)[0].removeprefix("step "))

    def requests_kept(self, first: Step) -> str | None:
        """Requests are cut only where the steps part first in what the runner fed the model, which
        depends on the requests' tokens and the schedule alone: a smaller batch may round otherwise
        and sample otherwise (V1 draws unseeded requests from one generator), which shows as a
        sampled id parting, in the same step or an earlier one, never as the item they part at."""
        if self.text == "diverges" and self.target.split("/", 1)[1] not in FED_ITEMS:
            return (f"the window parts first at {self.target}, which a smaller batch may change by itself "
                    "(float rounding, random draws): its requests are kept")
        if first.grammar is not None or any(carried.grammar is not None for carried in first.later):
            return "a step holds a grammar mask (structured outputs): its requests are kept"
        return None


def parse_property(text: str, tolerance: float = 0.0, several: bool = False) -> StepProperty:
    """The property `--until` names, for a single step or for several (`several`)."""
    if several:
        if text not in WINDOW_PROPERTIES:
            raise UsageError(f"--until {text} is not for a window of steps: choose one of {', '.join(WINDOW_PROPERTIES)}")
        return WindowProperty(text)
    if text.startswith("command:"):
        return Command(text, text.removeprefix("command:"))
    if text == "raises":
        return Raises(text)
    if text == "nonfinite":
        return NonFinite(text)
    if text == "modes-differ":
        if tolerance < 0:
            raise UsageError("--tolerance must be at least 0")
        return ModesDiffer(text, tolerance)
    raise UsageError(f"unknown --until {text!r}: choose one of {', '.join(PROPERTY_NAMES)}")
