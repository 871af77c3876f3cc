"""`replay(bundle)`: rebuild the engine a bundle describes, run its step, check it, time it.

The order matters for the exit codes a `git bisect run` relies on: the bundle is read and
validated first (bad input: 2), then this machine is checked — vLLM series, weights — (cannot
replay here: 3), and only then does the step run (did not reproduce: 1; reproduced: 0).
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.environment import environment_differences
from tracekit.errors import CannotRunHere, UsageError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, EngineConfig, Step
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.modes import GRAPH_MODES, expand_modes, measure_mode
from tracekit.graphs.profiling import trace_path
from tracekit.integrations.vllm import engine as vllm_engine
from tracekit.integrations.vllm import layer_capture
from tracekit.integrations.vllm.platform_facts import kv_layout_difference, runner_environment
from tracekit.integrations.vllm.runner_adapter import adapter_for, runner_env
from tracekit.integrations.vllm.step_driver import ForwardHandle, StepDriver
from tracekit.integrations.vllm.version import require_same_series
from tracekit.models import tiny_model_path
from tracekit.replay.checks import CheckedItem, check_layers, check_step, first_divergence
from tracekit.replay.layers_bundle import write_layers_bundle
from tracekit.replay.verdict import Verdict, decide


@dataclass
class ReplayResult:
    bundle: str
    step_index: int
    trigger: str
    reference_mode: str
    checks: list[CheckedItem]
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    recorded_timing: dict[str, Any] = field(default_factory=dict)
    replay_forward_us: float | None = None
    environment_differences: list[dict[str, Any]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tolerance: float = 0.0
    error_step: bool = False  # the recorded forward raised
    strict: bool = False  # exit 0 for a bit-exact replay only
    # The recorded per-layer outputs (`record --layers`) against this replay's eager forward.
    layer_checks: list[CheckedItem] = field(default_factory=list)
    layers_bundle: str | None = None  # where `--layers` wrote this replay's per-layer outputs
    llm: Any = field(default=None, repr=False)  # the engine, for reuse; not serialised

    @property
    def bit_exact(self) -> bool:
        return all(item.bit_exact for item in self.checks)

    @property
    def reproduced(self) -> bool:
        return all(item.within_tolerance for item in self.checks)

    @property
    def first_divergence(self) -> str | None:
        item = first_divergence(self.checks)
        return item.name if item else None

    @property
    def first_diverging_layer(self) -> CheckedItem | None:
        return first_divergence(self.layer_checks)

    @property
    def verdict(self) -> Verdict:
        numeric = [d["field"] for d in self.environment_differences if d["affects_numerics"]]
        return decide(self.checks + self.layer_checks, numeric, self.tolerance, self.error_step)

    @property
    def exit_code(self) -> int:
        """0 unless the verdict is diverged or error_not_reproduced; `strict`: 0 only if bit-exact."""
        return self.verdict.exit_code(self.strict)

    def to_plain(self) -> dict[str, Any]:
        first_layer = self.first_diverging_layer
        return {
            "bundle": self.bundle,
            "step": self.step_index,
            "trigger": self.trigger,
            **self.verdict.to_plain(),
            "reproduced": self.reproduced,
            "bit_exact": self.bit_exact,
            "first_divergence": self.first_divergence,
            "tolerance_relative_rms": self.tolerance,
            "reference_mode": self.reference_mode,
            "checks": [item.to_plain() for item in self.checks],
            "first_diverging_layer": None if first_layer is None else first_layer.name.removeprefix("layer/"),
            "layer_checks": [item.to_plain() for item in self.layer_checks],
            "layers_bundle": self.layers_bundle,
            "modes": self.modes,
            "recorded": self.recorded_timing,
            "replay_forward_us": self.replay_forward_us,
            "environment_differences": self.environment_differences,
            "overrides": self.overrides,
            "notes": self.notes,
        }


def load_step(bundle: str | Path, step: int | None) -> tuple[BundleContent, Step]:
    """The bundle's content and one step with its tensors loaded (all others stay on disk)."""
    with open_bundle(bundle) as reader:
        metadata = reader.metadata
        content = BundleContent.from_plain(metadata)
        indices = [s.index for s in content.steps]
        if not indices:
            raise UsageError(f"bundle {bundle} holds no recorded step")
        position = 0 if step is None else (indices.index(step) if step in indices else None)
        if position is None:
            raise UsageError(f"bundle {bundle} has no step {step} (it has {', '.join(map(str, indices))})")
        loaded = Step.from_plain(reader.resolve(metadata["steps"][position], to="torch"))
    return content, loaded


