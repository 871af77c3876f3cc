"""How the recorder captures one step: one strategy per capture kind, behind one interface
(`StepCapture`, its methods in the order of the step's events).

A step trigger (`--steps`, `--when`) knows before the forward that the step fires: it opens a
bundle of N >= 1 consecutive steps (`OpenBundle`), each copied as it comes (`CopiedStep` the
first, `CarriedStepCapture` the later ones). An event trigger (`--on exception`, `--on
nonfinite`) knows only after: `MarkedStep`. A kind never writes a bundle itself: it hands the
recorder a step (`Recorder.write`), or its bundle does.
"""

import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from tracekit.format.schema import (
    CarriedStep,
    GrammarRecord,
    KVMode,
    RequestState,
    RunnerCall,
    Step,
    StepError,
)
from tracekit.graphs.host_copy import DeviceFlag, HostCopy, all_finite, context_lost
from tracekit.graphs.timing import DEFAULT_HEAD_START_US, MAX_HEAD_START_US, RegionTimer
from tracekit.integrations.seam import Phase
from tracekit.integrations.vllm.recording import (
    LayerCapture,
    RequestLedger,
    StepMark,
    applied_mask,
    digested_layers,
    drafter_pass,
    hidden_states_of,
    kv_written,
)
from tracekit.record import step_capture
from tracekit.record.settings import RecordSettings
from tracekit.record.step_capture import KVTaken
from tracekit.record.triggers import TriggerEvent, TriggerSet

logger = logging.getLogger("tracekit.record")

Receiver = Callable[[list[list[int]] | None], None]


@dataclass
class PendingStep:
    """The step in progress since `step_started`, whatever captures it."""

    index: int
    scheduler_output: Any
    started: float
    reason: str | None = None  # the step trigger it is recorded for (its bundle's first step's), if any
    phase: Phase = Phase.PREPARE
    capture: "StepCapture | None" = None  # None: nothing may fire for it
    copies: list[HostCopy] = field(default_factory=list)  # the step's copies to host


class Recording(Protocol):
    """What a capture kind uses of the recorder that picked it (`tracekit.record.recorder.Recorder`)."""

    adapter: Any
    triggers: TriggerSet
    settings: RecordSettings
    backend: Any  # the runner's DeviceBackend
    head_start_us: float  # of the next recorded forward's timer
    exhausted: bool  # no more bundles this session

    def guarded(self, function: Callable, name: str | None = None) -> Callable: ...

    def write(self, step: Step, copies: list[HostCopy], now: bool = False) -> None: ...

    def count_bundle(self) -> None: ...

    def deferral_started(self) -> None: ...

    def deferral_ended(self) -> frozenset[str]: ...


class StepCapture:
    """The interface: what a capture kind does at each point of the step it was picked for."""

    def __init__(self, recorder: Recording, pending: PendingStep):
        self.recorder = recorder
        self.pending = pending

    def before_forward(self, input_ids: Any, positions: Any) -> None:
        """The model call is about to read these inputs (for a kind picked before the forward)."""

    def after_forward(self, output: Any) -> None:
        """The model call returned `output`."""

    def logits_computed(self, logits: Any) -> None:
        """The step's sampling logits are computed (sampling may change them in place next)."""

    def drafter_called(self, inputs: dict[str, Any], output: Any) -> None:
        """The speculative drafter's model was called (inside `sample_tokens`)."""

    def drafts_proposed(self, read: Callable[[], Any]) -> None:
        """`sample_tokens` returned: `read()` gives the drafter's proposals for the next step."""

    def sampling(self) -> None:
        """`sample_tokens` is called."""

    def grammar_received(self, read: Callable[[], GrammarRecord]) -> None:
        """`sample_tokens` received the step's grammar mask; `read()` copies it (valid until the
        scheduler computes the next step's mask: in this step, or before the next is scheduled)."""

    def grammar_applied(self, logits: Any) -> None:
        """The grammar mask is on the logits, which sampling reads next."""

    def receiver(self) -> Receiver:
        """`sample_tokens` returned: what takes the step's sampled ids (maybe after the next step started)."""
        return ignore

    def failed(self, trigger: str, error: BaseException) -> Step | None:
        """The step a failure in one of its phases leaves to write (None: none)."""
        return None

    def stop(self) -> None:
        """Let go of whatever was hooked for the step."""

    def _new_copy(self) -> HostCopy:
        """A batch of copies to host for this step, through pinned memory on a side stream
        where the device has one; the step's bundle is written once they landed. The caller
        finishes it in the same callback, so the engine's later work waits for the copies."""
        copy = HostCopy(self.recorder.backend)
        self.pending.copies.append(copy)
        return copy

    def _copy(self, capture: Callable[[HostCopy], Any]) -> Any:
        """What `capture` returns, its copies to host through a batch of their own (`_new_copy`)."""
        copy = self._new_copy()
        captured = capture(copy)
        copy.finish()
        return captured

    def _end(self, step: Step | CarriedStep, sampled: Any) -> None:
        """The step's sampled ids are in: its copies to host are all queued."""
        if step.outputs is not None and sampled is not None:
            step.outputs.sampled_token_ids = [list(map(int, ids)) for ids in sampled]
        step.timing.step_us = (time.perf_counter() - self.pending.started) * 1e6
        for copy in self.pending.copies:
            copy.finish()


