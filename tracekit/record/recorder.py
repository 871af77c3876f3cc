"""The recorder armed on one live model runner.

Arming asks the runner's adapter (`tracekit.integrations.vllm.runner_adapter`) to shadow that
runner's methods; the adapter reports each step's progress back (`StepObserver`): step started,
just before the forward (decide whether to fire; copy the step's inputs and KV to host), after
it (outputs, KV written), logits, sampling and bookkeeping phases, sampled ids, or a failure in
any of those phases. Disarming removes the shadows.

Event triggers (`--on exception`, `--on nonfinite`) cannot know before the forward whether the
step will fire, and are meant to stay armed in a serving engine, so they copy nothing in
advance: each step only leaves a `StepMark` (references, the RNG states, a few numbers per
request). A step that fails is copied at the failure: the KV blocks it read are intact in the
live cache (a step writes only the slots of its new tokens), and the mark rewinds what its later
phases changed. Non-finite outputs are checked on the device (one boolean, brought to host
without a sync) and decided at the end of the step, while its outputs and inputs are still the
runner's. A failure that lost the device context (a device-side assert, an illegal address)
leaves nothing on the device to read: that step is kept from host memory alone, as a
`--kv recompute` bundle whose replay rebuilds the KV by prefilling the recorded tokens.

The recorder runs inside other people's engines, so whatever goes wrong in it — arming on a
runner it does not understand, a value it cannot store, a full disk, a dead writer thread — is
caught where the engine calls into it, logged once, and the recorder disarms itself: the
engine's outputs stay exactly those of an unarmed run.
"""

import dataclasses
import functools
import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tracekit.errors import UsageError
from tracekit.format.schema import KV_MODES, KVMode, ParallelRank, Step
from tracekit.graphs.host_copy import DeviceFlag, HostCopy, all_finite, context_lost
from tracekit.graphs.timing import DEFAULT_HEAD_START_US, MAX_HEAD_START_US, RegionTimer
from tracekit.integrations.seam import Phase
from tracekit.integrations.vllm import layer_capture, ranks
from tracekit.integrations.vllm.runner_adapter import RunnerAdapter, StepMark, hidden_states_of
from tracekit.integrations.vllm.step_driver import unknown_tokens_to_recompute
from tracekit.integrations.vllm.version import installed_release
from tracekit.record import step_capture
from tracekit.record.persist import BackgroundPersister, OutputTemplate
from tracekit.record.sampled_ids import SampledIds
from tracekit.record.triggers import TriggerEvent, TriggerSet

logger = logging.getLogger("tracekit.record")

DEFAULT_MAX_BUNDLES = 16


@dataclass
class _PendingStep:
    index: int
    scheduler_output: Any
    started: float
    reason: str | None = None
    step: Step | None = None
    forward_seen: bool = False
    phase: Phase = Phase.PREPARE
    forward_timer: Any = None  # the RegionTimer started at this step's model call
    cpu_started: float = 0.0  # process CPU time when it started
    layers: Any = None  # the LayerCapture hooked for this step's forward (`layers=True`)
    # -- an event-armed step not captured in advance --
    mark: StepMark | None = None
    output: Any = None  # the forward's output (a reference: the runner's until the next forward)
    # the sampling logits, copied on the device (sampling changes them in place) where the
    # non-finite check is not known finite when they are computed
    logits: Any = None
    finite: DeviceFlag | None = None  # whether the step's hidden states and logits are finite
    finite_confirmed: bool | None = None  # its answer, once read
    copies: list[HostCopy] = dataclasses.field(default_factory=list)  # the step's copies to host


def _engine_boundary(method: Callable) -> Callable:
    """Run a recorder callback the engine makes; any failure in it disarms the recorder
    instead of reaching the engine."""

    @functools.wraps(method)
    def guarded(self: "Recorder", *args: Any) -> Any:
        if self._shadows is None:
            return None
        try:
            return method(self, *args)
        except Exception as error:
            self._give_up(f"{method.__name__.strip('_')}: {type(error).__name__}: {error}")
            return None

    return guarded


