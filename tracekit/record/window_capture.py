"""Recording the sequence of N >= 1 consecutive steps a firing step opens (`tracekit record
--window N`, issue 32; a single step is N = 1).

The bugs that live between steps — in what the model runner carries from one step to the next:
its persistent batch, the sampled ids it keeps on the device under async scheduling, drafts,
Model Runner V2's request slots — need the steps that carried it. When a step trigger fires,
that step is copied whole (`CopiedStep`) and an `OpenWindow` opens on it: each of the next N-1
steps is a `CarriedStepCapture`, which keeps only what the
engine handed the runner and what came out — the scheduler output as the runner received it,
the grammar mask, the batch order, what the runner kind keeps per request, the inputs, the
dispatch, the RNG states and the outputs — no request states and no KV blocks. The window also
keeps the requests the runner held outside the first step's batch and the order of the runner
calls (under async scheduling the engine reads a step's output after the next step started).

The steps are written as one bundle, the first step's, once every step's output is in: when
they are N (at once for N = 1), or earlier when the engine sends a scheduler output without tokens (it finishes
requests between steps), a later step fails (written at once, with the failure on that step) or
the recorder is disarmed.
"""

import time
from typing import Any, Callable

from tracekit.format.schema import CarriedStep, GrammarRecord, RequestState, RunnerCall, SchedulerOutputRecord, Step
from tracekit.graphs.host_copy import HostCopy
from tracekit.integrations.seam import Phase
from tracekit.integrations.vllm.recording import RequestLedger, StepMark, digested_layers, kv_written
from tracekit.record import step_capture
from tracekit.record.capture_kinds import ForwardTimer, PendingStep, Receiver, Recording, StepCapture


class OpenWindow:
    """The steps a firing step opens being recorded: its first step, the later steps as they
    come, the runner calls."""

    def __init__(self, recorder: Recording, first: PendingStep, requested: int, held: list[RequestState],
                 first_step: Step):
        self.recorder = recorder
        self.first_index = first.index
        self.requested = requested
        self.held = held
        self.first_step = first_step  # as copied before its forward
        self.ledger: RequestLedger | None = None  # from the first later step on (`_follow`)
        self.calls: list[dict[str, Any]] = [{"call": RunnerCall.EXECUTE.value, "step": first.index}]
        self.first: Step | None = None  # once its sampled ids are in
        self.carried: list[CarriedStep] = []  # in step order, from their forwards on
        self.started = 0  # later steps taken so far
        self.finished = 0  # later steps whose output was read
        self.copies: list[HostCopy] = list(first.copies)
        self.taking = requested > 1  # whether the next step belongs to the window
        self.written = False

    def _follow(self) -> RequestLedger:
        """What following later steps needs, made at the first: the requests' block tables as the
        scheduler outputs leave them (`RequestLedger`), per KV cache group the blocks saved or
        written so far (a later step saves the blocks it reads from the prefix cache that are not
        among them) and the layers whose writes each later step digests (`kv_digest`)."""
        if self.ledger is None:
            first, adapter = self.first_step, self.recorder.adapter
            self.ledger = RequestLedger([*first.requests, *self.held], adapter.frees_preempted)
            self.block_sizes = [group.layout.block_size for group in first.kv.groups]
            self.speculative = first.spec_decode is not None  # whether its steps keep proposals
            self.digested_layers = digested_layers(adapter.kv_groups(), adapter.model)
            self.known = [set(group.saved_block_ids) | set(group.written_block_ids) for group in first.kv.groups]
        return self.ledger

    def log(self, call: RunnerCall, index: int) -> None:
        self.calls.append({"call": call.value, "step": index})

    def take(self, pending: PendingStep) -> "CarriedStepCapture":
        """The next step of the window has started: recorded as the runner receives it."""
        self.started += 1
        if 1 + self.started >= self.requested:
            self.taking = False
        self.log(RunnerCall.EXECUTE, pending.index)
        started = time.perf_counter()
        ledger = self._follow()
        scheduler_output = self.recorder.adapter.scheduler_output_record(pending.scheduler_output)
        ledger.apply(scheduler_output, f"step {pending.index}")
        written = ledger.written(scheduler_output, self.block_sizes)
        scheduled = ledger.scheduled_blocks(scheduler_output)
        return CarriedStepCapture(self.recorder, pending, self, scheduler_output, written, scheduled,
                                  (time.perf_counter() - started) * 1e6)

    def stop_taking(self) -> None:
        """No later step joins: written as it stands once the outputs of those taken are in."""
        self.taking = False
        self._write_if_whole()

    def first_finished(self, step: Step, copies: list[HostCopy]) -> None:
        """The first step's output is in (its copies are `copies`)."""
        self.log(RunnerCall.OUTPUT, self.first_index)
        self.first = step
        self._add_copies(copies)
        self._write_if_whole()

    def carried_finished(self, copies: list[HostCopy]) -> None:
        self.finished += 1
        self._add_copies(copies)
        self._write_if_whole()

    def carried_failed(self, carried: CarriedStep, copies: list[HostCopy]) -> None:
        """A later step failed: the window ends with it, written now (the engine may be going
        down; an earlier step whose output the engine had not read yet has no sampled ids)."""
        self.taking = False
        if carried not in self.carried:
            self.carried.append(carried)
        self.started = len(self.carried)
        self._add_copies(copies)
        self._write(now=True)

    def _add_copies(self, copies: list[HostCopy]) -> None:
        self.copies.extend(copy for copy in copies if copy not in self.copies)

    def _write_if_whole(self) -> None:
        if not self.taking and self.first is not None and self.finished == self.started:
            self._write(now=False)

    def _write(self, now: bool) -> None:
        if self.written or self.first is None:
            return
        self.written = True
        steps = self.first.with_later(self.carried[:self.started], self.held, self.calls, self.requested)
        self.recorder.write(steps, self.copies, now)


