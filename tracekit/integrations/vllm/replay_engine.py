"""The one seam between `tracekit.replay` and vLLM: building, checking and driving a replay engine.

`tracekit.replay` imports this module and no other vLLM-facing one (`tests/test_layering.py`), so
a feature that changes what a replay asks of vLLM changes this module and what it wraps, not the
replay's stages.
"""

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.errors import BundleError, CannotRunHere, NotReplayableYet, UsageError
from tracekit.format.schema import BundleContent, EngineConfig, Environment, ParallelRank, Step
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import default_device
from tracekit.graphs.modes import ReplayMode
from tracekit.integrations.vllm.engines import graph_backend, lean_build, ranks, workers
from tracekit.integrations.vllm.engines.build import (
    IN_PROCESS_ENV,
    adapter_of,
    apply_recorded_determinism,
    build_llm,
    parse_engine_cli_args,
    release_llm,
)
from tracekit.integrations.vllm.engines.lean_build import EngineBuild, EngineNeeds, needs_of, union_of
from tracekit.integrations.vllm.engines.platform_facts import kv_layout_difference
from tracekit.integrations.vllm.engines.sequence_driver import SequenceDriver
from tracekit.integrations.vllm.engines.step_driver import ForwardHandle, unknown_tokens_to_recompute
from tracekit.integrations.vllm.engines.workers import reported as worker_error
from tracekit.integrations.vllm.records.grammar import unpack_mask
from tracekit.integrations.vllm.records.spec_decode import STATEFUL_DRAFTERS
from tracekit.integrations.vllm.records.step_features import not_replayable_reason
from tracekit.integrations.vllm.records.step_records import logits_rows
from tracekit.integrations.vllm.records.weights import local_model_folder, weights_fingerprint
from tracekit.integrations.vllm.records.window_records import WindowStep, window_steps
from tracekit.integrations.vllm.releases import SUPPORTED_SERIES, release_for, series_of
from tracekit.integrations.vllm.releases.installed import installed_release
from tracekit.integrations.vllm.runners.layer_capture import LayerCapture, capture_eager_forward
from tracekit.integrations.vllm.runners.lora_adapters import LocatedAdapters
from tracekit.integrations.vllm.runners.lora_adapters import locate as locate_lora_adapters
from tracekit.models import tiny_model_path

__all__ = [
    "STATEFUL_DRAFTERS", "EngineBuild", "EngineNeeds", "EngineSpec", "ForwardHandle", "LocatedAdapters", "ReplayEngine",
    "SequenceDriver", "WindowStep", "build_replay_engine", "engine_key", "engine_of", "expand_window",
    "locate_lora_adapters", "logits_rows", "needs_of", "parse_engine_cli_args", "release_llm", "replay_engine_args", "require_drafting_known",
    "require_layout_buildable", "require_recomputable", "require_recorded_release_here", "require_replayable_here",
    "require_replayable_kind", "sampler_change", "union_of", "unpack_mask", "worker_adapter", "worker_error",
]

# The replay modes that run the engine's compiled code.
_COMPILED_FORMS = (ReplayMode.COMPILED.value, ReplayMode.COMPILED_NO_GRAPH.value)
# The engine arguments that set a multi-rank engine's parallel layout.
_LAYOUT_ARGS = ("tensor_parallel_size", "pipeline_parallel_size")
# The engine arguments that name the weights' location, which may differ between machines.
_MODEL_PATH_ARGS = ("model", "tokenizer")
# The engine argument that configures speculative decoding (its draft model among it).
_SPECULATIVE_ARG = "speculative_config"


# -- before any engine: is the bundle one vLLM here can replay --------------------------------------


def require_replayable_kind(step: Step) -> None:
    """Refuse (exit 5) a step that used what this tracekit records but cannot replay yet."""
    reason = not_replayable_reason(step)
    if reason is not None:
        raise NotReplayableYet(reason)


def require_recomputable(bundle: str | Path, step: Step) -> None:
    """Refuse (bad input) a `--kv recompute` bundle that lacks token ids its replay must prefill."""
    unknown = unknown_tokens_to_recompute(step)
    if unknown:
        raise BundleError(
            f"{bundle}: its KV is to be recomputed, but {unknown} of the token ids before step {step.index} are not "
            "in the bundle (vLLM's V1 runner under async scheduling holds placeholders for them): record with "
            "--kv read, or arm the recorder before the requests arrive, or record on Model Runner V2 or with async "
            "scheduling off"
        )