def resolve_model(engine: EngineConfig, model: str | None, allow_weights_mismatch: bool) -> str:
    """Where the weights are here, checked against the recorded fingerprint (exit 3 if not)."""
    recorded = engine.model
    load_format = engine.engine_args.get("load_format")
    if model is None:
        model = recorded.path
        if not Path(model).exists() and recorded.weights_fingerprint == vllm_engine.weights_fingerprint(
            tiny_model_path(), load_format
        ):
            model = tiny_model_path()  # recorded on another machine with tracekit's embedded model
    if recorded.weights_fingerprint is None or allow_weights_mismatch:
        return model
    if not Path(model).exists():
        raise CannotRunHere(f"model weights not found at {model}; pass --model PATH")
    here = vllm_engine.weights_fingerprint(model, load_format)
    if here != recorded.weights_fingerprint:
        raise CannotRunHere(
            f"weights at {model} differ from the recorded ones ({here} vs {recorded.weights_fingerprint}); "
            "pass --allow-weights-mismatch to replay anyway"
        )
    return model


def build_replay_engine(
    engine: EngineConfig, model: str | None, allow_weights_mismatch: bool, overrides: dict[str, Any]
) -> Any:
    """The engine a bundle was recorded with, rebuilt here (weights checked: exit 3 if not)."""
    args = dict(engine.engine_args)
    args["model"] = resolve_model(engine, model, allow_weights_mismatch)
    if args.get("tokenizer") == engine.model.path:
        args["tokenizer"] = args["model"]
    if overrides.get("enforce_eager"):
        args["compilation_config"] = {**args.get("compilation_config", {}), "mode": 0}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return vllm_engine.build_llm({**args, **overrides}, engine.runner)


