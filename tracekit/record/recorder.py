"""The recorder armed on one live model runner.

Arming asks the runner's adapter (`tracekit.integrations.vllm.runners.runner_adapter`) to shadow
that runner's methods; the adapter reports each step's progress back (`StepObserver`), and
disarming removes the shadows. The recorder picks each step's capture kind (`capture_kinds`) and
hands the step's events to it; it keeps what all kinds share: the step's place and phase, the
bundle count, and the writing. It runs inside other people's engines: what goes wrong in it is
caught where the engine calls into it and disarms it (`guarded`), but for a device context the
step poisoned (`_device_lost`; docs/GUIDE.md, "When recording fails" and "Always-on").
"""

import dataclasses
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tracekit.errors import UsageError, one_line
from tracekit.format.schema import KVMode, ParallelRank, Step
from tracekit.graphs.host_copy import HostCopy, context_lost
from tracekit.graphs.timing import DEFAULT_HEAD_START_US
from tracekit.integrations.seam import OutputReceiver, Phase
from tracekit.integrations.vllm.recording import (
    AdapterFiles,
    RunnerAdapter,
    installed_release,
    rank_of,
    require_recordable,
    unknown_tokens_to_recompute,
)
from tracekit.record.capture_kinds import (
    NOTHING,
    CopiedStep,
    MarkedStep,
    OpenBundle,
    PendingStep,
    StepCapture,
    ignore,
    note_failure,
)
from tracekit.record.persist import BackgroundPersister, OutputTemplate
from tracekit.record.sampled_ids import SampledIds
from tracekit.record.settings import RecordSettings, bundles
from tracekit.record.step_capture import KVTaken
from tracekit.record.triggers import CLI_NAMES, RequestWatch, SettingNames, TriggerEvent

logger = logging.getLogger("tracekit.record")


def _engine_boundary(method: Callable) -> Callable:
    """A recorder method the engine calls, `guarded`."""

    @functools.wraps(method)
    def guarded(self: "Recorder", *args: Any) -> Any:
        return self.guarded(functools.partial(method, self), method.__name__)(*args)

    return guarded


def _to_capture(event: str) -> Callable:
    """A `StepObserver` event handed as it is to the step's capture, `guarded`."""

    def hand(self: "Recorder", *args: Any) -> None:
        getattr(_capture_of(self._pending), event)(*args)

    hand.__name__ = hand.__qualname__ = event
    return _engine_boundary(hand)