def require_drafting_known(bundle: str | Path, content: BundleContent, step: Step, overrides: Mapping[str, Any]) -> None:
    """Refuse (usage) a drafted step when neither the bundle nor an engine argument says how its
    engine drafted: its replay would build an engine without a drafter."""
    drafted = any(request.draft_token_ids for request in step.requests) or any(
        step.scheduler_output.scheduled_spec_decode_tokens.values())
    if drafted and _SPECULATIVE_ARG not in content.engine.engine_args and _SPECULATIVE_ARG not in overrides:
        raise UsageError(
            f"{bundle}: step {step.index} verifies draft tokens (speculative decoding), and the bundle does not record "
            "how its engine drafted (a tracekit before speculative decoding was supported): pass it, e.g. "
            "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'"
        )


def require_recorded_release_here(content: BundleContent) -> None:
    """Refuse (exit 3) a bundle recorded on another kind of device or by another vLLM series (a
    multi-rank step, `shrink` and `invariance` do not replay across releases yet)."""
    _require_device_of(content.environment)
    recorded, here = content.engine.vllm_version, installed_release().version
    if series_of(recorded) != series_of(here):
        raise CannotRunHere(f"bundle was recorded with vLLM {recorded}; its scheduler objects do not fit the "
                            f"installed vLLM {here} (install vLLM {series_of(recorded)}.x)")


def require_replayable_here(content: BundleContent, step: Step) -> tuple[str, str] | None:
    """Refuse (exit 3) a bundle recorded on another kind of device, by a vLLM series tracekit does
    not know, or a step the installed release cannot take (its records are rebuilt through the
    installed release's module: `Release.from_plain`, `adopt_engine_args`). Returns (recorded,
    installed) vLLM versions for a replay across releases."""
    _require_device_of(content.environment)
    release, recorded = installed_release(), content.engine.vllm_version
    try:
        release_for(recorded)
    except CannotRunHere:
        raise CannotRunHere(
            f"bundle was recorded with vLLM {recorded}, a series this tracekit does not know (supported: "
            f"{', '.join(series + '.x' for series in SUPPORTED_SERIES)}): upgrade tracekit to replay it"
        ) from None
    if series_of(recorded) == series_of(release.version):
        return None
    release.require_takes(step, content.engine)
    return recorded, release.version


def sampler_change(content: BundleContent) -> str | None:
    """How the recording's and the installed vLLM's samplers draw otherwise, in words, where both
    draws are read and differ (`Release.sampler_draw`)."""
    release = installed_release()
    recorded = release_for(content.engine.vllm_version)
    engine = content.engine
    facts = (engine.runner, content.environment.device_kind, engine.engine_args)
    before, here = recorded.sampler_draw(*facts), release.sampler_draw(*facts)
    if before is None or here is None or before == here:
        return None
    return f"vLLM {release.version}'s sampler draws {here}, {recorded.version}'s {before}"


def require_layout_buildable(parallel: ParallelRank, overrides: Mapping[str, Any]) -> None:
    """Refuse (exit 3) a rank set's parallel layout this machine cannot build, or one the engine
    arguments would change."""
    ranks.require_buildable(parallel, default_device())
    if any(name in overrides for name in _LAYOUT_ARGS):
        raise CannotRunHere("a multi-rank step replays with its recorded parallel layout only: "
                            "drop the parallel-size engine arguments")


def _require_device_of(recorded: Environment) -> None:
    """Refuse a bundle recorded on a kind of device this machine lacks."""
    here = default_device()
    if recorded.device_kind != here:
        name = f" ({recorded.device_name})" if recorded.device_name else ""
        engine = "a CPU engine" if here == "cpu" else f"a {here} engine"
        raise CannotRunHere(
            f"the bundle was recorded on a {recorded.device_kind} device{name}, and vLLM here builds {engine}, "
            f"whose KV cache, kernels and graphs differ: replay it on a {recorded.device_kind} machine"
        )


def expand_window(step: Step, content: BundleContent) -> list[WindowStep]:
    """The steps of the window `step` opens (just `step` when it opens none), each whole: a later
    step's request states derived from the bundle by the runner kind's bookkeeping; a window
    whose steps do not follow from one another is refused (bad input)."""
    frees_preempted = installed_release().adapter_class(content.engine.runner).frees_preempted
    return window_steps(step, frees_preempted, content.engine.num_kv_blocks)