def replay(
    bundle: str | Path,
    *,
    step: int | None = None,
    model: str | None = None,
    allow_weights_mismatch: bool = False,
    engine_overrides: dict[str, Any] | None = None,
    modes: str | None = None,
    iters: int = 10,
    samples: int = 3,
    warmup_s: float = 0.5,
    tolerance: float = 0.0,
    llm: Any = None,
    layers_out: str | Path | None = None,
    strict: bool = False,
    profile_prefix: str | Path | None = None,
) -> ReplayResult:
    """Replay one recorded step. Pass `llm` (a previous result's `.llm`) to reuse an engine
    built for the same engine arguments. `modes`: None (check only), "reference" (also time the
    forward as the engine ran it), a mode, or "all". `layers_out`: also run the step eagerly
    capturing every layer's output, into a bundle there. A bundle recorded with `--layers` is
    always checked layer by layer against such an eager forward. `strict`: the exit code is 0
    for a bit-exact replay only. With `profile_prefix`, each timed mode's forwards are also
    traced with the torch profiler into `{profile_prefix}.{mode}.trace.json`."""
    content, recorded = load_step(bundle, step)
    if content.parallel.multi_rank:
        raise UsageError(
            f"{bundle} is rank {content.parallel.rank} of a {content.parallel.world_size}-rank step: "
            "replay it with tracekit.replay.multirank.replay_rank_set (the CLI does)"
        )
    explicit_modes = expand_modes(modes) if modes not in (None, "reference") else []
    require_same_series(content.engine.vllm_version)
    if llm is not None and (engine_overrides or model):
        raise UsageError("engine overrides and --model apply when the engine is built; not with a reused llm")
    overrides = dict(engine_overrides or {})
    if llm is None:
        llm = build_replay_engine(content.engine, model, allow_weights_mismatch, overrides)
    runner = vllm_engine.find_runner(llm)
    built = adapter_for(runner).kind
    if built != content.engine.runner:
        raise UsageError(
            f"the bundle was recorded on vLLM's {content.engine.runner.upper()} model runner; the engine "
            f"passed in runs {built.upper()}: build it with VLLM_USE_V2_MODEL_RUNNER="
            f"{runner_env(content.engine.runner)['VLLM_USE_V2_MODEL_RUNNER']}"
        )
    # Read after the engine is built: vLLM sets some variables of its own in every process.
    here = runner_environment(runner)
    layout_problem = kv_layout_difference(content.environment.attention_backend, here.attention_backend)
    if layout_problem is not None:
        raise CannotRunHere(layout_problem)
    differences = [
        {"field": name, "recorded": before, "here": now, "affects_numerics": numeric}
        for name, before, now, numeric in environment_differences(
            content.environment, here
        )
    ]
    reference_mode = "eager" if int(runner.compilation_config.mode) == 0 else "compiled"
    requested = [reference_mode] if modes == "reference" else explicit_modes
    # Graph modes need an engine of their own (vLLM's graphs off, or tracekit's piecewise
    # backend); where the device has no graphs, measure_mode reports why they cannot run, and
    # the piecewise engine still compiles its pieces for the per-piece divergence probe.
    has_graphs = get_device_backend(runner.device).has_graphs
    own_engine_modes = [m for m in requested if m in GRAPH_MODES and (has_graphs or m == "piecewise")]
    measured: dict[str, dict[str, Any]] = {}
    recorded_layers = recorded.outputs.layers if recorded.outputs is not None else {}
    captured_layers: dict[str, Any] = {}

    def on_forward(handle: ForwardHandle) -> None:
        if layers_out is not None or recorded_layers:
            capture = layer_capture.capture_eager_forward(runner, handle)
            if capture.failure is not None:
                raise CannotRunHere(f"per-layer capture failed: {capture.failure}")
            captured_layers.update(capture.outputs)
        for mode in requested:
            if mode == "compiled" and reference_mode == "eager":
                measured[mode] = {"mode": mode, "available": False, "reason": (
                    "the engine runs without torch.compile (compilation mode NONE); "
                    "record with compilation enabled to time it compiled")}
            elif mode not in own_engine_modes:
                measured[mode] = _measure(mode, handle, recorded, iters, samples, warmup_s,
                                          trace_to=trace_path(profile_prefix, mode))

    driver = StepDriver(runner, recorded)
    try:
        if recorded.error is not None:
            checks = [_replay_failing_step(driver, recorded.error)]
        else:
            wants_forward = requested or layers_out is not None or recorded_layers
            observed = driver.run(on_forward if wants_forward else None)
            checks = check_step(observed, recorded, tolerance)
    finally:
        llm.reset_prefix_cache()
    if own_engine_modes:
        engine_args = vllm_engine.engine_args_from_config(runner.vllm_config)
        vllm_engine.release_llm(llm)
        llm = None
        for mode in own_engine_modes:
            measured[mode] = _measure_in_own_engine(
                mode, engine_args, content.engine.runner, recorded, iters, samples, warmup_s,
                trace_path(profile_prefix, mode), has_graphs=has_graphs,
            )
    return ReplayResult(
        bundle=str(bundle),
        step_index=recorded.index,
        trigger=recorded.trigger,
        reference_mode=reference_mode,
        checks=checks,
        modes=measured,
        recorded_timing=recorded.timing.to_plain(),
        replay_forward_us=observed.forward_us if recorded.error is None else None,
        environment_differences=differences,
        overrides=overrides,
        notes=_kv_notes(recorded),
        tolerance=tolerance,
        strict=strict,
        error_step=recorded.error is not None,
        layer_checks=check_layers(captured_layers, recorded_layers, tolerance) if recorded_layers else [],
        layers_bundle=(
            str(write_layers_bundle(layers_out, here, content.engine, recorded, captured_layers))
            if layers_out is not None and recorded.error is None else None
        ),
        llm=llm,
    )