class Recorder:
    """Records the steps its triggers pick from the runner it is armed on."""

    def __init__(
        self,
        runner: Any,
        output: str | Path,
        triggers: TriggerSet,
        kv: str = "read",
        max_bundles: int = DEFAULT_MAX_BUNDLES,
        layers: bool = False,
        set_id: str | None = None,
    ):
        if kv not in KV_MODES:
            raise UsageError(f"bad --kv {kv!r}: choose one of {', '.join(KV_MODES)}")
        self.runner = runner
        try:
            self.adapter: RunnerAdapter | None = installed_release().adapter_for(runner)
            self._adapter_error: Exception | None = None
        except Exception as error:  # arming says why, and the engine runs on unrecorded
            self.adapter, self._adapter_error = None, error
        self.rank = ranks.rank_of(runner, set_id)
        ranks.require_recordable(self.rank)
        self.output = OutputTemplate(output, self.rank.world_size)
        self.triggers = triggers
        self.kv = kv
        if layers and self.adapter is not None and self.adapter.compiled:
            raise UsageError("--layers records per-layer outputs only from an eager engine: add --enforce-eager")
        self.layers = layers  # also store every layer's output of a recorded step (eager engines)
        if max_bundles < 1:
            raise UsageError(f"bad --max-bundles {max_bundles}: must be at least 1")
        self.max_bundles = 1 if self.output.single else max_bundles
        self.steps_seen = 0
        self._head_start_us = DEFAULT_HEAD_START_US
        self.sizes_seen: set[int] = set()  # padded token counts of the forwards seen since arming
        self.bundles_fired = 0
        self._pending: _PendingStep | None = None
        self._persister: BackgroundPersister | None = None
        self._shadows: Any = None
        self._failures: list[str] = []
        self._backend: Any = None  # the runner's DeviceBackend, once armed
        self._deferred = 0  # steps whose non-finite check is read with their output, later
        self._preempted: frozenset[str] = frozenset()  # requests preempted since such a step
        self._sampled: SampledIds | None = None  # where the runner keeps no sampled ids, once armed

    @property
    def written(self) -> list[Path]:
        return self._persister.written if self._persister else []

    @property
    def failures(self) -> list[str]:
        """Why recording stopped or a bundle was not written, oldest first."""
        return self._failures + (self._persister.failures if self._persister else [])

    @property
    def armed(self) -> bool:
        return self._shadows is not None

    @property
    def exhausted(self) -> bool:
        return self.bundles_fired >= self.max_bundles

    @property
    def tracking(self) -> bool:
        pending = self._pending
        # (every step's sampled ids are read where the recorder keeps them: `SampledIds`)
        return pending is not None and (pending.step is not None or pending.mark is not None or self._sampled is not None)

    def arm(self) -> "Recorder":
        """Shadow the runner's methods. A runner the recorder cannot arm on is logged and left
        alone (see `failures`); the engine runs on unrecorded."""
        try:
            if self.adapter is None:
                raise self._adapter_error
            self._persister = BackgroundPersister(self.adapter.environment(), self.adapter.engine_config())
            self._backend = self.adapter.device_backend
            self._sampled = None if self.adapter.sampled_ids_kept() else SampledIds()
            shadows = self.adapter.observe(self)
            shadows.__enter__()
            self._shadows = shadows
        except Exception as error:
            self._give_up(f"cannot arm on this runner: {type(error).__name__}: {error}")
        return self

    def disarm(self) -> None:
        shadows, self._shadows = self._shadows, None
        _stop_layers(self._pending)
        self._pending = None
        if shadows is not None:
            shadows.__exit__(None, None, None)
        if self._persister is not None:
            self._persister.close()

    def __enter__(self) -> "Recorder":
        return self.arm()

    def __exit__(self, *exc_info: Any) -> None:
        self.disarm()

    def _give_up(self, reason: str, logged: bool = False) -> None:
        """Log once, stop recording, leave the engine as if never armed."""
        if not logged:
            self._failures.append(reason)
            logger.error("tracekit: recording stopped, the engine goes on unrecorded: %s", reason)
        _stop_layers(self._pending)
        shadows, self._shadows, self._pending = self._shadows, None, None
        if shadows is not None:
            try:
                shadows.__exit__(None, None, None)
            except Exception as error:  # pragma: no cover - removing instance attributes
                logger.error("tracekit: could not remove the runner shadows: %s", error)

    # -- StepObserver: the adapter calls these from inside the engine's step -------------------

    @_engine_boundary
    def step_started(self, scheduler_output: Any) -> None:
        if self._persister.failures:  # a write failed on the writer thread: stop here, once
            self._give_up(self._persister.failures[0], logged=True)
            return
        self.adapter.scheduler_output_seen(scheduler_output)
        if self._deferred:  # a step whose check is read later: its KV blocks stay its own unless preempted
            self._preempted |= self.adapter.preempted(scheduler_output)
        if self.exhausted:
            self._pending = None
            return
        if self._sampled is not None:
            self._sampled.keep_only(self.adapter.live_req_ids())
            self._sampled.started(self.adapter.new_req_ids(scheduler_output))
        self._pending = _PendingStep(self.steps_seen, scheduler_output, time.perf_counter())
        self.steps_seen += 1

    @_engine_boundary
    def before_forward(self, input_ids: Any, positions: Any) -> None:
        pending = self._pending
        if pending is None or pending.forward_seen:
            return
        pending.forward_seen = True
        pending.phase = Phase.FORWARD
        size = int(input_ids.shape[0]) if input_ids is not None else None
        first_of_its_size = size not in self.sizes_seen
        self.sizes_seen.add(size)
        pending.reason = self.triggers.fires_before_forward(
            pending.index, lambda: self.adapter.batch_facts(pending.scheduler_output)
        )
        if pending.reason is None:
            if self.triggers.events:  # kept cheaply, copied only if the step fails
                pending.mark = self.adapter.mark(pending.scheduler_output, input_ids, positions)
            return
        copy = self._new_copy(pending)
        pending.step = step_capture.capture(
            self.adapter, self.adapter.mark(pending.scheduler_output, input_ids, positions), pending.index,
            pending.reason, self.kv, copy,
        )
        copy.finish()  # the forward, which writes KV, runs after the copy
        pending.step.timing.first_of_its_size = first_of_its_size
        if self.layers:
            pending.layers = layer_capture.LayerCapture(self.adapter.model).__enter__()
        pending.cpu_started = time.process_time()
        pending.forward_timer = RegionTimer(self.adapter.device_backend, self._head_start_us)

    @_engine_boundary
    def after_forward(self, hidden_states: Any) -> None:
        pending = self._pending
        if pending is not None and pending.mark is not None:
            pending.output, pending.phase = hidden_states, Phase.LOGITS
            return
        if pending is None or pending.step is None or pending.forward_timer is None:
            return
        timer, pending.forward_timer = pending.forward_timer, None
        measured = timer.stop()
        pending.step.timing.forward_us, pending.step.timing.forward_timer = measured.us, measured.timer
        pending.step.timing.forward_cpu_us = (time.process_time() - pending.cpu_started) * 1e6
        # The next recorded forward's head start covers twice this one's host issue.
        self._head_start_us = min(max(2 * measured.host_us, DEFAULT_HEAD_START_US), MAX_HEAD_START_US)
        layers = _stop_layers(pending)
        copy = self._new_copy(pending)
        step_capture.capture_after_forward(self.adapter, pending.step, hidden_states, copy)
        copy.finish()  # before the next forward writes the blocks (async outputs are read later)
        if layers is not None and layers.failure is None:
            pending.step.outputs.layers = layers.outputs
        pending.phase = Phase.LOGITS

    @_engine_boundary
    def logits_computed(self, logits: Any) -> None:
        pending = self._pending
        if pending is None:
            return
        pending.phase = Phase.SAMPLING
        if pending.mark is not None:
            if TriggerEvent.NONFINITE not in self.triggers.events:
                return
            flag = DeviceFlag(all_finite(self._outputs_checked(pending, logits)), self._backend)
            if flag.ready() and self._finite(pending, flag, logits):  # known at once (CPU): nothing to keep
                return
            pending.finite = flag  # else read at the step's end, without a sync of its own
            # A copy on the device: sampling changes the logits in place (temperature, penalties)
            pending.logits = _device_clone(logits)
        elif pending.step is not None:
            copy = self._new_copy(pending)
            step_capture.capture_logits(pending.step, logits, copy)
            copy.finish()

    @_engine_boundary
    def phase_entered(self, phase: Phase) -> None:
        if self._pending is not None:
            self._pending.phase = phase

    def output_receiver(self) -> Callable[[list[list[int]] | None], None]:
        receiver = self._step_receiver()
        batch_order = self._batch_order_for_sampled_ids()
        if batch_order is None:
            return receiver

        @_engine_boundary
        def keep_sampled(self: "Recorder", sampled: Any) -> None:
            if sampled is not None:
                self._sampled.received(batch_order, sampled)

        def receive(sampled: Any) -> None:
            keep_sampled(self, sampled)
            receiver(sampled)

        return receive

    @_engine_boundary
    def _batch_order_for_sampled_ids(self) -> list[str] | None:
        return self.adapter.batch_order_after_execute() if self._sampled is not None else None

    def _step_receiver(self) -> Callable[[list[list[int]] | None], None]:
        pending, self._pending = self._pending, None
        if pending is not None and pending.mark is not None:
            return self._nonfinite_receiver(pending)
        if pending is None or pending.step is None:
            return _ignore
        return lambda sampled: self._finish(pending, sampled)

    @_engine_boundary
    def step_failed(self, error: BaseException) -> None:
        pending, self._pending = self._pending, None
        _stop_layers(pending)
        if pending is None:
            return
        if pending.reason is None and TriggerEvent.EXCEPTION not in self.triggers.events:
            return
        if pending.step is None and self.exhausted:
            return
        trigger = pending.reason or TriggerEvent.EXCEPTION.value
        step = pending.step
        if step is None:
            # The forward reads the KV blocks a failure leaves intact: copied now. A step that
            # failed before its forward is marked here; what the failure kept from being
            # prepared (the input ids) the replay prepares again.
            mark = pending.mark or self.adapter.mark(pending.scheduler_output, None, None)
            step = self._capture_failed(pending, mark, trigger, error)
        step.trigger = trigger
        step.timing.step_us = (time.perf_counter() - pending.started) * 1e6
        step.error = {
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error)),
            "phase": Phase(pending.phase).value,
        }
        self._count_bundle()
        _copies_landed(step, pending.copies)
        self._persister.write_now(*self._destination(self._completed(step)))

    def _capture_failed(self, pending: _PendingStep, mark: StepMark, trigger: str, error: BaseException) -> Step:
        """The failed step from its mark: from the live cache and runner, or, where the failure
        lost the device context, from host memory alone (a `--kv recompute` bundle)."""
        if context_lost(error):
            logger.warning("tracekit: the device context is lost (%s); the step is kept from host memory, "
                           "its KV to be recomputed by the replay", type(error).__name__)
            return step_capture.capture_without_device(self.adapter, mark, pending.index, trigger)
        taken = step_capture.KVTaken.BEFORE_FORWARD if pending.mark is None else step_capture.KVTaken.AFTER_STEP
        return self._capture_marked(pending, mark, trigger, KVMode(self.kv), taken)

    def _nonfinite_receiver(self, pending: _PendingStep) -> Callable[[list[list[int]] | None], None]:
        """At the end of an event-armed step: whether its outputs were finite. Read now when the
        device has passed the check (it has when the runner synced the sampled ids: V1 without
        async scheduling, and always on CPU); else the check is read with the sampled ids, and
        the step's inputs and outputs are kept on the device until then."""
        if pending.finite is None or self.exhausted:
            return _ignore
        if pending.finite.ready():
            if self._finite(pending, pending.finite, pending.logits):
                return _ignore
            step = self._capture_nonfinite(pending, pending.mark, KVMode(self.kv))
            return lambda sampled: self._finish(pending, sampled, step)
        mark = pending.mark
        kept = dataclasses.replace(mark, input_ids=_device_clone(mark.input_ids), positions=_device_clone(mark.positions))
        pending.output = _device_clone(hidden_states_of(pending.output))

        self._deferred += 1

        @_engine_boundary
        def receive(self: "Recorder", sampled: Any) -> None:
            self._deferred -= 1
            preempted = self._preempted
            if not self._deferred:
                self._preempted = frozenset()
            if self._finite(pending, pending.finite, pending.logits) or self.exhausted:
                return
            # The next step has been scheduled (and maybe run): it wrote only its own new slots,
            # unless the scheduler preempted a request of this step and gave its blocks to another.
            kv = KVMode(self.kv)
            if preempted & set(self.adapter.marked_req_ids(kept)):
                kv = KVMode.RECOMPUTE
            step = self._capture_nonfinite(pending, kept, kv)
            self._finish(pending, sampled, step)

        return lambda sampled: receive(self, sampled)

    def _finite(self, pending: _PendingStep, flag: DeviceFlag, logits: Any) -> bool:
        """The check's answer; a "not finite" from the cheap check is confirmed element by element
        (once: the answer is kept)."""
        if pending.finite_confirmed is None:
            pending.finite_confirmed = flag.value() or bool(all_finite(self._outputs_checked(pending, logits), exact=True))
        return pending.finite_confirmed

    def _capture_nonfinite(self, pending: _PendingStep, mark: StepMark, kv: KVMode) -> Step:
        """The step whose outputs proved not finite, counted now: under async scheduling its
        bundle is written when its sampled ids are read, after later steps have been checked."""
        step = self._capture_marked(pending, mark, TriggerEvent.NONFINITE.value, kv, step_capture.KVTaken.AFTER_STEP)
        step.outputs.finite = False
        self._count_bundle()
        return step

    def _capture_marked(self, pending: _PendingStep, mark: StepMark, trigger: str, kv: KVMode,
                        taken: step_capture.KVTaken) -> Step:
        """An event-triggered step from its mark, with the forward's outputs where it got that far."""
        copy = self._new_copy(pending)
        step = step_capture.capture(self.adapter, mark, pending.index, trigger, kv.value, copy, taken)
        if pending.output is not None:
            step_capture.capture_after_forward(self.adapter, step, pending.output, copy)
            step_capture.capture_logits(step, pending.logits, copy)
        copy.finish()  # the engine's stream goes on once the copies ran, its host at once
        return step

    def _outputs_checked(self, pending: _PendingStep, logits: Any) -> list[Any]:
        """The outputs the non-finite check reads: the real rows of the hidden states (padding
        rows of a graph step are not the step's), and the logits."""
        hidden = hidden_states_of(pending.output)
        real = self.adapter.num_scheduled_tokens(pending.scheduler_output)
        return [hidden[:real] if hidden is not None else None, logits]

    def _new_copy(self, pending: _PendingStep) -> HostCopy:
        """A batch of copies to host for this step, through pinned memory on a side stream
        where the device has one; the step's bundle is written once they landed. The caller
        finishes it in the same callback, so the engine's later work waits for the copies."""
        copy = HostCopy(self._backend)
        pending.copies.append(copy)
        return copy

    # -- firing ------------------------------------------------------------------------------

    @_engine_boundary
    def _finish(self, pending: _PendingStep, sampled: Any, fired: Step | None = None) -> None:
        """The step's sampled ids are in: write its bundle if a trigger fired (`fired`: the
        non-finite check already did)."""
        step = fired or pending.step
        step_capture.capture_sampled(step, sampled)
        step.timing.step_us = (time.perf_counter() - pending.started) * 1e6
        for copy in pending.copies:
            copy.finish()
        reason = pending.reason or (TriggerEvent.NONFINITE.value if fired is not None else None)
        if fired is None:
            for copy in pending.copies:  # the finite check below reads the copies
                copy.wait()
            finite = step_capture.outputs_finite(step)
            if reason is None and not finite and TriggerEvent.NONFINITE in self.triggers.events:
                reason = TriggerEvent.NONFINITE.value
        if reason is None:
            return
        step.trigger = reason
        if fired is None:  # a non-finite step was counted when it was captured
            self._count_bundle()
        copies = list(pending.copies)
        self._persister.submit(*self._destination(self._completed(step)), ready=lambda: _copies_landed(step, copies))

    def _count_bundle(self) -> None:
        self.bundles_fired += 1
        if self.exhausted and not self.output.single:
            logger.warning(
                "tracekit: recorded %d bundles, the most this session takes (--max-bundles); "
                "later steps are not recorded", self.max_bundles,
            )

    def _completed(self, step: Step) -> Step:
        """The step as its bundle is written. One whose KV is to be recomputed gets the sampled
        ids the recorder kept where the runner holds placeholders (its replay prefills them); a
        bundle with its KV keeps the request states as the runner held them, placeholders too, for
        its replay to put back as they were; a warning where a recompute replay still lacks tokens."""
        if self._sampled is not None and step.kv.mode == KVMode.RECOMPUTE.value:
            self._sampled.fill(step.requests)
        _warn_if_not_recomputable(step)
        return step

    def _destination(self, step: Step) -> tuple[Path, Step, ParallelRank]:
        """This rank's bundle of the step, and the rank fields that tie it to the other ranks'."""
        path = self.output.path_for(step.index, self.rank.rank)
        parts = [
            os.path.relpath(self.output.path_for(step.index, rank), path.parent)
            for rank in range(self.rank.world_size)
        ] if self.rank.multi_rank else []
        return path, step, dataclasses.replace(self.rank, parts=parts)


