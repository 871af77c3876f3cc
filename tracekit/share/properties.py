"""What `tracekit shrink --until PROPERTY` keeps true while it cuts a step down.

A cut batch has no recorded outputs to compare with, so every property is judged from the
replay alone:

  raises         the forward raises the recorded error again (same type and message)
  nonfinite      the hidden states or logits of the replayed forward hold a NaN or an inf
  modes-differ   the forward as the engine runs it (compiled; through vLLM's graph wrapper where
                 the step was dispatched to a graph) and the eager forward differ by more than
                 the tolerance (relative RMS of the hidden states; 0: any bit)
  command:CMD    CMD exits 0 on the cut bundle (`{bundle}` in CMD is its path; else appended)

The engine properties replay on one engine, built once (or handed in) and reused for every
trial; `command:` needs no engine at all.
"""

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tracekit.errors import UsageError
from tracekit.format.schema import Step
from tracekit.numerics import compare_tensors

PROPERTY_NAMES = ("raises", "nonfinite", "modes-differ", "command:CMD")


@dataclass
class PropertyOutcome:
    """The outcome of checking a property on one candidate step: whether it holds, and what
    was seen (a line for the shrink log). Not a replay verdict (`tracekit.replay.verdict`)."""

    holds: bool
    detail: str


class StepReplayer:
    """Runs candidate steps: on the reused engine, or written to a file for a command."""

    def run(self, step: Step, on_forward: Callable[[Any], None] | None) -> Any:
        """The step replayed (an `ObservedStep`); raises what its forward raises."""
        raise NotImplementedError

    def write(self, step: Step) -> Path:
        """A bundle file holding the step."""
        raise NotImplementedError

    def engine_mode(self) -> str:
        """"eager" or "compiled": how the engine's own forward runs."""
        raise NotImplementedError


class StepProperty:
    needs_engine = True

    def __init__(self, text: str):
        self.text = text

    def check_bundle(self, step: Step) -> None:
        """Refuse (exit 2) a property this bundle cannot have, before any engine starts."""

    def evaluate(self, step: Step, replayer: StepReplayer) -> PropertyOutcome:
        raise NotImplementedError


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Raises(StepProperty):
    def check_bundle(self, step: Step) -> None:
        if step.error is None:
            raise UsageError("--until raises needs a bundle whose recorded forward raised (record with --on exception)")

    def evaluate(self, step: Step, replayer: StepReplayer) -> PropertyOutcome:
        try:
            replayer.run(step, None)
        except Exception as error:  # the property is about exactly this
            same = step.raised_as_recorded(error)
            return PropertyOutcome(same, f"raised {_described(error)}" + ("" if same else " (not the recorded error)"))
        return PropertyOutcome(False, "did not raise")


def _first_rows(tensor: Any, rows: int) -> Any:
    return tensor[:rows] if tensor is not None and tensor.dim() >= 1 else tensor


class NonFinite(StepProperty):
    def evaluate(self, step: Step, replayer: StepReplayer) -> PropertyOutcome:
        try:
            observed = replayer.run(step, None)
        except Exception as error:  # a forward that raises yields no values at all
            return PropertyOutcome(False, f"raised {_described(error)}")
        rows = sum(request.num_scheduled_tokens for request in step.requests)
        found = [
            name for name, tensor in (
                ("hidden_states", _first_rows(observed.hidden_states, rows)), ("logits", observed.logits)
            )
            if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
        ]
        return PropertyOutcome(bool(found), f"non-finite {', '.join(found)}" if found else "all finite")


class ModesDiffer(StepProperty):
    def __init__(self, text: str, tolerance: float):
        super().__init__(text)
        self.tolerance = tolerance

    def evaluate(self, step: Step, replayer: StepReplayer) -> PropertyOutcome:
        if replayer.engine_mode() == "eager" and step.graph.runtime_mode == "NONE":
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
    needs_engine = False

    def __init__(self, text: str, command: str):
        super().__init__(text)
        if not command.strip():
            raise UsageError("--until command:CMD needs a command after 'command:'")
        self.command = command

    def evaluate(self, step: Step, replayer: StepReplayer) -> PropertyOutcome:
        path = shlex.quote(str(replayer.write(step)))
        line = self.command.replace("{bundle}", path) if "{bundle}" in self.command else f"{self.command} {path}"
        finished = subprocess.run(line, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return PropertyOutcome(finished.returncode == 0, f"exit {finished.returncode}")


def parse_property(text: str, tolerance: float = 0.0) -> StepProperty:
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