def _replay_failing_step(driver: StepDriver, recorded_error: dict[str, Any]) -> CheckedItem:
    """A step recorded because it raised (in its forward, logits, sampling or bookkeeping)
    reproduces when it raises the same again."""
    recorded = {"recorded": f"{recorded_error.get('type')}: {recorded_error.get('message')}",
                "recorded_phase": recorded_error.get("phase", "forward")}
    try:
        driver.run()
    except Exception as error:  # the step's own failure, reproduced or not
        same = type(error).__name__ == recorded_error.get("type") and str(error) == recorded_error.get("message")
        return CheckedItem("error", same, same, {"raised": f"{type(error).__name__}: {error}", **recorded})
    return CheckedItem("error", False, False, {"raised": None, "problem": "the step did not raise", **recorded})


def _kv_notes(step: Step) -> list[str]:
    """Why a replay may not match before it runs: KV blocks the step read that the bundle lacks."""
    missing = sum(len(set(group.read_block_ids) - set(group.saved_block_ids)) for group in step.kv.groups)
    if not missing:
        return []
    return [
        f"the bundle saved KV blocks in mode {step.kv.mode!r}: {missing} block(s) the step read are "
        "not in it, so their contents here are whatever the rebuilt engine holds"
    ]


def _measure(mode: str, handle: ForwardHandle, recorded: Step, iters: int, samples: int, warmup_s: float,
             piecewise: Any = None, trace_to: Path | None = None) -> dict[str, Any]:
    """Time the step's forward in `mode` and compare its output with the recorded one."""
    handle.restore()
    return measure_mode(
        mode,
        lambda eager=(mode == "eager"): handle.forward(eager=eager),
        handle.state_views(),
        recorded.outputs.hidden_states if recorded.outputs else None,
        get_device_backend(handle.device),
        iters,
        samples,
        warmup_s,
        piecewise=piecewise,
        trace_to=trace_to,
    )


def _measure_in_own_engine(
    mode: str, engine_args: dict[str, Any], runner_kind: str, recorded: Step, iters: int, samples: int,
    warmup_s: float, trace_to: Path | None = None, has_graphs: bool = True,
) -> dict[str, Any]:
    """"graph": the recorded compilation with vLLM's own graphs off, the step captured one-shot.
    "piecewise": tracekit's piecewise backend capturing the recorded capture sizes plus this
    step's token count (vLLM does not pad without its graphs), so the step itself replays a graph;
    then one more forward under the divergence probe, every piece against its eager FX module.
    Without graphs (CPU) the pieces are only compiled (Inductor, once for any size): the mode is
    not timed, but the probe still says which piece the compiler changed."""
    from tracekit.graphs import divergence
    from tracekit.graphs.capture_table import CaptureTable
    from tracekit.integrations.vllm import graph_backend

    dispatch = recorded.graph
    if has_graphs:
        table = CaptureTable(
            mode="piecewise",
            capture_sizes=tuple(sorted({*dispatch.capture_sizes, dispatch.num_tokens})),
            compile_sizes=tuple(dispatch.compile_sizes),
            num_warmups=max(dispatch.num_warmups or 0, 1),
        )
    else:  # each piece compiled once, for the symbolic token count (its "general" form)
        table = CaptureTable(mode="none", capture_sizes=(), compile_sizes=())
    compilation = {**engine_args.get("compilation_config", {}), **graph_backend.compilation_config_for(mode, table)}
    # An eager recording's enforce_eager would switch the piecewise backend's compilation off.
    eager = {"enforce_eager": False} if mode == "piecewise" else {}
    llm = vllm_engine.build_llm({**engine_args, **eager, "compilation_config": compilation}, runner_kind)
    report: dict[str, Any] = {}
    try:
        def measure(handle: ForwardHandle) -> None:
            backend = graph_backend.built_backends[-1] if mode == "piecewise" and graph_backend.built_backends else None
            report.update(_measure(mode, handle, recorded, iters, samples, warmup_s, piecewise=backend,
                                   trace_to=trace_to))
            if backend is not None:
                handle.restore()
                with divergence.probe(backend) as probed:
                    handle.forward()
                report["divergence"] = {
                    "pieces_compiled_with": "inductor", "pieces_captured": has_graphs, **probed.to_plain(),
                }

        StepDriver(vllm_engine.find_runner(llm), recorded).run(measure)
    finally:
        vllm_engine.release_llm(llm)
    return report