NOTHING = StepCapture(None, None)  # the capture of a step nothing records: every event ignored


class OpenBundle:
    """The bundle a firing step trigger opens: that step and the next N-1 as they come (`record
    --window N`; docs/GUIDE.md, "Windows"), with the order of the runner calls and, where later
    steps follow, the requests the runner held outside the first step's batch. Its steps are
    written as one bundle, the first step's, once every step's output is in and none joins
    (`taking`: N of them, or fewer where the window ended early)."""

    def __init__(self, recorder: Recording, first: PendingStep, requested: int, held: list[RequestState]):
        self.recorder = recorder
        self.requested = requested
        self.held = held
        self.steps: list[BundleStep] = []  # the captures of the steps taken, in order
        self.calls: list[dict[str, Any]] = []
        self.log(RunnerCall.EXECUTE, first.index)
        self.ledger: RequestLedger | None = None  # from the first later step on (`follow`)
        self.closed = False  # no later step joins
        self.written = False

    @property
    def taking(self) -> bool:
        """Whether the next step belongs to the bundle."""
        return not self.closed and len(self.steps) < self.requested

    def log(self, call: RunnerCall, index: int) -> None:
        self.calls.append({"call": call.value, "step": index})

    def follow(self) -> RequestLedger:
        """What following later steps needs, made at the first: the requests' block tables as the
        scheduler outputs leave them (`RequestLedger`), per KV cache group the blocks saved or
        written so far (a later step saves the blocks it reads from the prefix cache that are not
        among them) and the layers whose writes each later step digests (`kv_digest`)."""
        if self.ledger is None:
            first, adapter = self.steps[0].step, self.recorder.adapter  # as copied before its forward
            self.ledger = RequestLedger([*first.requests, *self.held], adapter.frees_preempted)
            self.block_sizes = [group.layout.block_size for group in first.kv.groups]
            self.digested_layers = digested_layers(adapter.kv_groups(), adapter.model)
            self.known = [set(group.saved_block_ids) | set(group.written_block_ids) for group in first.kv.groups]
        return self.ledger

    def take(self, pending: PendingStep) -> "CarriedStepCapture":
        """The next step of the bundle has started."""
        self.log(RunnerCall.EXECUTE, pending.index)
        pending.reason = self.steps[0].pending.reason
        return CarriedStepCapture(self.recorder, pending, self)

    def stop_taking(self) -> None:
        """No later step joins: written as it stands once the outputs of those taken are in."""
        self.closed = True
        self.step_finished()

    def step_finished(self) -> None:
        """A step's output is in: written once every step's is and no more join."""
        if not self.taking and all(capture.finished for capture in self.steps):
            self._write(now=False)

    def step_failed(self) -> None:
        """A later step failed: the bundle ends with it, written now (the engine may be going
        down; an earlier step whose output the engine had not read yet has no sampled ids)."""
        self.closed = True
        self._write(now=True)

    def _write(self, now: bool) -> None:
        first = self.steps[0]
        if self.written or not first.finished:
            return
        self.written = True
        later = [capture.step for capture in self.steps[1:] if capture.step is not None]
        copies = [copy for capture in self.steps for copy in capture.pending.copies]
        self.recorder.write(first.step.with_later(later, self.held, self.calls, self.requested), copies, now)


