"""Driving a window of recorded steps through a rebuilt runner, as the engine drove it (issue 32).

The first step is rebuilt as a single-step replay rebuilds it (every request new, the recorded
KV blocks, RNG states and padding rows put back at its model call), but its requests are not
finished after it: the runner keeps them, so the later steps' recorded scheduler outputs — whose
cached-request deltas name them — apply as they did in the engine, and the runner carries its
own state from step to step (its persistent batch, the sampled ids it keeps on the device under
async scheduling, drafts, Model Runner V2's request slots). For a later step the driver puts back
nothing but the padding rows of its inputs (junk rows a CUDA graph of the padded size reads) and,
for the requests its scheduler output adds, what the runner keeps per request (V2: the seed the
engine drew). The runner calls follow the recorded order (`StepWindow.calls`): under async
scheduling a step's output is read after the next step ran, as in the engine.

`rebuild` names later steps whose state is rebuilt instead (`replay --from K`): the runner lets
go of every request and of what it kept of its last step, and the step runs as a single step of
its request states (derived from the bundle: `window_records`) on the KV cache the steps before
left. A step that raises ends the window there.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tracekit.format.schema import RunnerCall, StepWindow
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.engines.step_driver import ReplayObserver, StepDriver
from tracekit.integrations.vllm.records.window_records import WindowStep
from tracekit.integrations.vllm.runners import kv_digest


@dataclass
class WindowRun:
    """What running a window gave: each step's observations (steps that ran), and the failure
    that ended it, if one did (the step's index and the exception)."""

    observed: dict[int, ObservedStep] = field(default_factory=dict)
    failure: tuple[int, BaseException] | None = None


class _WindowObserver(ReplayObserver):
    """The shadows' reports routed to the step in progress: the step last executed or sampled
    (V1 computes a step's logits in `execute_model`, V2 in `sample_tokens`)."""

    def __init__(self, observed: dict[int, ObservedStep]):
        super().__init__(ObservedStep())
        self.steps = observed
        self.current: int | None = None

    @property
    def observed(self) -> ObservedStep:
        return self.steps[self.current]

    @observed.setter
    def observed(self, value: ObservedStep) -> None:  # the base's initial step: the window has its own
        pass


class WindowDriver:
    """Runs the steps of a window (`window_records.window_steps`) through the adapter's runner."""

    def __init__(self, adapter: Any, steps: list[WindowStep], window: StepWindow | None,
                 rebuild: set[int] = frozenset(), until: int | None = None, keep_kv_read: bool = False,
                 lora_paths: dict[int, str] | None = None):
        self.adapter = adapter
        self.runner = adapter.runner
        self.steps = {each.index: each for each in steps if until is None or each.index <= until}
        self.first = steps[0].index
        self.rebuild = {self.first, *rebuild}
        self.keep_kv_read = keep_kv_read  # copy the KV blocks a rebuilt step reads (`ObservedStep.kv_read`)
        # each step's LoRA adapters are the first step's (the later steps find the slots as it left them)
        self.drivers = {index: StepDriver(adapter, each.step, lora_paths) for index, each in self.steps.items()}
        self.loras = self.drivers[self.first].loras  # the LoRARequest of each adapter located here, by name
        calls = window.calls if window is not None else [
            {"call": call.value, "step": self.first} for call in (RunnerCall.EXECUTE, RunnerCall.SAMPLE, RunnerCall.OUTPUT)]
        self.calls = [call for call in calls if call["step"] in self.steps]
        self.grammar = {index: adapter.release.grammar_output(each.step.grammar)
                        for index, each in self.steps.items() if each.step.grammar is not None}

    def run(self) -> WindowRun:
        run = WindowRun({index: ObservedStep() for index in self.steps})
        observer = _WindowObserver(run.observed)
        calls: dict[int, Callable] = {}
        digested = kv_digest.digested_layers(self.adapter.kv_groups(), self.adapter.model)

        def model_call(original: Callable, args: tuple, kwargs: dict) -> Any:
            index = observer.current
            if index not in calls:
                rebuilt = index in self.rebuild
                calls[index] = self.drivers[index].model_call(run.observed[index], restore=rebuilt,
                                                              keep_kv_read=rebuilt and self.keep_kv_read,
                                                              digest_kv=digested if index != self.first else None)
            return calls[index](original, args, kwargs)

        outputs: dict[int, Any] = {}
        with torch.inference_mode():
            self.drivers[self.first].prepare_runner()
            with self.adapter.observe(observer, model_call):
                try:
                    for call in self.calls:
                        index = call["step"]
                        observer.current = index
                        self._call(RunnerCall(call["call"]), index, outputs, run)
                except Exception as error:  # the step's own failure: the caller compares it with the recorded one
                    run.failure = (observer.current, error)
                finally:
                    self._leave(outputs)
        return run

    def _call(self, call: RunnerCall, index: int, outputs: dict[int, Any], run: WindowRun) -> None:
        runner = self.runner
        if call is RunnerCall.EXECUTE:
            self._execute(index, run)
        elif call is RunnerCall.SAMPLE:
            outputs[index] = runner.sample_tokens(self.grammar.get(index))
        elif index in outputs:
            output = outputs.pop(index)
            if hasattr(output, "get_output"):  # async: the observer's receiver runs as it is read
                output.get_output()

    def _execute(self, index: int, run: WindowRun) -> None:
        """The step's scheduler output, applied and run: rebuilt (every request new, their
        per-request state put back) or as recorded (only its new requests' state put back)."""
        each, adapter = self.steps[index], self.adapter
        if index in self.rebuild:
            if index != self.first:
                self._let_go()
            scheduler_output = adapter.scheduler_output_for(each.step, each.held, loras=self.loras)
            run.observed[index].drafter_orders_dropped = adapter.release.drafter_orders_dropped(each.step)
            putting_back = adapter.replaying(each.step, each.held)
        else:
            scheduler_output = adapter.release.from_plain(each.step.scheduler_output.to_plain())
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

    def _let_go(self) -> None:
        """Before a rebuilt step: the runner lets go of every request and starts afresh, as for a
        single step (`RunnerAdapter.start_afresh`)."""
        self.adapter.finish(list(self.adapter.live_req_ids()))
        self.adapter.start_afresh()

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
