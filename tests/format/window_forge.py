"""A window of steps made from the sample trace's step, for tests that need a window bundle without
an engine: its first step is the recorded one, each later step has that step's scheduler output
(cached-request deltas of the same requests: the request states a reader derives from it stay
consistent, if not what an engine would run), batch, inputs and outputs."""

import copy
import dataclasses
from pathlib import Path

from tracekit.format.content import load_step
from tracekit.format.schema import BundleContent, CarriedStep, RequestState, Step, StepOutputs, StepWindow

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


def _carried_after(step: Step, index: int) -> CarriedStep:
    """A later step of a window, shaped like `step` (its scheduler output, batch, inputs, outputs)."""
    return CarriedStep(
        index=index,
        scheduler_output=copy.deepcopy(step.scheduler_output),
        batch_order=list(step.batch_order),
        runner_states={request.req_id: dict(request.runner_state) for request in step.requests},
        input_ids=step.input_ids.clone(),
        positions=step.positions.clone(),
        graph=step.graph,
        rng=dict(step.rng),
        outputs=StepOutputs(hidden_states=step.outputs.hidden_states.clone(), logits=step.outputs.logits.clone(),
                            sampled_token_ids=step.outputs.sampled_token_ids),
    )


def window_content(length: int = 3) -> BundleContent:
    """The sample's content with its step opening a window of `length` steps (and one held request)."""
    content, first = load_step(SAMPLE)
    calls = [{"call": call, "step": index} for index in range(first.index, first.index + length)
             for call in ("execute", "sample", "output")]
    first.window = StepWindow(
        requested=length,
        steps=[_carried_after(first, first.index + offset) for offset in range(1, length)],
        held_requests=[RequestState("held-0", [1, 2, 3], [4], [[7]], num_computed_tokens=3, num_scheduled_tokens=0)],
        calls=calls,
    )
    return dataclasses.replace(content, steps=[first])