class Recorder:
    """Records the steps its triggers pick from the runner it is armed on."""

    def __init__(
        self,
        runner: Any,
        output: str | Path,
        settings: RecordSettings,
        set_id: str | None = None,
        names: SettingNames = CLI_NAMES,
    ):
        self.triggers = triggers = settings.check(names)
        self.names = names  # how the user spelled the settings, for the messages that name one
        self.runner = runner
        try:
            self.adapter: RunnerAdapter | None = installed_release().adapter_for(runner)
            self._adapter_error: Exception | None = None
        except Exception as error:  # arming says why, and the engine runs on unrecorded
            self.adapter, self._adapter_error = None, error
        self.rank = rank_of(runner, set_id)
        require_recordable(self.rank)
        self.output = OutputTemplate(output, self.rank.world_size)
        if settings.layers and self.adapter is not None and self.adapter.compiled:
            raise UsageError("--layers records per-layer outputs only from an eager engine: add --enforce-eager")
        self.settings = settings
        self.max_bundles = 1 if self.output.single else settings.max_bundles
        self._open: OpenBundle | None = None  # the bundle taking the next steps, if one is
        # the LoRA adapters' files, read on the writer thread (kept up to a size, or always)
        self._adapter_files = AdapterFiles(keep_always=settings.keep_lora_weights)
        self.steps_seen = 0
        self.head_start_us = DEFAULT_HEAD_START_US  # of the next recorded forward's timer
        self.sizes_seen: set[int] = set()  # padded token counts of the forwards seen since arming
        self.bundles_fired = 0
        self._handed = 0  # bundles handed to the writer (the recorder stops once all it takes are)
        self.stopped: str | None = None  # why it stopped recording by itself, if it did
        # the engine requests a `request==ID` trigger names
        self._watch = (RequestWatch(self.adapter.client_request_matcher(triggers.request))
                       if triggers.request is not None and self.adapter is not None else None)
        self._pending: PendingStep | None = None
        self._persister: BackgroundPersister | None = None
        self._shadows: Any = None
        self._failures: list[str] = []
        self._context_lost_seen = False  # a callback met a poisoned device context (said once)
        self.backend: Any = None  # the runner's DeviceBackend, once armed
        self._deferred = 0  # steps whose non-finite check is read with their output, later
        self._preempted: frozenset[str] = frozenset()  # requests preempted since such a step
        self._sampled: SampledIds | None = None  # where the runner keeps no sampled ids, once armed
        # Held by each engine callback and by giving up: a failure on the writer thread disarms
        # the recorder between two callbacks (re-entrant: a callback may give up itself).
        self._callback_lock = threading.RLock()

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
        return pending is not None and (pending.capture is not None or self._sampled is not None)

    def arm(self) -> "Recorder":
        """Shadow the runner's methods. A runner the recorder cannot arm on is logged and left
        alone (see `failures`); the engine runs on unrecorded."""
        try:
            if self.adapter is None:
                raise self._adapter_error
            # A bundle the writer could not write, or its death (it logged why), stops the recorder at once,
            # between two of the engine's calls into it (on the writer's thread, or the engine's for a failed step).
            self._persister = BackgroundPersister(self.adapter.environment(), self.adapter.engine_config(),
                                                  on_failure=lambda reason: self._stop_observing())
            self.backend = self.adapter.device_backend
            self._sampled = None if self.adapter.sampled_ids_kept() else SampledIds()
            shadows = self.adapter.observe(self)
            shadows.__enter__()
            self._shadows = shadows
            if kinds := self.adapter.kinds_not_replayable():  # said once, at arming
                logger.warning("tracekit: steps with %s can be recorded but not yet replayed by this tracekit "
                               "(their replay ends with the verdict cannot_replay_yet, exit 5)", " or ".join(kinds))
        except Exception as error:
            self._give_up(f"cannot arm on this runner: {type(error).__name__}: {error}")
        return self

    def disarm(self, wait: bool = True) -> None:
        """Stop recording; the bundles already taken are written, and waited for unless `wait`
        is false (a live server's engine thread: the writer thread finishes them on its own)."""
        bundle = self._open
        self._stop_observing()
        if bundle is not None and self._persister is not None:
            bundle.stop_taking()  # written if its steps' outputs are in
        if self._persister is not None:
            if wait:
                self._persister.close()
            else:
                threading.Thread(target=self._persister.close, name="tracekit-closer", daemon=True).start()

    def __enter__(self) -> "Recorder":
        return self.arm()

    def __exit__(self, *exc_info: Any) -> None:
        self.disarm()

    def wait_for_writes(self) -> None:
        """Until every bundle submitted so far is written (or failed: then the recorder has
        disarmed itself)."""
        if self._persister is not None:
            self._persister.wait_idle()

    def _give_up(self, reason: str) -> None:
        """Log once, stop recording, leave the engine as if never armed."""
        with self._callback_lock:
            self._failures.append(reason)
            logger.error("tracekit: recording stopped, the engine goes on unrecorded: %s", reason)
            self._stop_observing()

    def _stop_observing(self) -> None:
        """Remove the runner shadows: the engine runs exactly as without tracekit from its next call
        on; the writer thread goes on writing what it was handed."""
        with self._callback_lock:
            _capture_of(self._pending).stop()
            shadows, self._shadows, self._pending, self._open = self._shadows, None, None, None
            if shadows is not None:
                try:
                    shadows.__exit__(None, None, None)
                except Exception as error:  # pragma: no cover - removing instance attributes
                    logger.error("tracekit: could not remove the runner shadows: %s", error)

    def _device_lost(self, name: str, error: BaseException) -> None:
        """A callback met a device context poisoned by the step (a device-side assert, an
        illegal address), before the engine's own next device call does: the recorder stays
        armed, for `step_failed` to keep that step from host memory."""
        if not self._context_lost_seen:
            self._context_lost_seen = True
            logger.warning("tracekit: the device context is lost (%s in %s); waiting for the step's failure to "
                           "keep it", one_line(error), name)

    # -- StepObserver: the adapter calls these from inside the engine's step -------------------

    @_engine_boundary
    def step_started(self, scheduler_output: Any) -> None:
        self.adapter.scheduler_output_seen(scheduler_output)
        if self._deferred:  # a step whose check is read later: its KV blocks stay its own unless preempted
            self._preempted |= self.adapter.preempted(scheduler_output)
        if self.exhausted and self._open is None:
            self._pending = None
            self._stop_once_all_handed()
            return
        if self._sampled is not None:
            self._sampled.keep_only(self.adapter.live_req_ids())
            self._sampled.started(self.adapter.new_req_ids(scheduler_output))
        self._pending = PendingStep(self.steps_seen, scheduler_output, time.perf_counter())
        self.steps_seen += 1
        if self._open is not None:  # the open bundle's next step, whatever the bundle count
            self._pending.capture = self._open.take(self._pending)
            self._open = self._open if self._open.taking else None

    @_engine_boundary
    def before_forward(self, input_ids: Any, positions: Any) -> None:
        pending = self._pending
        if pending is None or pending.phase != Phase.PREPARE:  # a later model call of the step
            return
        pending.phase = Phase.FORWARD
        if pending.capture is not None:  # picked when the step started (an open bundle's next step)
            pending.capture.before_forward(input_ids, positions)
            return
        size = int(input_ids.shape[0]) if input_ids is not None else None
        first_of_its_size = size not in self.sizes_seen
        self.sizes_seen.add(size)
        pending.reason = self.triggers.fires_before_forward(
            pending.index, lambda: self.adapter.batch_facts(pending.scheduler_output),
            lambda: self._requests_named(pending.scheduler_output),
        )
        if pending.reason is not None:  # opens a bundle of `window` steps
            mark = self.adapter.mark(pending.scheduler_output, input_ids, positions)
            pending.capture = copied = CopiedStep(self, pending, mark, first_of_its_size)
            self._open = copied.bundle if copied.bundle.taking else None
        elif self.triggers.events:  # kept cheaply, copied only if the step fails
            pending.capture = MarkedStep(self, pending, self.adapter.mark(pending.scheduler_output, input_ids, positions))

    def _requests_named(self, scheduler_output: Any) -> list[Any]:
        """The progress of each request of the step that the trigger's `request==ID` names."""
        named = self._watch.named(self.adapter.scheduled_req_ids(scheduler_output))
        return self.adapter.request_progress(scheduler_output, named) if named else []

    # the events the step's capture alone takes
    after_forward = _to_capture("after_forward")
    drafter_called = _to_capture("drafter_called")
    drafts_proposed = _to_capture("drafts_proposed")
    grammar_received = _to_capture("grammar_received")
    grammar_applied = _to_capture("grammar_applied")
    sampling = _to_capture("sampling")

    @_engine_boundary
    def logits_computed(self, logits: Any) -> None:
        if self._pending is not None:
            self._pending.phase = Phase.SAMPLING
        _capture_of(self._pending).logits_computed(logits)

    @_engine_boundary
    def phase_entered(self, phase: Phase) -> None:
        if self._pending is not None:
            self._pending.phase = phase

    @_engine_boundary
    def idle_step(self, scheduler_output: Any) -> None:
        """A scheduler output without tokens finishes requests between steps: an open bundle
        ends before it (its replay runs steps)."""
        bundle, self._open = self._open, None
        if bundle is not None:
            bundle.stop_taking()

    def output_receiver(self) -> OutputReceiver:
        pending, self._pending = self._pending, None
        return OutputReceiver(self._receiver_of(pending) or ignore, functools.partial(self._output_failed, pending))

    @_engine_boundary
    def _receiver_of(self, pending: PendingStep | None) -> Callable[[list[list[int]] | None], None] | None:
        """What takes the step's sampled ids (None: nothing; also where building it failed): its
        capture's receiver, after `SampledIds` where the recorder keeps them."""
        receiver = _capture_of(pending).receiver()
        if self._sampled is None:
            return receiver
        batch_order = self.adapter.batch_order_after_execute()

        def receive(sampled: Any) -> None:
            if sampled is not None:
                self.guarded(self._sampled.received, "keep_sampled")(batch_order, sampled)
            receiver(sampled)

        return receive

    @_engine_boundary
    def step_failed(self, error: BaseException) -> None:
        pending, self._pending = self._pending, None
        self._keep_failed(pending, error)

    @_engine_boundary
    def _output_failed(self, pending: PendingStep | None, error: BaseException) -> None:
        """Reading a step's output raised: under async scheduling a device fault of the step
        surfaces there, after the next step may have started (the step is kept as if it had
        failed in `sample_tokens`, in the phase `Phase.OUTPUT`)."""
        if pending is not None:
            pending.phase = Phase.OUTPUT
        self._keep_failed(pending, error)

    def _keep_failed(self, pending: PendingStep | None, error: BaseException) -> None:
        """Keep a step that failed, as its trigger or `--on exception` asks."""
        _capture_of(pending).stop()
        if pending is None:
            return
        # A failure ends the open bundle: with a later step, written now with the failure on it;
        # with its first, that step is written as a single step with its failure.
        self._open = None
        if pending.reason is None and TriggerEvent.EXCEPTION not in self.triggers.events:
            return
        trigger = pending.reason or TriggerEvent.EXCEPTION.value
        capture = pending.capture or MarkedStep(self, pending, None, KVTaken.BEFORE_FORWARD)
        step = capture.failed(trigger, error)
        if step is None:
            return
        step.trigger = trigger
        note_failure(step, pending, error)
        self.count_bundle()
        # (a lost context's copies never land: the step is kept from host memory)
        self.write(step, [] if context_lost(error) else pending.copies, now=True)

    # -- what the capture kinds share ----------------------------------------------------------

    def guarded(self, function: Callable, name: str | None = None) -> Callable:
        """`function`, called back by the engine: while disarmed it does nothing, and any failure
        in it disarms the recorder instead of reaching the engine."""
        name = (name or function.__name__).strip("_")

        def call(*args: Any) -> Any:
            with self._callback_lock:  # the writer thread gives up between callbacks, never inside one
                if self._shadows is None:
                    return None
                try:
                    return function(*args)
                except Exception as error:
                    if context_lost(error):
                        self._device_lost(name, error)
                    else:
                        self._give_up(f"{name}: {type(error).__name__}: {error}")
                    return None

        return call

    def write(self, step: Step, copies: list[HostCopy], now: bool = False) -> None:
        """Write the bundle of `step` and the steps recorded after it once their copies landed (and
        its LoRA adapters' files are read): on the writer thread, or `now` (a step failed: the
        engine may go down)."""
        copies = list(copies)

        def ready() -> None:  # on the writer thread, unless now
            for copy in copies:
                copy.wait()
            held = [copy.device_us for copy in copies if copy.device_us is not None]  # on the device's side stream
            if held:
                step.timing.device_copy_us = sum(held)
            self._adapter_files.complete(step)

        self._persister.submit(*self._destination(self._completed(step)), ready=ready, now=now)
        self._handed += 1
        self._stop_once_all_handed()

    def deferral_started(self) -> None:
        """A step's non-finite check is to be read with its output, after later steps started."""
        self._deferred += 1

    def deferral_ended(self) -> frozenset[str]:
        """That check is read now: the requests preempted since the oldest deferred check."""
        self._deferred -= 1
        preempted = self._preempted
        if not self._deferred:
            self._preempted = frozenset()
        return preempted

    def count_bundle(self) -> None:
        self.bundles_fired += 1

    def _stop_once_all_handed(self) -> None:
        """Once every bundle the recorder takes went to the writer, it stops observing the runner
        (the engine then runs exactly as without tracekit), saying so."""
        if not self.exhausted or self._handed < self.bundles_fired or self._open is not None:
            return
        if self.output.single:
            self.stopped = f"took the one step its path takes ({self.output.template} has no {{step}})"
        else:
            self.stopped = f"took {bundles(self.max_bundles)}, the most it takes ({self.names.max_bundles} {self.max_bundles})"
        logger.warning("tracekit: the recorder %s; it stopped recording, the engine runs as without tracekit",
                       self.stopped)
        self._stop_observing()

    def _completed(self, step: Step) -> Step:
        """The step as its bundle is written. One whose KV is to be recomputed gets the sampled
        ids the recorder kept where the runner holds placeholders (its replay prefills them); a
        bundle with its KV keeps the request states as the runner held them, placeholders too, for
        its replay to put back as they were. A warning where a recompute replay still lacks tokens."""
        if step.kv.mode != KVMode.RECOMPUTE.value:
            return step
        if self._sampled is not None:
            self._sampled.fill(step.requests)
        if unknown := unknown_tokens_to_recompute(step):
            logger.warning("tracekit: step %d is kept with its KV to be recomputed, but %d of the token ids its "
                           "replay would prefill are placeholders in the runner (V1 under async scheduling) that the "
                           "recorder did not see sampled (requests that started before it was armed): that replay "
                           "will be refused", step.index, unknown)
        return step

    def _destination(self, step: Step) -> tuple[Path, Step, ParallelRank]:
        """This rank's bundle of the step, and the rank fields that tie it to the other ranks'."""
        path = self.output.path_for(step.index, self.rank.rank)
        parts = [
            os.path.relpath(self.output.path_for(step.index, rank), path.parent)
            for rank in range(self.rank.world_size)
        ] if self.rank.multi_rank else []
        return path, step, dataclasses.replace(self.rank, parts=parts)


def _capture_of(pending: PendingStep | None) -> StepCapture:
    """The step's capture (`NOTHING` where none is)."""
    return pending.capture if pending is not None and pending.capture is not None else NOTHING