class BundleStep(StepCapture):
    """A step of an open bundle: copied just before its forward, its forward timed, its outputs
    copied as they come, its runner calls logged, its end told to the bundle."""

    def __init__(self, recorder: Recording, pending: PendingStep, bundle: OpenBundle):
        super().__init__(recorder, pending)
        self.bundle = bundle
        bundle.steps.append(self)
        self.step: Step | CarriedStep | None = None  # from the forward on
        self.timer: RegionTimer | None = None  # the forward's, from `_time_forward` until it returned
        self.cpu_started = 0.0
        self.finished = False  # its output is in

    def _time_forward(self) -> None:
        """Time the model call from now as `StepTiming` records it: on the device's own clock where
        it has one, its process CPU time beside."""
        self.cpu_started = time.process_time()
        self.timer = RegionTimer(self.recorder.backend, self.recorder.head_start_us)

    def after_forward(self, output: Any) -> None:
        timer, self.timer = self.timer, None
        if timer is None:  # a later model call of the step is not its forward
            return
        measured, timing = timer.stop(), self.step.timing
        timing.forward_us, timing.forward_timer = measured.us, measured.timer
        timing.forward_cpu_us = (time.process_time() - self.cpu_started) * 1e6
        # The next recorded forward's head start covers twice this one's host issue.
        self.recorder.head_start_us = min(max(2 * measured.host_us, DEFAULT_HEAD_START_US), MAX_HEAD_START_US)
        # copied before the next forward writes the blocks (async outputs are read later)
        self._copy(lambda copy: self._forward_returned(output, copy))
        self.pending.phase = Phase.LOGITS

    def _forward_returned(self, output: Any, copy: HostCopy) -> None:
        """What the step keeps of its forward's `output`, copied through `copy`."""
        step_capture.capture_after_forward(self.recorder.adapter, self.step, output, copy)

    def logits_computed(self, logits: Any) -> None:
        if self.step is not None:
            self._copy(lambda copy: step_capture.capture_output(self.step, "logits", logits, copy))

    def sampling(self) -> None:
        self.bundle.log(RunnerCall.SAMPLE, self.pending.index)

    def grammar_received(self, read: Callable[[], GrammarRecord]) -> None:
        if self.step is not None:
            self.step.grammar = read()

    def grammar_applied(self, logits: Any) -> None:
        if self.step is not None:
            self._copy(lambda copy: step_capture.capture_output(
                self.step, "grammar_bitmask", applied_mask(logits), copy))

    def drafts_proposed(self, read: Callable[[], Any]) -> None:
        if self.step is not None and self.bundle.steps[0].step.spec_decode is not None:  # the engine drafts
            self._copy(lambda copy: step_capture.capture_proposals(self.step, read(), copy))

    def receiver(self) -> Receiver:
        def finish(sampled: Any) -> None:
            self._end(self.step, sampled)
            self._ended()
            self.finished = True
            self.bundle.step_finished()

        return self.recorder.guarded(finish, "finish")

    def _ended(self) -> None:
        """The step's sampled ids are in (its copies are all queued)."""
        self.bundle.log(RunnerCall.OUTPUT, self.pending.index)


