"""The recorder armed on one live model runner.

Arming shadows three runner methods on that instance: `execute_model` (counts steps, catches a
failing forward), `_model_forward` (decides whether to fire, copies the step to host around the
model call) and `sample_tokens` (adds the sampled ids, hands the step to the writer thread).
Disarming removes the shadows; the engine's outputs are the same armed or not.
"""

import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.errors import UsageError
from tracekit.format.schema import EngineConfig, ModelInfo, Step
from tracekit.graphs.device import get_device_backend
from tracekit.integrations.vllm import engine as vllm_engine
from tracekit.integrations.vllm import layer_capture, runner_state
from tracekit.integrations.vllm.platform_facts import runner_environment
from tracekit.integrations.vllm.method_patch import shadowed
from tracekit.integrations.vllm.version import require_supported_vllm
from tracekit.record import step_capture
from tracekit.record.persist import BackgroundPersister, OutputTemplate
from tracekit.record.triggers import BatchFacts, TriggerSet

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


def engine_config_of(runner: Any) -> EngineConfig:
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
    ):
        if kv not in step_capture.KV_MODES:
            raise UsageError(f"bad --kv {kv!r}: choose one of {', '.join(step_capture.KV_MODES)}")
        self.runner = runner
        self.output = OutputTemplate(output)
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
        self._pending: _PendingStep | None = None
        self._persister: BackgroundPersister | None = None
        self._shadows: Any = None

    @property
    def written(self) -> list[Path]:
        return self._persister.written if self._persister else []

    @property
    def failures(self) -> list[str]:
        return self._persister.failures if self._persister else []

    @property
    def exhausted(self) -> bool:
        return self.bundles_fired >= self.max_bundles

    def arm(self) -> "Recorder":
        self._persister = BackgroundPersister(
            runner_environment(self.runner), engine_config_of(self.runner)
        )
        self._shadows = shadowed(
            self.runner,
            {
                "execute_model": self._wrap_execute_model,
                "_model_forward": self._wrap_model_forward,
                "sample_tokens": self._wrap_sample_tokens,
            },
        )
        self._shadows.__enter__()
        return self

    def disarm(self) -> None:
        if self._shadows is not None:
            self._shadows.__exit__(None, None, None)
            self._shadows = None
        if self._persister is not None:
            self._persister.close()

    def __enter__(self) -> "Recorder":
        return self.arm()

    def __exit__(self, *exc_info: Any) -> None:
        self.disarm()

    def _wrap_execute_model(self, original: Any) -> Any:
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if scheduler_output.total_num_scheduled_tokens == 0 or self.exhausted:
                return original(scheduler_output, *args, **kwargs)
            self._pending = _PendingStep(self.steps_seen, scheduler_output, time.perf_counter())
            self.steps_seen += 1
            try:
                result = original(scheduler_output, *args, **kwargs)
            except BaseException as error:
                self._record_failure(error)
                raise
            pending = self._pending
            if pending is not None and pending.step is not None:
                state = self.runner.execute_model_state
                step_capture.capture_logits(pending.step, state.logits if state is not None else None)
                if result is not None:  # no sample_tokens follows this step
                    self._finish(sampled=None)
            return result

        return execute_model

    def _wrap_model_forward(self, original: Any) -> Any:
        def model_forward(*args: Any, **kwargs: Any) -> Any:
            pending = self._pending
            if pending is None or pending.forward_seen:
                return original(*args, **kwargs)
            pending.forward_seen = True
            pending.reason = self.triggers.fires_before_forward(
                pending.index, lambda: self._batch_facts(pending.scheduler_output)
            )
            if pending.reason is not None or self.triggers.copies_every_step:
                pending.step = step_capture.capture_before_forward(
                    self.runner,
                    pending.scheduler_output,
                    pending.index,
                    pending.reason or "",
                    self.kv,
                    kwargs.get("input_ids"),
                    kwargs.get("positions"),
                )
            if pending.step is None:
                return original(*args, **kwargs)
            started_wall, started_cpu = time.perf_counter(), time.process_time()
            with layer_capture.capturing(self.runner, self.layers and pending.reason is not None) as layers:
                output = original(*args, **kwargs)
            get_device_backend(self.runner.device).synchronize()
            pending.step.timing.forward_us = (time.perf_counter() - started_wall) * 1e6
            pending.step.timing.forward_cpu_us = (time.process_time() - started_cpu) * 1e6
            step_capture.capture_after_forward(self.runner, pending.step, output)
            if layers is not None and layers.failure is None:
                pending.step.outputs.layers = layers.outputs
            return output

        return model_forward

    def _batch_facts(self, scheduler_output: Any) -> BatchFacts:
        num_reqs, num_tokens, num_prefills, req_ids = runner_state.batch_summary(self.runner, scheduler_output)
        return BatchFacts(num_reqs, num_tokens, num_prefills, frozenset(req_ids))

    def _wrap_sample_tokens(self, original: Any) -> Any:
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if self._pending is not None and self._pending.step is not None:
                self._finish(sampled=getattr(output, "sampled_token_ids", None))
            self._pending = None
            return output

        return sample_tokens

    def _finish(self, sampled: Any) -> None:
        pending, self._pending = self._pending, None
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
        self._persister.submit(self.output.path_for(step.index), step)

    def _count_bundle(self) -> None:
        self.bundles_fired += 1
        if self.exhausted and not self.output.single:
            logger.warning(
                "tracekit: recorded %d bundles, the most this session takes (--max-bundles); "
                "later steps are not recorded", self.max_bundles,
            )

    def _record_failure(self, error: BaseException) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending.step is None:
            return
        if pending.reason is None and "exception" not in self.triggers.events:
            return
        step = pending.step
        step.trigger = pending.reason or "exception"
        step.error = {
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error)),
        }
        self._count_bundle()
        self._persister.write_now(self.output.path_for(step.index), step)

