"""The recorder armed on one live model runner.

Arming asks the runner's adapter (`tracekit.integrations.vllm.runner_adapter`) to shadow that
runner's methods; the adapter reports each step's progress back (`StepObserver`): step started,
just before the forward (decide whether to fire; copy the step's inputs and KV to host), after
it (outputs, KV written), logits, sampling and bookkeeping phases, sampled ids, or a failure in
any of those phases. Disarming removes the shadows.

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
from tracekit.format.schema import EngineConfig, ModelInfo, ParallelRank, Step
from tracekit.graphs.device import get_device_backend
from tracekit.integrations.vllm import engine as vllm_engine
from tracekit.integrations.vllm import layer_capture, ranks
from tracekit.integrations.vllm.platform_facts import runner_environment
from tracekit.integrations.vllm.runner_adapter import RunnerAdapter, adapter_for
from tracekit.integrations.vllm.version import require_supported_vllm
from tracekit.record import step_capture
from tracekit.record.persist import BackgroundPersister, OutputTemplate
from tracekit.record.triggers import TriggerSet

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
    phase: str = "prepare"
    forward_started: tuple[float, float] | None = None  # (wall, process CPU) at the forward
    layers: Any = None  # the LayerCapture hooked for this step's forward (`layers=True`)


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


def engine_config_of(adapter: RunnerAdapter) -> EngineConfig:
    runner = adapter.runner
    config = runner.vllm_config
    args = vllm_engine.engine_args_from_config(config)
    model_path = str(Path(args["model"]).resolve()) if Path(args["model"]).is_dir() else args["model"]
    args["model"] = model_path
    if args.get("tokenizer") and Path(args["tokenizer"]).is_dir():
        args["tokenizer"] = str(Path(args["tokenizer"]).resolve())
    return EngineConfig(
        vllm_version=require_supported_vllm(),
        engine_args=args,
        model=ModelInfo(
            path=model_path,
            architecture=vllm_engine.model_architecture(config),
            weights_fingerprint=vllm_engine.weights_fingerprint(model_path, args.get("load_format")),
        ),
        num_kv_blocks=int(runner.kv_cache_config.num_blocks),
        block_size=int(config.cache_config.block_size),
        runner=adapter.kind,
    )


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
        if kv not in step_capture.KV_MODES:
            raise UsageError(f"bad --kv {kv!r}: choose one of {', '.join(step_capture.KV_MODES)}")
        self.runner = runner
        self.rank = ranks.rank_of(runner, set_id)
        ranks.require_recordable(self.rank)
        self.output = OutputTemplate(output, self.rank.world_size)
        self.triggers = triggers
        self.kv = kv
        if layers and not layer_capture.runs_eagerly(runner):
            raise UsageError("--layers records per-layer outputs only from an eager engine: add --enforce-eager")
        self.layers = layers  # also store every layer's output of a recorded step (eager engines)
        if max_bundles < 1:
            raise UsageError(f"bad --max-bundles {max_bundles}: must be at least 1")
        self.max_bundles = 1 if self.output.single else max_bundles
        self.steps_seen = 0
        self.bundles_fired = 0
        self.adapter: RunnerAdapter | None = None
        self._pending: _PendingStep | None = None
        self._persister: BackgroundPersister | None = None
        self._shadows: Any = None
        self._failures: list[str] = []

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
        return self._pending is not None and self._pending.step is not None

    def arm(self) -> "Recorder":
        """Shadow the runner's methods. A runner the recorder cannot arm on is logged and left
        alone (see `failures`); the engine runs on unrecorded."""
        try:
            self.adapter = adapter_for(self.runner)
            self._persister = BackgroundPersister(
                runner_environment(self.runner), engine_config_of(self.adapter)
            )
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
        if self.exhausted:
            self._pending = None
            return
        self._pending = _PendingStep(self.steps_seen, scheduler_output, time.perf_counter())
        self.steps_seen += 1

    @_engine_boundary
    def before_forward(self, input_ids: Any, positions: Any) -> None:
        pending = self._pending
        if pending is None or pending.forward_seen:
            return
        pending.forward_seen = True
        pending.phase = "forward"
        pending.reason = self.triggers.fires_before_forward(
            pending.index, lambda: self.adapter.batch_facts(pending.scheduler_output)
        )
        if pending.reason is not None or self.triggers.copies_every_step:
            pending.step = step_capture.capture_before_forward(
                self.adapter, pending.scheduler_output, pending.index, pending.reason or "", self.kv,
                input_ids, positions,
            )
            if self.layers and pending.reason is not None:
                pending.layers = layer_capture.LayerCapture(layer_capture.model_of(self.runner)).__enter__()
            pending.forward_started = (time.perf_counter(), time.process_time())

    @_engine_boundary
    def after_forward(self, hidden_states: Any) -> None:
        pending = self._pending
        if pending is None or pending.step is None or pending.forward_started is None:
            return
        get_device_backend(self.runner.device).synchronize()
        started_wall, started_cpu = pending.forward_started
        pending.forward_started = None
        pending.step.timing.forward_us = (time.perf_counter() - started_wall) * 1e6
        pending.step.timing.forward_cpu_us = (time.process_time() - started_cpu) * 1e6
        layers = _stop_layers(pending)
        step_capture.capture_after_forward(self.runner, pending.step, hidden_states)
        if layers is not None and layers.failure is None:
            pending.step.outputs.layers = layers.outputs
        pending.phase = "logits"

    @_engine_boundary
    def logits_computed(self, logits: Any) -> None:
        if self.tracking:
            step_capture.capture_logits(self._pending.step, logits)

    @_engine_boundary
    def phase_entered(self, phase: str) -> None:
        if self._pending is not None:
            self._pending.phase = phase

    def output_receiver(self) -> Callable[[list[list[int]] | None], None]:
        pending, self._pending = self._pending, None
        if pending is None or pending.step is None:
            return lambda sampled: None
        return lambda sampled: self._finish(pending, sampled)

    @_engine_boundary
    def step_failed(self, error: BaseException) -> None:
        pending, self._pending = self._pending, None
        _stop_layers(pending)
        if pending is None or pending.step is None:
            return
        if pending.reason is None and "exception" not in self.triggers.events:
            return
        step = pending.step
        step.trigger = pending.reason or "exception"
        step.timing.step_us = (time.perf_counter() - pending.started) * 1e6
        step.error = {
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error)),
            "phase": pending.phase,
        }
        self._count_bundle()
        self._persister.write_now(*self._destination(step))

    # -- firing ------------------------------------------------------------------------------

    @_engine_boundary
    def _finish(self, pending: _PendingStep, sampled: Any) -> None:
        step = pending.step
        step_capture.capture_sampled(step, sampled)
        step.timing.step_us = (time.perf_counter() - pending.started) * 1e6
        finite = step_capture.outputs_finite(step)
        reason = pending.reason
        if reason is None and not finite and "nonfinite" in self.triggers.events:
            reason = "nonfinite"
        if reason is None:
            return
        step.trigger = reason
        self._count_bundle()
        self._persister.submit(*self._destination(step))

    def _count_bundle(self) -> None:
        self.bundles_fired += 1
        if self.exhausted and not self.output.single:
            logger.warning(
                "tracekit: recorded %d bundles, the most this session takes (--max-bundles); "
                "later steps are not recorded", self.max_bundles,
            )

    def _destination(self, step: Step) -> tuple[Path, Step, ParallelRank]:
        """This rank's bundle of the step, and the rank fields that tie it to the other ranks'."""
        path = self.output.path_for(step.index, self.rank.rank)
        parts = [
            os.path.relpath(self.output.path_for(step.index, rank), path.parent)
            for rank in range(self.rank.world_size)
        ] if self.rank.multi_rank else []
        return path, step, dataclasses.replace(self.rank, parts=parts)


def _stop_layers(pending: _PendingStep | None) -> Any:
    """Remove the step's layer hooks, if any; returns the capture."""
    layers = pending.layers if pending is not None else None
    if layers is not None:
        pending.layers = None
        layers.__exit__(None, None, None)
    return layers