class CopiedStep(BundleStep):
    """The step a step trigger fired for, the first of its bundle: copied whole just before its
    forward (`step_capture.capture`, with the requests the runner holds outside the batch)."""

    def __init__(self, recorder: Recording, pending: PendingStep, mark: StepMark, first_of_its_size: bool):
        adapter, steps = recorder.adapter, recorder.settings.window
        held = adapter.held_request_states(mark) if steps > 1 else []
        super().__init__(recorder, pending, OpenBundle(recorder, pending, steps, held))
        self.mark = mark
        # (the forward, which writes KV, runs after the copy)
        self.step = self._copy(lambda copy: step_capture.capture(adapter, mark, pending.index, pending.reason,
                                                                 recorder.settings.kv, copy, held=held))
        self.step.timing.first_of_its_size = first_of_its_size
        self.layers = LayerCapture(adapter.model).__enter__() if recorder.settings.layers else None
        self._time_forward()

    def _forward_returned(self, output: Any, copy: HostCopy) -> None:
        layers = self._stop_layers()
        super()._forward_returned(output, copy)
        if layers is not None and layers.failure is None:
            self.step.outputs.layers = layers.outputs

    def drafter_called(self, inputs: dict[str, Any], output: Any) -> None:
        if self.step.spec_decode is not None:  # copied before the drafter's next call writes its buffers again
            self._copy(lambda copy: self.step.spec_decode.drafter_calls.append(drafter_pass(inputs, output, copy.copy)))

    def _ended(self) -> None:
        for copy in self.pending.copies:  # the finite check below reads the copies
            copy.wait()
        outputs = self.step.outputs
        if outputs is not None:  # (a graph step's padding rows hold whatever the padded size computed)
            hidden = outputs.hidden_states[: self.step.num_real_rows] if outputs.hidden_states is not None else None
            outputs.finite = bool(all_finite([hidden, outputs.logits], exact=True))
        self.recorder.count_bundle()
        super()._ended()

    def failed(self, trigger: str, error: BaseException) -> Step | None:
        if context_lost(error):  # the copies taken before the forward cannot be waited for
            return kept_from_host(self.recorder, self.mark, self.pending, trigger, error)
        return self.step  # taken intact before the forward

    def stop(self) -> None:
        self._stop_layers()

    def _stop_layers(self) -> Any:
        """Remove the step's layer hooks, if any; returns the capture."""
        layers, self.layers = self.layers, None
        if layers is not None:
            layers.__exit__(None, None, None)
        return layers


class CarriedStepCapture(BundleStep):
    """A later step of a bundle: picked when the step starts (its scheduler output is recorded
    before the runner applies it), copied as the runner carries it just before its forward
    (`step_capture.capture_carried`), and a digest of the KV its forward wrote."""

    def __init__(self, recorder: Recording, pending: PendingStep, bundle: OpenBundle):
        super().__init__(recorder, pending, bundle)
        started = time.perf_counter()
        ledger = bundle.follow()
        self.scheduler_output = recorder.adapter.scheduler_output_record(pending.scheduler_output)
        ledger.apply(self.scheduler_output, f"step {pending.index}")
        # Per KV cache group, the blocks the step writes; per request, its scheduled tokens and blocks
        self.written = ledger.written(self.scheduler_output, bundle.block_sizes)
        self.scheduled = ledger.scheduled_blocks(self.scheduler_output)
        self.positions: Any = None  # the forward's input positions, on the device
        self.recorded_us = (time.perf_counter() - started) * 1e6  # the recorder's host time on the scheduler output

    def before_forward(self, input_ids: Any, positions: Any) -> None:
        recorder, pending, bundle = self.recorder, self.pending, self.bundle
        mark: StepMark = recorder.adapter.mark(pending.scheduler_output, input_ids, positions)
        self.positions = mark.positions
        self.step = self._copy(lambda copy: step_capture.capture_carried(
            recorder.adapter, mark, pending.index, self.scheduler_output, copy, bundle.known))
        for known, written in zip(bundle.known, self.written):
            known.update(written)
        self.step.timing.host_copy_us += self.recorded_us
        self._time_forward()

    def _forward_returned(self, output: Any, copy: HostCopy) -> None:
        """Also a digest of the KV the forward wrote, per layer and request (`kv_digest`):
        computed on the copy's side stream, before the next step can write the same blocks."""
        super()._forward_returned(output, copy)
        started = time.perf_counter()
        order = self.step.batch_order
        if all(req_id in self.scheduled for req_id in order):
            self.step.kv_written = kv_written(
                self.recorder.adapter.kv_groups(), self.bundle.digested_layers, self.positions,
                [self.scheduled[req_id][0] for req_id in order], [self.scheduled[req_id][1] for req_id in order],
                copy.computed)
        self.step.timing.host_copy_us += (time.perf_counter() - started) * 1e6

    def failed(self, trigger: str, error: BaseException) -> None:
        """The bundle ends with this step, written now with its failure. A step that failed
        before its forward has no batch order, inputs or dispatch."""
        self.step = self.step or CarriedStep(index=self.pending.index, scheduler_output=self.scheduler_output,
                                             batch_order=[])
        note_failure(self.step, self.pending, error)
        self.bundle.step_failed()


