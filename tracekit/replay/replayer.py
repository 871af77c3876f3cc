"""`replay(bundle)`: rebuild the engine a bundle describes, run its step, check it, time it.

The order matters for the exit codes a `git bisect run` relies on: the bundle is read and
validated first (bad input: 2), then this machine is checked — device, vLLM series, weights —
(cannot replay here: 3), and only then does the step run (did not reproduce: 1; reproduced: 0).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.environment import environment_differences
from tracekit.errors import BundleError, CannotRunHere, TracekitError, UsageError, one_line
from tracekit.format.content import load_step
from tracekit.format.schema import KV_MODES, KVMode, Step
from tracekit.graphs.modes import OWN_ENGINE_MODES, ReplayMode, expand_modes
from tracekit.graphs.profiling import trace_path
from tracekit.integrations.vllm import engine as vllm_engine
from tracekit.integrations.vllm import layer_capture, lean_build
from tracekit.integrations.vllm.platform_facts import kv_layout_difference
from tracekit.integrations.vllm.step_driver import ForwardHandle, StepDriver, unknown_tokens_to_recompute
from tracekit.integrations.vllm.version import release_to_replay
from tracekit.replay import dispatch as dispatch_audit
from tracekit.replay.checks import CheckedItem, check_layers, check_step, padding_findings
from tracekit.replay.engine import EngineNeeds, build_replay_engine, needs_of, require_device_of
from tracekit.replay.layers_bundle import write_layers_bundle
from tracekit.replay.result import ReplayResult
from tracekit.replay.timed_modes import compare_with_recorded, measure, measure_in_own_engine, mode_agreement
from tracekit.replay.verdict import ERROR_ITEM

__all__ = ["ReplayOptions", "ReplayResult", "replay"]


@dataclass
class ReplayOptions:
    """How to replay a bundle. `modes`: None (check only), "reference" (also time the forward
    as the engine ran it), a mode, or "all". `layers_out`: also run the step eagerly capturing
    every layer's output, into a bundle there (a bundle recorded with `--layers` is always
    checked layer by layer against such an eager forward). `strict`: the exit code is 0 for a
    bit-exact replay only. `profile_prefix`: each timed mode's forwards are also traced with the
    torch profiler into `{profile_prefix}.{mode}.trace.json`. `full_engine`: build the engine as vLLM
    builds it (every graph and compile size) instead of a lean one with what the step needs;
    `engine_needs`: what the lean engine must hold (a suite passes its group's; default: this
    step's, and what `modes` asks)."""

    step: int | None = None
    model: str | None = None
    allow_weights_mismatch: bool = False
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    modes: str | None = None
    iters: int = 10
    samples: int = 3
    warmup_s: float = 0.5
    tolerance: float = 0.0
    strict: bool = False
    layers_out: str | Path | None = None
    profile_prefix: str | Path | None = None
    full_engine: bool = False
    engine_needs: EngineNeeds | None = None


def replay(bundle: str | Path, options: ReplayOptions | None = None, *, llm: Any = None, **fields: Any) -> ReplayResult:
    """Replay one recorded step (options as a `ReplayOptions`, or its fields as keywords). Pass
    `llm` (a previous result's `.llm`) to reuse an engine built for the same engine arguments."""
    options = options or ReplayOptions(**fields)
    content, recorded = load_step(bundle, options.step)
    if recorded.kv.mode not in KV_MODES:
        raise CannotRunHere(f"the bundle's KV mode {recorded.kv.mode!r} is not one this tracekit replays: upgrade tracekit")
    if content.parallel.multi_rank:
        raise UsageError(
            f"{bundle} is rank {content.parallel.rank} of a {content.parallel.world_size}-rank step: "
            "replay it with tracekit.replay.multirank.replay_rank_set (the CLI does)"
        )
    if recorded.kv.mode == KVMode.RECOMPUTE.value and (unknown := unknown_tokens_to_recompute(recorded)):
        raise BundleError(
            f"{bundle}: its KV is to be recomputed, but {unknown} of the token ids before step {recorded.index} "
            "are not in the bundle (vLLM's V1 runner under async scheduling never holds the ids it sampled; the "
            "recorder keeps them only for requests it saw start, and tracekit before 2026-12-04 not at all): "
            "record with the KV (--kv restore), or arm the recorder before the requests arrive, or on Model "
            "Runner V2, or with async scheduling off"
        )
    explicit_modes = expand_modes(options.modes) if options.modes not in (None, "reference") else []
    require_device_of(content.environment)
    release = release_to_replay(content.engine.vllm_version)
    releases = None
    if release.recorded_elsewhere(content.engine.vllm_version):  # a replay across releases
        release.require_takes(recorded, content.engine)
        releases = (content.engine.vllm_version, release.version)
    if llm is not None and (options.engine_overrides or options.model):
        raise UsageError("engine overrides and --model apply when the engine is built; not with a reused llm")
    built = llm is None
    if built:
        lean = None if options.full_engine else (options.engine_needs or needs_of(recorded, options.modes))
        llm = build_replay_engine(content.engine, options.model, options.allow_weights_mismatch, options.engine_overrides,
                                  recorded=content.environment, lean=lean)
    engine_build = lean_build.build_of(llm)
    if not built and engine_build is not None and engine_build.kind == "lean":
        missing = needs_of(recorded, options.modes).graphs - set(engine_build.graphs_wanted)
        if missing:
            raise UsageError(
                f"the engine passed in is lean, built without the graphs this step needs ({sorted(missing)}): "
                "build it with ReplayOptions(engine_needs=...) covering every step it replays, or full_engine=True"
            )
    adapter = vllm_engine.adapter_of(llm)
    if adapter.kind != content.engine.runner:
        variable, value = next(iter(release.runner_env(content.engine.runner).items()))
        raise UsageError(
            f"the bundle was recorded on vLLM's {content.engine.runner.upper()} model runner; the engine "
            f"passed in runs {adapter.kind.value.upper()}: build it with {variable}={value}"
        )
    # Read after the engine is built: vLLM sets some variables of its own in every process.
    here = adapter.environment()
    layout_problem = kv_layout_difference(content.environment.attention_backend, here.attention_backend)
    if layout_problem is not None:
        raise CannotRunHere(layout_problem)
    ours = {**vllm_engine.IN_PROCESS_ENV, **release.runner_env(content.engine.runner),
            **(engine_build.env if engine_build is not None else {})}
    differences = [
        {"field": name, "recorded": before, "here": now, "affects_numerics": numeric}
        for name, before, now, numeric in environment_differences(content.environment, here)
        if not (name.startswith("env ") and ours.get(name.removeprefix("env ")) == now)  # tracekit's own settings
    ]
    reference_mode = adapter.reference_mode
    requested = [reference_mode] if options.modes == "reference" else explicit_modes
    # Graph modes need an engine of their own (vLLM's graphs off, or tracekit's piecewise
    # backend); where the device has no graphs, measure_mode reports why they cannot run, and
    # the piecewise engine still compiles its pieces for the per-piece divergence probe.
    has_graphs = adapter.device_backend.has_graphs
    own_engine_modes = [m for m in requested if m in OWN_ENGINE_MODES and (has_graphs or m == "piecewise")]
    measured: dict[str, dict[str, Any]] = {}
    recorded_layers = recorded.outputs.layers if recorded.outputs is not None else {}
    captured_layers: dict[str, Any] = {}

    def on_forward(handle: ForwardHandle) -> None:
        if options.layers_out is not None or recorded_layers:
            capture = layer_capture.capture_eager_forward(adapter.model, handle)
            if capture.failure is not None:
                raise CannotRunHere(f"per-layer capture failed: {capture.failure}")
            captured_layers.update(capture.outputs)
        for mode in requested:
            if mode in (ReplayMode.COMPILED.value, ReplayMode.COMPILED_NO_GRAPH.value) and reference_mode == "eager":
                measured[mode] = {"mode": mode, "available": False, "reason": (
                    "the engine runs without torch.compile (compilation mode NONE); "
                    "record with compilation enabled to time it compiled")}
            elif mode not in own_engine_modes:
                measured[mode] = measure(mode, handle, recorded, options.iters, options.samples, options.warmup_s,
                                         trace_to=trace_path(options.profile_prefix, mode))

    driver = StepDriver(adapter, recorded)
    observed = None
    try:
        if recorded.error is not None:
            checks = [_replay_failing_step(driver, recorded.error)]
        else:
            wants_forward = requested or options.layers_out is not None or recorded_layers
            try:
                observed = driver.run(on_forward if wants_forward else None)
            except Exception as error:  # under another release, a step that raises is an outcome
                if releases is None or isinstance(error, TracekitError):
                    raise
                checks = [CheckedItem(ERROR_ITEM, False, False, {"raised": one_line(error), "recorded": None})]
            else:
                checks = check_step(observed, recorded, options.tolerance)
    finally:
        vllm_engine.forget_cached_prefixes(llm)
    if own_engine_modes:
        engine_args = adapter.settings()
        vllm_engine.release_llm(llm)
        llm = None
        for mode in own_engine_modes:
            measured[mode] = measure_in_own_engine(
                mode, engine_args, content.engine.runner, recorded, options.iters, options.samples,
                options.warmup_s, trace_path(options.profile_prefix, mode), has_graphs=has_graphs,
            )
    recorded_timing = recorded.timing.to_plain()
    audited = dispatch_audit.audit(recorded.graph, observed.dispatch) if observed is not None else {}
    notes = (_kv_notes(recorded) + _dispatch_notes(audited) + _autotuning_notes(content, reference_mode, checks)
             + compare_with_recorded(measured, recorded_timing))
    return ReplayResult(
        bundle=str(bundle),
        step_index=recorded.index,
        trigger=recorded.trigger,
        reference_mode=reference_mode,
        checks=checks,
        modes=measured,
        recorded_timing=recorded_timing,
        replay_forward_us=observed.forward_us if observed is not None else None,
        environment_differences=differences,
        overrides=dict(options.engine_overrides),
        notes=notes,
        tolerance=options.tolerance,
        strict=options.strict,
        error_step=recorded.error is not None,
        kv_recomputed=recorded.kv.mode == KVMode.RECOMPUTE.value,
        layer_checks=check_layers(captured_layers, recorded_layers, options.tolerance) if recorded_layers else [],
        layers_bundle=(
            str(write_layers_bundle(options.layers_out, here, content.engine, recorded, captured_layers))
            if options.layers_out is not None and recorded.error is None else None
        ),
        dispatch=audited,
        padding_findings=padding_findings(observed, recorded) if observed is not None else [],
        mode_agreement=mode_agreement(measured),
        engine_build={**engine_build.to_plain(), "built_for_this_step": built} if engine_build is not None else None,
        releases=releases,
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
        same = driver.step.raised_as_recorded(error)
        return CheckedItem(ERROR_ITEM, same, same, {"raised": f"{type(error).__name__}: {error}", **recorded})
    return CheckedItem(ERROR_ITEM, False, False, {"raised": None, "problem": "the step did not raise", **recorded})


def _kv_notes(step: Step) -> list[str]:
    """Why a replay may not match before it runs: KV blocks the step read that the bundle lacks,
    or recomputed rather than restored."""
    if step.kv.mode == KVMode.RECOMPUTE.value:
        return [
            "KV recomputed, not restored: the bundle saved no KV blocks (recorded with --kv recompute, or its "
            "device context was lost), so the replay rebuilt the blocks the step reads by prefilling its "
            "requests' recorded tokens; a prefill may round otherwise than the steps that first wrote them"
        ]
    missing = sum(len(set(group.read_block_ids) - set(group.saved_block_ids)) for group in step.kv.groups)
    if not missing:
        return []
    return [
        f"the bundle saved KV blocks in mode {step.kv.mode!r}: {missing} block(s) the step read are "
        "not in it, so their contents here are whatever the rebuilt engine holds"
    ]


def _autotuning_notes(content: Any, reference_mode: str, checks: list[CheckedItem]) -> list[str]:
    """Why a compiled step may part by float rounding alone: the recording engine's Inductor chose
    kernel configs by timing them, which no other process repeats."""
    deciding = [check for check in checks if check.decides]
    if (reference_mode != "compiled" or content.environment.device_kind == "cpu" or all(check.bit_exact for check in deciding)
            or any(not check.bit_exact and check.float_dtype is None for check in deciding)
            or content.environment.env_vars.get("TORCHINDUCTOR_DETERMINISTIC") == "1"):
        return []
    return [
        "only float items parted, in a compiled step of an engine that let Inductor pick kernel configs by "
        "timing them in each process, which changes float rounding: two runs of such an engine part alike "
        "(seen with float32 on an H200). Record with TORCHINDUCTOR_DETERMINISTIC=1 to replay compiled steps "
        "bit-exact (the replay sets it from the bundle)"
    ]


def _dispatch_notes(audited: dict[str, Any]) -> list[str]:
    if not audited or dispatch_audit.same_graph(audited):
        return []
    return [
        "the replay could not run the step through the recorded dispatch: "
        + "; ".join(line for line in audited["differences"] if line.split(":")[0] in dispatch_audit.STEP_FIELDS)
    ]

