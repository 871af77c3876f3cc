"""Driving a bundle's recorded steps (N >= 1) through a rebuilt runner, as the engine drove them
(docs/GUIDE.md, "Windows", says what a replay puts back between steps, and what for).

The first step is rebuilt (`StepDriver`) and its requests kept, so that the later steps' recorded
scheduler outputs apply as they did in the engine and the runner carries its own state; the
runner calls follow the recorded order (`StepWindow.calls`). A step in `rebuild` (`replay --from
K`) is rebuilt instead, on the KV cache the steps before left. A step that raises ends the
sequence there; afterwards every request is finished in the runner, which is left able to serve.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tracekit.format.schema import RunnerCall
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.engines.step_driver import ForwardHandle, ReplayObserver, StepDriver
from tracekit.integrations.vllm.records.window_records import WindowStep
from tracekit.integrations.vllm.runners import kv_digest

ONE_STEP_CALLS = (RunnerCall.EXECUTE, RunnerCall.SAMPLE, RunnerCall.OUTPUT)


@dataclass
class SequenceRun:
    """What running the steps gave: each step's observations (steps that ran), and the failure
    that ended the run, if one did (the step's index and the exception)."""

    observed: dict[int, ObservedStep] = field(default_factory=dict)
    failure: tuple[int, BaseException] | None = None


class SequenceDriver:
    """Runs a bundle's steps (`window_records.window_steps`: the first alone for a single step)
    through the adapter's runner, in the recorded order of runner calls (`Step.runner_calls`;
    none recorded: each step's execute, sample and output in turn). `on_forward` is handed the first step's
    forward (`ForwardHandle`), to time or capture it."""

    def __init__(self, adapter: Any, steps: list[WindowStep], rebuild: set[int] = frozenset(), until: int | None = None, keep_kv_read: bool = False,
                 lora_paths: dict[int, str] | None = None,
                 on_forward: Callable[[ForwardHandle], None] | None = None):
        self.adapter = adapter
        self.runner = adapter.runner
        self.steps = {each.index: each for each in steps if until is None or each.index <= until}
        self.first = steps[0].index
        self.rebuild = {self.first, *rebuild}
        self.keep_kv_read = keep_kv_read  # copy the KV blocks a rebuilt step reads (`ObservedStep.kv_read`)
        self.on_forward = on_forward
        # each step's LoRA adapters are the first step's (the later steps find the slots as it left them)
        self.drivers = {index: StepDriver(adapter, each.step, lora_paths) for index, each in self.steps.items()}
        self.loras = self.drivers[self.first].loras  # the LoRARequest of each adapter located here, by name
        calls = steps[0].step.runner_calls or [{"call": call.value, "step": index}
                                               for index in self.steps for call in ONE_STEP_CALLS]
        self.calls = [call for call in calls if call["step"] in self.steps]
        self.grammar = {index: adapter.release.grammar_output(each.step.grammar)
                        for index, each in self.steps.items() if each.step.grammar is not None}

    @property
    def step(self) -> Any:
        """The first step, as recorded."""
        return self.steps[self.first].step

    def run(self) -> SequenceRun:
        run = SequenceRun({index: ObservedStep() for index in self.steps})
        current: list[int] = [self.first]  # the step in progress: the one last executed or sampled
        observer = ReplayObserver(lambda: run.observed[current[0]])
        calls: dict[int, Callable] = {}
        digested = kv_digest.digested_layers(self.adapter.kv_groups(), self.adapter.model)

        def model_call(original: Callable, args: tuple, kwargs: dict) -> Any:
            index = current[0]
            if index not in calls:
                rebuilt, first = index in self.rebuild, index == self.first
                calls[index] = self.drivers[index].model_call(
                    run.observed[index], self.on_forward if first else None, restore=rebuilt,
                    keep_kv_read=rebuilt and self.keep_kv_read, digest_kv=None if first else digested)
            return calls[index](original, args, kwargs)

        outputs: dict[int, Any] = {}
        with torch.inference_mode():
            self.drivers[self.first].prepare_runner()
            with self.adapter.observe(observer, model_call):
                try:
                    for call in self.calls:
                        current[0] = call["step"]
                        self._call(RunnerCall(call["call"]), current[0], outputs, run)
                except Exception as error:  # the step's own failure: the caller compares it with the recorded one
                    run.failure = (current[0], error)
                finally:
                    self._leave(outputs)
        return run

    def run_one(self) -> ObservedStep:
        """Run a single step: what it produced, or its failure raised."""
        run = self.run()
        if run.failure is not None:
            raise run.failure[1]
        return run.observed[self.first]

    def _call(self, call: RunnerCall, index: int, outputs: dict[int, Any], run: SequenceRun) -> None:
        if call is RunnerCall.EXECUTE:
            self._execute(index, run)
        elif call is RunnerCall.SAMPLE:
            outputs[index] = self.runner.sample_tokens(self.grammar.get(index))
        elif index in outputs:
            output = outputs.pop(index)
            if hasattr(output, "get_output"):  # async: the observer's receiver runs as it is read
                output.get_output()

    def _execute(self, index: int, run: SequenceRun) -> None:
        """The step's scheduler output, applied and run: rebuilt (every request new, their
        per-request state put back) or as recorded (only its new requests' state put back)."""
        each, adapter = self.steps[index], self.adapter
        if index in self.rebuild:
            if index != self.first:  # the runner lets go of every request and starts afresh, as for a single step
                adapter.finish(list(adapter.live_req_ids()))
                adapter.start_afresh()
            scheduler_output = adapter.scheduler_output_for(each.step, each.held, loras=self.loras)
            run.observed[index].drafter_orders_dropped = adapter.release.drafter_orders_dropped(each.step)
            putting_back = adapter.replaying(each.step, each.held)
        else:
            scheduler_output = adapter.release.from_plain(each.step.scheduler_output)
            self._locate_loras(scheduler_output)
            # (the step's inputs and positions are the whole batch's, not rows of its new requests)
            new = dataclasses.replace(each.step, requests=each.new, batch_order=[r.req_id for r in each.new],
                                      input_ids=None, positions=None)
            putting_back = adapter.replaying(new)
        with putting_back:
            if self.runner.execute_model(scheduler_output) is not None:
                raise RuntimeError(f"the runner produced no forward for step {index}")
        run.observed[index].batch_order = adapter.batch_order_after_execute()

    def _locate_loras(self, scheduler_output: Any) -> None:
        """A recorded new request's LoRA adapter, where the replay located it here (the recorded
        path may not exist on this machine)."""
        for new_request in scheduler_output.scheduled_new_reqs:
            recorded = getattr(new_request, "lora_request", None)
            if recorded is not None and isinstance(recorded.lora_name, str) and recorded.lora_name in self.loras:
                new_request.lora_request = self.loras[recorded.lora_name]

    def _leave(self, outputs: dict[int, Any]) -> None:
        """Read the outputs still pending and finish every request: the runner can serve again."""
        self.runner.execute_model_state = None
        for output in outputs.values():
            if hasattr(output, "get_output"):
                try:
                    output.get_output()
                except Exception:  # noqa: BLE001 - a failed step's output: its failure is reported already
                    pass
        self.adapter.finish(list(self.adapter.live_req_ids()))