# -- the engine --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """Which replay engine to build.

    The recorded one: `engine` with the weights found here (`model`, checked against the recorded
    fingerprint unless `allow_weights_mismatch`), the user's `overrides` on top, in the
    deterministic modes `recorded` (the recording's environment) ran in; lean with what `needs`
    names, or as vLLM builds it where `needs` is None.

    Or, with `timing_mode` ("graph", "piecewise"), the engine such a mode runs in: `engine_args`
    (read back from the replay engine it follows) with vLLM's graphs off and the compilation that
    mode needs (`table`: the capture sizes tracekit's backends capture).
    """

    engine: EngineConfig
    recorded: Environment | None = None
    model: str | None = None
    allow_weights_mismatch: bool = False
    overrides: Mapping[str, Any] = field(default_factory=dict)
    needs: EngineNeeds | None = None
    timing_mode: str | None = None
    engine_args: Mapping[str, Any] | None = None
    table: CaptureTable | None = None
    # The steps carry recorded kernel choices: nothing compiled elsewhere is loaded.
    compile_here: bool = False


def build_replay_engine(spec: EngineSpec) -> "ReplayEngine":
    """The engine `spec` describes, built here (weights not found or not the recorded ones, a
    runner kind vLLM here cannot build, engine arguments vLLM refuses: exit 3)."""
    if spec.timing_mode is not None:
        llm = build_llm(_timing_mode_args(spec), spec.engine.runner)
        return ReplayEngine(llm, spec.engine.runner, build=None, built_here=True)
    args = replay_engine_args(spec.engine, spec.model, spec.allow_weights_mismatch, dict(spec.overrides))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.recorded is not None:
        apply_recorded_determinism(spec.recorded.env_vars)
    llm = lean_build.build(args, spec.engine.runner, spec.needs, compile_here=spec.compile_here)
    return ReplayEngine(llm, spec.engine.runner, build=lean_build.build_of(llm), built_here=True)


def engine_of(llm: Any, runner_kind: str, needs: EngineNeeds | None = None) -> "ReplayEngine":
    """An engine a caller built (or a previous replay's), for steps of `runner_kind`; refused
    (usage) where it was built lean without graphs the step `needs`."""
    build = lean_build.build_of(llm)
    if needs is not None and build is not None and build.kind == "lean":
        missing = needs.graphs - set(build.graphs_wanted)
        if missing:
            raise UsageError(
                f"the engine passed in is lean, built without the graphs this step needs ({sorted(missing)}): "
                "build it with ReplayOptions(engine_needs=...) covering every step it replays, or full_engine=True"
            )
    return ReplayEngine(llm, runner_kind, build=build, built_here=False)


def engine_key(content: BundleContent) -> str:
    """Bundles with equal keys replay on one engine (the same vLLM, model runner kind, weights and
    engine arguments)."""
    args = dict(content.engine.engine_args)
    fingerprint = content.engine.model.weights_fingerprint
    if fingerprint is not None:  # the same weights found at another path are the same engine
        for name in _MODEL_PATH_ARGS:
            args.pop(name, None)
    return json.dumps(
        {"vllm": content.engine.vllm_version, "runner": content.engine.runner, "weights": fingerprint,
         "engine_args": args},
        sort_keys=True, default=str,
    )


def replay_engine_args(engine: EngineConfig, model: str | None, allow_weights_mismatch: bool,
                       overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of the replay engine: recorded, weights resolved, overrides on top."""
    args = dict(engine.engine_args)
    args["model"] = _resolve_model(engine, model, allow_weights_mismatch)
    if args.get("tokenizer") == engine.model.path:
        args["tokenizer"] = args["model"]
    if engine.draft_model is not None and _SPECULATIVE_ARG not in overrides:
        _require_draft_weights(engine, allow_weights_mismatch)
    if overrides.get("enforce_eager"):
        args["compilation_config"] = {**args.get("compilation_config", {}), "mode": graph_backend.NO_COMPILATION}
    if "watermark_config" in args and "watermark_config" not in overrides:  # one given with its key stands
        args["watermark_config"] = {**_mapping(args["watermark_config"]), "key": _watermark_key()}
    return {**args, **overrides}


WATERMARK_KEY_VARIABLE = "TRACEKIT_WATERMARK_KEY"


def _watermark_key() -> int:
    """The key of the recording engine's watermark, which a bundle never holds: from the
    environment (not a flag, which shell history and `ps` would show). Without it, what the
    watermarked requests sample cannot be reproduced (exit 3)."""
    given = os.environ.get(WATERMARK_KEY_VARIABLE)
    if given is None:
        raise CannotRunHere(f"the step was recorded with vLLM's watermark on (--watermark-config), whose key a "
                            f"bundle never holds: set {WATERMARK_KEY_VARIABLE} to the recording engine's key")
    try:
        return int(given, 0)
    except ValueError:
        raise UsageError(f"{WATERMARK_KEY_VARIABLE} is not an integer: set it to the watermark's key, as "
                         "--watermark-config's \"key\" gave it") from None


def _resolve_model(engine: EngineConfig, model: str | None, allow_weights_mismatch: bool) -> str:
    """Where the weights are here, checked against the recorded fingerprint (exit 3 if not)."""
    recorded = engine.model
    load_format = engine.engine_args.get("load_format")
    if model is None:
        model = recorded.path
        if not Path(model).exists() and recorded.weights_fingerprint == weights_fingerprint(tiny_model_path(), load_format):
            model = tiny_model_path()  # recorded on another machine with tracekit's embedded model
    if recorded.weights_fingerprint is None or allow_weights_mismatch:
        return model
    if not Path(model).exists() and local_model_folder(model) is None:
        raise CannotRunHere(f"the model's weights are not at {model} on this machine: pass --model DIR, where they are")
    here = weights_fingerprint(model, load_format)
    if here != recorded.weights_fingerprint:
        raise CannotRunHere(
            f"weights at {model} differ from the recorded ones ({here} vs {recorded.weights_fingerprint}); "
            "pass --allow-weights-mismatch to replay anyway"
        )
    return model


def _require_draft_weights(engine: EngineConfig, allow_weights_mismatch: bool) -> None:
    """The recorded draft model (speculative decoding) is where it was and holds the recorded
    weights (exit 3 if not)."""
    recorded = engine.draft_model
    if recorded.weights_fingerprint is None or allow_weights_mismatch:
        return
    speculative = _mapping(engine.engine_args.get(_SPECULATIVE_ARG))
    fix = f"pass --speculative-config with its \"model\" where it is here (recorded: {speculative})"
    if not Path(recorded.path).exists():
        raise CannotRunHere(f"the draft model (speculative decoding) is not at {recorded.path}: {fix}")
    load_format = _mapping(speculative.get("draft_load_config")).get("load_format") or engine.engine_args.get("load_format")
    here = weights_fingerprint(recorded.path, load_format if isinstance(load_format, str) else None)
    if here != recorded.weights_fingerprint:
        raise CannotRunHere(
            f"draft model weights at {recorded.path} differ from the recorded ones ({here} vs "
            f"{recorded.weights_fingerprint}): pass --allow-weights-mismatch to replay anyway, or {fix}"
        )


def _mapping(value: Any) -> Mapping[str, Any]:
    """An engine argument that should be a map (a bundle is untrusted: anything else is none)."""
    return value if isinstance(value, dict) else {}


def _timing_mode_args(spec: EngineSpec) -> dict[str, Any]:
    """The replay engine's arguments with the compilation `spec.timing_mode` runs in."""
    args = dict(spec.engine_args or {})
    compilation = {**args.get("compilation_config", {}),
                   **graph_backend.compilation_config_for(spec.timing_mode, spec.table)}
    # An eager recording's enforce_eager would switch the piecewise backend's compilation off.
    eager = {"enforce_eager": False} if spec.timing_mode == "piecewise" else {}
    return {**args, **eager, "compilation_config": compilation}


class ReplayEngine:
    """A replay engine (`build_replay_engine`, `engine_of`) and what a replay asks of it."""

    def __init__(self, llm: Any, runner_kind: str, build: EngineBuild | None, built_here: bool):
        self.llm = llm
        self.runner_kind = runner_kind
        self.build = build  # None: an engine tracekit did not build (or one for a timing mode)
        self.built_here = built_here
        self._adapter: Any = None

    @property
    def adapter(self) -> Any:
        """The adapter of the engine's model runner (one rank, in this process: a multi-rank
        engine's runners are reached through `on_every_worker`)."""
        if self._adapter is None:
            self._adapter = adapter_of(self.llm)
        return self._adapter

    def require_runner_kind(self) -> None:
        """Refuse (usage) an engine whose runner is not of the kind the step was recorded on."""
        kind = self.adapter.kind
        if kind != self.runner_kind:
            variable, value = next(iter(installed_release().runner_env(self.runner_kind).items()))
            raise UsageError(
                f"the bundle was recorded on vLLM's {self.runner_kind.upper()} model runner; the engine passed in "
                f"runs {kind.value.upper()}: build it with {variable}={value}"
            )

    @property
    def set_in_process(self) -> dict[str, str]:
        """The environment variables tracekit set in this process to build the engine."""
        release = installed_release()
        return {**IN_PROCESS_ENV, **release.runner_env(self.runner_kind), **(self.build.env if self.build else {})}

    @property
    def reference_mode(self) -> str:
        """The mode the engine runs a forward in: "compiled", or "eager" without torch.compile."""
        return self.adapter.reference_mode

    @property
    def has_graphs(self) -> bool:
        return self.adapter.device_backend.has_graphs

    def environment(self) -> Environment:
        """This machine's fingerprint, read after the engine was built (vLLM sets variables of its own)."""
        return self.adapter.environment()

    def require_kv_layout_of(self, recorded: Environment, here: Environment) -> None:
        """Refuse (exit 3) KV blocks recorded in a layout this engine's attention backend does not read."""
        problem = kv_layout_difference(recorded.attention_backend, here.attention_backend)
        if problem is not None:
            raise CannotRunHere(problem)

    def unavailable_reason(self, mode: str) -> str | None:
        """Why this engine cannot time `mode`, a compiled form, at all (None: it may)."""
        if self.reference_mode == ReplayMode.EAGER.value and mode in _COMPILED_FORMS:
            return ("the engine runs without torch.compile (compilation mode NONE); "
                    "record with compilation enabled to time it compiled")
        return None

    def driver(self, steps: list[WindowStep] | Step, lora_paths: dict[int, str] | None = None, *,
               rebuild: set[int] = frozenset(), until: int | None = None, keep_kv_read: bool = False,
               on_forward: Callable[[ForwardHandle], None] | None = None) -> SequenceDriver:
        """A driver of a bundle's steps (`expand_window`; a `Step`: that step alone) through this
        engine's runner (refused where a step does not fit it), the runner carrying its state
        from step to step except where a step in `rebuild` is rebuilt; the steps after `until`
        are not run; `keep_kv_read`: a rebuilt step's KV blocks are copied as its forward reads
        them; `lora_paths`: where the first step's LoRA adapters are here
        (`locate_lora_adapters`); `on_forward`: handed the first step's forward."""
        steps = [WindowStep(steps)] if isinstance(steps, Step) else steps
        return SequenceDriver(self.adapter, steps, rebuild, until, keep_kv_read, lora_paths, on_forward)

    def capture_layers(self, handle: ForwardHandle) -> LayerCapture:
        """Every watched layer's output of one eager run of the step's forward."""
        return capture_eager_forward(self.adapter.model, handle)

    def piecewise_backend(self) -> Any:
        """The piecewise graph backend tracekit's "piecewise" timing mode compiled the model with
        (the newest one of this process), or None."""
        return graph_backend.built_backends[-1] if graph_backend.built_backends else None

    def engine_args(self) -> dict[str, Any]:
        """The engine arguments that rebuild an engine whose forward matches this one's."""
        return self.adapter.release.engine_args_from_config(self.adapter.runner.vllm_config)

    def on_every_worker(self, function: Callable, *args: Any) -> list[Any]:
        """`function(worker, *args)` in every worker process, results in rank order."""
        return workers.on_every_worker(self.llm, function, *args)

    def forget_cached_prefixes(self) -> None:
        """Forget cached prefixes, so that the next replayed step finds no blocks it did not restore."""
        self.llm.reset_prefix_cache()

    def release(self) -> None:
        """Shut the engine down and give its memory back, before another is built."""
        llm, self.llm, self._adapter = self.llm, None, None
        release_llm(llm)


# -- inside a worker process of a multi-rank engine -------------------------------------------------


def worker_adapter(worker: Any) -> Any:
    """The adapter of a vLLM worker's model runner (this process's rank of a multi-rank engine)."""
    return installed_release().adapter_for(workers.runner_of(worker))