class CarriedStepCapture(StepCapture):
    """A later step of a window: picked when the step starts (its scheduler output is recorded
    before the runner applies it), copied lightly just before its forward, its outputs as they
    come."""

    def __init__(self, recorder: Recording, pending: PendingStep, window: OpenWindow, scheduler_output: SchedulerOutputRecord,
                 written: list[set[int]], scheduled: dict[str, tuple[int, list[list[int]]]], recorded_us: float):
        super().__init__(recorder, pending)
        self.window = window
        self.scheduler_output = scheduler_output
        self.written = written  # per KV cache group, the blocks the step writes
        self.scheduled = scheduled  # per request: its scheduled tokens, its blocks per KV cache group
        self.positions: Any = None  # the forward's input positions, on the device
        self.recorded_us = recorded_us  # the recorder's host time on the scheduler output
        self.carried: CarriedStep | None = None
        self.forward_timer: ForwardTimer | None = None

    def before_forward(self, input_ids: Any, positions: Any) -> None:
        recorder, pending = self.recorder, self.pending
        copy = recorder.new_copy(pending)
        mark: StepMark = recorder.adapter.mark(pending.scheduler_output, input_ids, positions)
        self.positions = mark.positions
        self.carried = step_capture.capture_carried(recorder.adapter, mark, pending.index, self.scheduler_output, copy,
                                                    self.window.known)
        for known, written in zip(self.window.known, self.written):
            known.update(written)
        self.carried.timing.host_copy_us += self.recorded_us
        copy.finish()
        self.window.carried.append(self.carried)
        self.forward_timer = ForwardTimer(recorder)

    def after_forward(self, output: Any) -> None:
        if self.forward_timer is None or not self.forward_timer.stop(self.carried.timing):
            return
        copy = self.recorder.new_copy(self.pending)
        step_capture.capture_after_forward(self.recorder.adapter, self.carried, output, copy)
        self._digest_kv_written(copy)
        copy.finish()
        self.pending.phase = Phase.LOGITS

    def _digest_kv_written(self, copy: HostCopy) -> None:
        """A digest of the KV the forward wrote, per layer and request (`kv_digest`): computed
        on the copy's side stream, before the next step can write the same blocks."""
        started = time.perf_counter()
        order = self.carried.batch_order
        if all(req_id in self.scheduled for req_id in order):
            self.carried.kv_written = kv_written(
                self.recorder.adapter.kv_groups(), self.window.digested_layers, self.positions,
                [self.scheduled[req_id][0] for req_id in order], [self.scheduled[req_id][1] for req_id in order],
                copy.computed)
        self.carried.timing.host_copy_us += (time.perf_counter() - started) * 1e6

    def logits_computed(self, logits: Any) -> None:
        if self.carried is None:
            return
        copy = self.recorder.new_copy(self.pending)
        step_capture.capture_logits(self.carried, logits, copy)
        copy.finish()

    def sampling(self) -> None:
        self.window.log(RunnerCall.SAMPLE, self.pending.index)

    def grammar_received(self, read: Callable[[], GrammarRecord]) -> None:
        if self.carried is not None:
            self.carried.grammar = read()

    def drafts_proposed(self, read: Callable[[], Any]) -> None:
        if self.carried is None or not self.window.speculative:
            return
        copy = self.recorder.new_copy(self.pending)
        step_capture.capture_carried_proposals(self.carried, read(), copy)
        copy.finish()

    def grammar_applied(self, logits: Any) -> None:
        if self.carried is None:
            return
        copy = self.recorder.new_copy(self.pending)
        step_capture.capture_grammar_applied(self.carried, logits, copy)
        copy.finish()

    def receiver(self) -> Receiver:
        recorder, pending, window = self.recorder, self.pending, self.window

        def finish(sampled: Any) -> None:
            window.log(RunnerCall.OUTPUT, pending.index)
            recorder.end_step(pending, self.carried, sampled)
            window.carried_finished(pending.copies)

        return recorder.guarded(finish, "finish")

    def failed_with(self, error: dict[str, Any], step_us: float) -> None:
        """The step raised (`error`: its error record) after `step_us`: the window ends with it.
        A step that failed before its forward has no batch order, inputs or dispatch."""
        carried = self.carried or CarriedStep(index=self.pending.index, scheduler_output=self.scheduler_output,
                                              batch_order=[])
        carried.error = error
        carried.timing.step_us = step_us
        self.window.carried_failed(carried, self.pending.copies)