def _warn_if_not_recomputable(step: Step) -> None:
    """Say so when a step is written with its KV to be recomputed but without the tokens that takes."""
    if step.kv.mode == KVMode.RECOMPUTE.value and (unknown := unknown_tokens_to_recompute(step)):
        logger.warning("tracekit: step %d is kept with its KV to be recomputed, but %d of the token ids its replay "
                       "would prefill are placeholders in the runner (V1 under async scheduling) that the recorder did "
                       "not see sampled (requests that started before it was armed): that replay will be refused",
                       step.index, unknown)


def _copies_landed(step: Step, copies: list[HostCopy]) -> None:
    """Wait for the step's copies to host; note how long they held the device's side stream."""
    for copy in copies:
        copy.wait()
    held = [copy.device_us for copy in copies if copy.device_us is not None]
    if held:
        step.timing.device_copy_us = sum(held)


def _ignore(sampled: Any) -> None:
    """The output receiver of a step that is not recorded."""


def _device_clone(tensor: Any) -> Any:
    """A copy on the tensor's own device (queued, no host sync), or None."""
    return tensor.detach().clone() if tensor is not None else None


def _stop_layers(pending: _PendingStep | None) -> Any:
    """Remove the step's layer hooks, if any; returns the capture."""
    layers = pending.layers if pending is not None else None
    if layers is not None:
        pending.layers = None
        layers.__exit__(None, None, None)
    return layers