class MarkedStep(StepCapture):
    """Event triggers, meant to stay armed in a serving engine (docs/GUIDE.md, "Always-on"): the
    step keeps a `StepMark` and a finite check of its outputs on the device, and is copied at a
    failure or once its outputs proved not finite. `mark` None: a step that failed before its
    forward, marked at the failure (`taken`: its KV is as before the forward)."""

    def __init__(self, recorder: Recording, pending: PendingStep, mark: StepMark | None,
                 taken: KVTaken = KVTaken.AFTER_STEP):
        super().__init__(recorder, pending)
        self.mark = mark
        self.taken = taken
        self.output: Any = None  # the forward's output (a reference: the runner's until the next forward)
        # the sampling logits, copied on the device (sampling changes them in place) where the
        # non-finite check is not known finite when they are computed
        self.logits: Any = None
        self.finite: DeviceFlag | None = None  # whether the step's hidden states and logits are finite
        self.finite_confirmed: bool | None = None  # its answer, once read
        # What reads the grammar mask sampling received, copied only once the step is to be kept
        # (or its check deferred past the scheduler's next mask); the mask as applied is not taken:
        # it would cost a device op on every step of an always-on recorder.
        self.grammar: Callable[[], GrammarRecord] | None = None

    def after_forward(self, output: Any) -> None:
        self.output, self.pending.phase = output, Phase.LOGITS

    def logits_computed(self, logits: Any) -> None:
        recorder = self.recorder
        if TriggerEvent.NONFINITE not in recorder.triggers.events:
            return
        flag = DeviceFlag(all_finite(self._outputs_checked(logits)), recorder.backend)
        if flag.ready() and self._finite(flag, logits):  # known at once (CPU): nothing to keep
            return
        self.finite = flag  # else read at the step's end, without a sync of its own
        self.logits = device_clone(logits)

    def grammar_received(self, read: Callable[[], GrammarRecord]) -> None:
        self.grammar = read

    def receiver(self) -> Receiver:
        """Whether the outputs were finite: read now where the device has passed the check, else
        with the sampled ids, the step's inputs and outputs kept on the device until then."""
        recorder = self.recorder
        if self.finite is None or recorder.exhausted:
            return ignore
        if self.finite.ready():
            if self._finite(self.finite, self.logits):
                return ignore
            step = self._capture_nonfinite(self.mark, KVMode(recorder.settings.kv))
            return recorder.guarded(lambda sampled: self._write(step, sampled), "finish")
        mark = self.mark
        kept = dataclasses.replace(mark, input_ids=device_clone(mark.input_ids), positions=device_clone(mark.positions))
        self.output = device_clone(hidden_states_of(self.output))
        if self.grammar is not None:  # the scheduler's next mask may be computed before this is read
            copied = self.grammar()
            self.grammar = lambda: copied
        recorder.deferral_started()

        def receive(sampled: Any) -> None:
            preempted = recorder.deferral_ended()
            if self._finite(self.finite, self.logits) or recorder.exhausted:
                return
            # The next step has been scheduled (and maybe run): it wrote only its own new slots,
            # unless the scheduler preempted a request of this step and gave its blocks to another.
            kv = KVMode(recorder.settings.kv)
            if preempted & set(recorder.adapter.marked_req_ids(kept)):
                kv = KVMode.RECOMPUTE
            self._write(self._capture_nonfinite(kept, kv), sampled)

        return recorder.guarded(receive)

    def failed(self, trigger: str, error: BaseException) -> Step | None:
        """The failed step from its mark: from the live cache and runner, or, where the failure
        lost the device context, from host memory alone (a `--kv recompute` bundle)."""
        recorder, pending = self.recorder, self.pending
        if recorder.exhausted:
            return None
        # A step that failed before its forward is marked here; what the failure kept from being
        # prepared (the input ids) the replay prepares again.
        mark = self.mark or recorder.adapter.mark(pending.scheduler_output, None, None)
        if context_lost(error):
            return kept_from_host(recorder, mark, pending, trigger, error)
        return self._capture(mark, trigger, KVMode(recorder.settings.kv), self.taken)

    def _write(self, step: Step, sampled: Any) -> None:
        self._end(step, sampled)
        step.trigger = TriggerEvent.NONFINITE.value
        self.recorder.write(step, self.pending.copies)

    def _finite(self, flag: DeviceFlag, logits: Any) -> bool:
        """The check's answer; a "not finite" from the cheap check is confirmed element by element
        (once: the answer is kept)."""
        if self.finite_confirmed is None:
            self.finite_confirmed = flag.value() or bool(all_finite(self._outputs_checked(logits), exact=True))
        return self.finite_confirmed

    def _capture_nonfinite(self, mark: StepMark, kv: KVMode) -> Step:
        """The step whose outputs proved not finite, counted now: under async scheduling its
        bundle is written when its sampled ids are read, after later steps have been checked."""
        step = self._capture(mark, TriggerEvent.NONFINITE.value, kv, KVTaken.AFTER_STEP)
        step.outputs.finite = False
        self.recorder.count_bundle()
        return step

    def _capture(self, mark: StepMark, trigger: str, kv: KVMode, taken: KVTaken) -> Step:
        """The step from `mark`, with the forward's outputs where it got that far."""
        recorder = self.recorder
        copy = self._new_copy()
        step = step_capture.capture(recorder.adapter, mark, self.pending.index, trigger, kv.value, copy, taken)
        step.grammar = self.grammar() if self.grammar is not None else None
        if self.output is not None:
            step_capture.capture_after_forward(recorder.adapter, step, self.output, copy)
            step_capture.capture_output(step, "logits", self.logits, copy)
        copy.finish()  # the engine's stream goes on once the copies ran, its host at once
        return step

    def _outputs_checked(self, logits: Any) -> list[Any]:
        """The outputs the non-finite check reads: the real rows of the hidden states (padding
        rows of a graph step are not the step's), and the logits."""
        hidden = hidden_states_of(self.output)
        real = self.recorder.adapter.num_scheduled_tokens(self.pending.scheduler_output)
        return [hidden[:real] if hidden is not None else None, logits]


def ignore(sampled: Any) -> None:
    """The output receiver of a step that is not recorded."""


def device_clone(tensor: Any) -> Any:
    """A copy on the tensor's own device (queued, no host sync), or None."""
    return tensor.detach().clone() if tensor is not None else None


def kept_from_host(recorder: Recording, mark: StepMark, pending: PendingStep, trigger: str,
                   error: BaseException) -> Step:
    """A failed step whose failure lost the device context: nothing on the device can be read
    or waited for again, so the step is kept from host memory alone, its KV to be recomputed by
    the replay."""
    logger.warning("tracekit: the device context is lost (%s); the step is kept from host memory, "
                   "its KV to be recomputed by the replay", type(error).__name__)
    return step_capture.capture(recorder.adapter, mark, pending.index, trigger, KVMode.RECOMPUTE.value, None)


def note_failure(step: Step | CarriedStep, pending: PendingStep, error: BaseException) -> None:
    """How the step raised (`Step.error`), and how long it had run."""
    step.timing.step_us = (time.perf_counter() - pending.started) * 1e6
    step.error = StepError(type=type(error).__name__, message=str(error),
                           traceback="".join(traceback.format_exception(error)), phase=Phase(pending.phase).value)
