"""`replay(bundle)`: rebuild the engine a bundle describes, run its steps, check them, time them.

The replay runs in stages, each a function with one job:

    open_step -> checked_before_engine (this machine) -> engine_for -> run_and_compare
    -> time_in_own_engines (`timed_modes`) -> report

A bundle's N >= 1 steps run one after the other with the runner carrying its state, each
checked; several are not timed (docs/GUIDE.md, "Windows", for `--from`).

The order matters for the exit codes a `git bisect run` relies on: the bundle is read and
validated first (bad input: 2), then this machine is checked — device, vLLM series, weights, the
engine's KV layout — (cannot replay here: 3), and only then does the step run (did not
reproduce: 1; reproduced: 0).
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.environment import environment_records
from tracekit.errors import BundleError, CannotRunHere, TracekitError, UsageError, one_line
from tracekit.format.content import write_steps
from tracekit.format.schema import KV_MODES, BundleContent, KVMode, KVSnapshot, Step, StepOutputs, StepTiming
from tracekit.graphs import kernel_choices
from tracekit.graphs.modes import OWN_ENGINE_MODES, expand_modes
from tracekit.integrations.vllm.replay_engine import (
    EngineSpec,
    ForwardHandle,
    ReplayEngine,
    WindowStep,
    build_replay_engine,
    engine_of,
    expand_window,
    locate_lora_adapters,
    needs_of,
    require_drafting_known,
    require_recomputable,
    require_replayable_here,
    require_replayable_kind,
    sampler_change,
)
from tracekit.replay import dispatch as dispatch_audit
from tracekit.replay.checks import ERROR_ITEM, CheckedItem, check_layers, check_step, error_item, padding_findings
from tracekit.replay.kv_sources import kv_sources
from tracekit.replay.opened import OpenedBundle
from tracekit.replay.options import ReplayOptions, options_from
from tracekit.replay.repeats import Repeats, repeat_here, repeat_in_fresh_process
from tracekit.replay.result import ReplayResult, SequenceFacts
from tracekit.replay.timed_modes import compare_with_recorded, measure, mode_agreement, time_in_own_engines
from tracekit.replay.verdict import VerdictName

__all__ = ["ReplayOptions", "ReplayResult", "replay"]


def replay(bundle: str | Path | OpenedBundle, options: ReplayOptions | None = None, *, llm: Any = None,
           **fields: Any) -> ReplayResult:
    """Replay a bundle's steps (options as a `ReplayOptions`, its fields as keywords, or both). Pass
    `llm` (a previous result's `.llm`) to reuse an engine built for the same engine arguments,
    and an `OpenedBundle` for a bundle the caller opened already."""
    options = options_from(options, fields)
    opened = checked_before_engine(bundle, options)
    choices = opened.content.engine.kernel_choices if options.kernel_choices is None else options.kernel_choices
    with locate_lora_adapters(opened.step, options.lora_paths, options.allow_weights_mismatch) as adapters:
        # Inductor's kernels are built with the engine and autotuned at their first launch: under
        # the recorded choices.
        with kernel_choices.choices_applied(choices) as pinned:
            engine = engine_for(opened, options, llm, compile_here=bool(choices))
            here = engine.environment()
            engine.require_kv_layout_of(opened.content.environment, here)
            ran = run_and_compare(engine, opened, options, adapters.paths)
        if ran.own_engine_modes:
            ran.measured.update(time_in_own_engines(engine, opened.content.engine, opened.step, ran.own_engine_modes,
                                                    options, adapters.paths))
    result = report(opened, options, engine, here, ran, pinned)
    # A diverged step whose replays here agreed among themselves (where they did not, that is told
    # already) is replayed again in a fresh process.
    if (result.repeats is not None and options.repeat_fresh and result.repeats.disagreement() is None
            and result.verdict.name == VerdictName.DIVERGED):
        if here.device_kind != "cpu" and engine.llm is not None:  # a device holds one engine at a time
            engine.release()
            result.llm = None
        repeat_in_fresh_process(result.repeats, opened.bundle,
                                {name: getattr(options, name) for name in _FRESH_PROCESS_FIELDS})
    return result


def replay_candidate(engine: ReplayEngine, content: BundleContent, step: Step, *, from_step: int | None = None,
                     until: int | None = None, keep_kv_read: bool = False,
                     lora_paths: dict[int, str] | None = None) -> ReplayResult:
    """Replay `step` (of `content`, not read from a file: a shrink's candidate) and the steps of
    its window on an engine the caller holds, checked bit-exact, not timed and not repeated, each
    step's result keeping what its forward produced (`until`, `keep_kv_read`: see `run_and_compare`)."""
    options = ReplayOptions(modes=None, from_step=from_step, repeats=0)
    steps = expand_window(step, content)
    opened = OpenedStep("candidate", content, step, [], steps, rebuilt_steps(steps, from_step))
    ran = run_and_compare(engine, opened, options, lora_paths or {}, until, keep_kv_read)
    result = report(opened, options, engine, engine.environment(), ran, kernel_choices.ChoicesApplied())
    for step_result in [result, *result.later]:
        step_result.observed = ran.observed.get(step_result.step_index)
    return result


@dataclass
class OpenedStep:
    """The steps a replay runs, read and validated: the bundle (as named), its content, its first
    step, and every step whole (`expand_window`: the first alone for a single step)."""

    bundle: str
    content: BundleContent
    step: Step
    explicit_modes: list[str]  # the modes `--mode` names, expanded (none for reference timing)
    steps: list[WindowStep]
    rebuilt: set[int]  # the steps whose runner state the replay rebuilds (`rebuilt_steps`)
    # (recorded, here) vLLM versions where the step was recorded under another release series
    releases: tuple[str, str] | None = None


def open_step(bundle: str | Path | OpenedBundle, options: ReplayOptions) -> OpenedStep:
    """Read the bundle's step and refuse what no machine could replay (bad input or usage: 2; a
    KV mode of a newer tracekit: 3; a step that used what tracekit cannot replay yet: 5)."""
    opened = OpenedBundle.of(bundle)
    name = str(opened.path)
    content, step = opened.content, opened.load_step(options.step)
    if step.kv.mode not in KV_MODES:
        raise CannotRunHere(f"the bundle's KV mode {step.kv.mode!r} is not one this tracekit replays: upgrade tracekit")
    if content.parallel.multi_rank:
        raise UsageError(
            f"{name} is rank {content.parallel.rank} of a {content.parallel.world_size}-rank step: "
            "replay it with tracekit.replay.multirank.replay_rank_set (the CLI does)"
        )
    require_replayable_kind(step)
    if step.kv.mode == KVMode.RECOMPUTE.value:
        require_recomputable(name, step)
    require_drafting_known(name, content, step, options.engine_overrides)
    disagreement = step.input_ids_disagreement()
    if disagreement is not None:
        raise BundleError(f"{name}: step {step.index}: {disagreement}, so no replay can read what it read: the "
                          "recording is inconsistent (a tracekit fault: record the step again with this tracekit)")
    explicit_modes = expand_modes(options.modes) if options.modes not in (None, "reference") else []
    steps = expand_window(step, content)
    several = len(steps) > 1
    if several and (explicit_modes or options.layers_out is not None or options.profile_prefix is not None):
        raise UsageError(f"{name} holds a window of steps, replayed step after step and checked, not timed: "
                         "--mode, --layers and --profile apply to a single step")
    if options.from_step is not None and not several:
        raise UsageError(f"--from {options.from_step}: {name} holds a single step, not a window of steps")
    return OpenedStep(name, content, step, explicit_modes, steps, rebuilt_steps(steps, options.from_step))


def rebuilt_steps(steps: list[WindowStep], from_step: int | None) -> set[int]:
    """The steps whose runner state a replay rebuilds: the first, and `from_step` (a usage error
    when it is no step of the bundle)."""
    indices = [each.index for each in steps]
    if from_step is not None and from_step not in indices:
        raise UsageError(f"--from {from_step} is not a step of the window (its steps are {indices[0]}..{indices[-1]})")
    return {indices[0]} | ({from_step} if from_step is not None else set())


def checked_before_engine(bundle: str | Path | OpenedBundle, options: ReplayOptions) -> OpenedStep:
    """Every check a replay makes before it builds an engine, in the order the module's docstring
    gives (a replay across releases is noted), and what a lean engine must hold for the step.
    `replay` starts with it; tools/fuzz_bundle.py runs it alone on hostile bundles, to stop where
    vLLM takes over."""
    opened = open_step(bundle, options)
    opened.releases = require_replayable_here(opened.content, opened.step)
    if opened.releases is not None and len(opened.steps) > 1:
        raise CannotRunHere(f"{opened.bundle} holds a window of steps, which replays only under the vLLM series that "
                            f"recorded it: install vLLM {opened.releases[0]} to replay it")
    if not options.full_engine and options.engine_needs is None:
        needs_of(opened.step, options.modes)
    return opened


def engine_for(opened: OpenedStep, options: ReplayOptions, llm: Any, compile_here: bool = False) -> ReplayEngine:
    """The engine the step runs on: `llm` if the caller passed one (it must fit the step), else
    built from the recording, lean unless `options.full_engine` (`compile_here`: kernel choices
    apply, so the build compiles its own code)."""
    runner_kind = opened.content.engine.runner
    if llm is not None:
        if options.engine_overrides or options.model:
            raise UsageError("engine overrides and --model shape an engine when it is built: pass them without llm, "
                             "or build the llm with them")
        engine = engine_of(llm, runner_kind, needs_of(opened.step, options.modes))
    else:
        needs = None if options.full_engine else (options.engine_needs or needs_of(opened.step, options.modes))
        engine = build_replay_engine(EngineSpec(
            opened.content.engine, recorded=opened.content.environment, model=options.model,
            allow_weights_mismatch=options.allow_weights_mismatch, overrides=options.engine_overrides, needs=needs,
            compile_here=compile_here,
        ))
    engine.require_runner_kind()
    return engine


@dataclass
class StepRun:
    """What running the steps gave: each step's checks and what the runner did, the modes timed
    on its engine (the first step's)."""

    reference_mode: str  # the mode the engine ran the forward in
    own_engine_modes: list[str]  # the modes still to time, each on an engine of its own
    checks: dict[int, list[CheckedItem]] = field(default_factory=dict)  # per step that ran
    observed: dict[int, Any] = field(default_factory=dict)  # the ObservedStep of each step that ran
    not_run: list[int] = field(default_factory=list)  # steps after one that raised
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    captured_layers: dict[str, Any] = field(default_factory=dict)
    kv_read: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # `SequenceFacts.kv_read`
    repeats: Repeats | None = None  # a single step that did not reproduce, replayed again (`options.repeats`)


def run_and_compare(engine: ReplayEngine, opened: OpenedStep, options: ReplayOptions,
                    lora_paths: dict[int, str], until: int | None = None, keep_kv_read: bool = False) -> StepRun:
    """Run the steps through the engine's runner (their LoRA adapters from `lora_paths`; up to
    `until`), compare each with the recording, and time on the way (`on_forward`) the modes that
    run on this engine; `keep_kv_read`: see `SequenceFacts.kv_read`."""
    step = opened.step
    requested = [engine.reference_mode] if options.modes == "reference" else opened.explicit_modes
    # Graph modes need an engine of their own (vLLM's graphs off, or tracekit's piecewise
    # backend); where the device has no graphs, measure_mode reports why they cannot run, and
    # the piecewise engine still compiles its pieces for the per-piece divergence probe.
    own_engine_modes = [m for m in requested if m in OWN_ENGINE_MODES and (engine.has_graphs or m == "piecewise")]
    recorded_layers = step.outputs.layers if step.outputs is not None else {}
    ran = StepRun(engine.reference_mode, own_engine_modes)

    def on_forward(handle: ForwardHandle) -> None:
        if options.layers_out is not None or recorded_layers:
            capture = engine.capture_layers(handle)
            if capture.failure is not None:
                raise CannotRunHere(f"per-layer capture failed: {capture.failure}")
            ran.captured_layers.update(capture.outputs)
        for mode in requested:
            reason = engine.unavailable_reason(mode)
            if reason is not None:
                ran.measured[mode] = {"mode": mode, "available": False, "reason": reason}
            elif mode not in own_engine_modes:
                ran.measured[mode] = measure(mode, handle, step, options)

    wants_forward = step.error is None and (requested or options.layers_out is not None or recorded_layers)
    try:
        run = engine.driver(opened.steps, lora_paths, rebuild=opened.rebuilt, until=until, keep_kv_read=keep_kv_read,
                            on_forward=on_forward if wants_forward else None).run()
    finally:
        engine.forget_cached_prefixes()
    failed_at, failure = run.failure if run.failure is not None else (None, None)
    for each in opened.steps:
        if each.index not in run.observed:
            continue  # past `until`
        if failed_at is not None and each.index > failed_at:
            ran.not_run.append(each.index)
        elif each.step.error is not None:
            ran.checks[each.index] = [error_item(each.step, failure if each.index == failed_at else None)]
        elif each.index == failed_at:
            # under another release, a step that raises is an outcome
            if opened.releases is None or isinstance(failure, TracekitError):
                raise failure  # not the recording's failure: the replay crashed
            ran.checks[each.index] = [CheckedItem(ERROR_ITEM, False, False, {"raised": one_line(failure),
                                                                             "recorded": None})]
        else:
            ran.observed[each.index] = observed = run.observed[each.index]
            ran.checks[each.index] = check_step(observed, each.step, options.tolerance,
                                                each.carried.kv_written if each.carried is not None else [])
            if observed.kv_read is not None:
                ran.kv_read[each.index] = observed.kv_read
    checks = ran.checks.get(step.index, [])
    if (options.repeats and len(opened.steps) == 1 and step.index in ran.observed
            and not all(item.within_tolerance for item in checks if item.decides)):
        ran.repeats = repeat_here(checks, lambda: _run_again(engine, opened, lora_paths, options.tolerance),
                                  options.repeats)
    return ran


def _run_again(engine: ReplayEngine, opened: OpenedStep, lora_paths: dict[int, str],
               tolerance: float) -> list[CheckedItem]:
    """The single step once more from the same restored state, checked (no timing, no layer capture)."""
    engine.forget_cached_prefixes()
    try:
        return check_step(engine.driver(opened.steps, lora_paths).run_one(), opened.step, tolerance)
    finally:
        engine.forget_cached_prefixes()


# The `ReplayOptions` fields that shape a step's replay (not its timing, layer capture or
# profiling), handed to the fresh process that replays it again.
_FRESH_PROCESS_FIELDS = ("step", "model", "allow_weights_mismatch", "engine_overrides", "tolerance", "full_engine",
                         "lora_paths", "repeats")


def report(opened: OpenedStep, options: ReplayOptions, engine: ReplayEngine, here: Any, ran: StepRun,
           pinned: kernel_choices.ChoicesApplied) -> ReplayResult:
    """The replay's result: each step's checks, dispatch audit and notes, timings beside the
    recorded one, the environment's differences from the recording, the per-layer bundle if
    asked; of several steps, the later ones and what the sequence was."""
    content = opened.content
    kernels = kernel_choices.compare(content.engine.kernel_choices, kernel_choices.launched_choices(), pinned)
    build = engine.build
    shared = dict(
        bundle=opened.bundle, reference_mode=ran.reference_mode,
        environment_differences=environment_records(content.environment, here, engine.set_in_process),
        overrides=dict(options.engine_overrides), tolerance=options.tolerance, strict=options.strict,
        engine_build={**build.to_plain(), "built_for_this_step": engine.built_here} if build is not None else None,
        kernel_choices=kernels, releases=opened.releases, llm=engine.llm,
        sampler_change=sampler_change(content) if opened.releases is not None else None,
    )
    results = [step_result(each.step, ran.observed.get(each.index), ran.checks[each.index], content, shared)
               for each in opened.steps if each.index in ran.checks]
    first = results[0]
    step = opened.step
    first.notes[:0] = _kv_notes(step)  # (a later step's KV is the one the steps before left)
    first.repeats = ran.repeats
    compare_with_recorded(ran.measured, first.recorded_timing)
    first.modes, first.mode_agreement = ran.measured, mode_agreement(ran.measured)
    if step.outputs is not None and step.outputs.layers:
        first.layer_checks = check_layers(ran.captured_layers, step.outputs.layers, options.tolerance)
    if options.layers_out is not None and step.error is None:
        first.layers_bundle = str(write_layers_bundle(options.layers_out, here, content, step, ran.captured_layers))
    return ReplayResult.of_steps(results, SequenceFacts(
        requested=step.steps_requested,
        recorded=[each.index for each in opened.steps], rebuilt=sorted(opened.rebuilt), from_step=options.from_step,
        not_run=ran.not_run, kv_sources=kv_sources([each.step for each in opened.steps], results),
        kv_read=ran.kv_read,
    ))


def write_layers_bundle(path: str | Path, here: Any, content: BundleContent, step: Step,
                        layers: dict[str, Any]) -> Path:
    """`--save-layers OUT`: a small bundle of the step's metadata with this machine's environment and,
    as outputs, only an eager forward's per-layer outputs (no KV blocks or RNG states: what makes a
    bundle large), named as `record --layers` names them, so that `tracekit diff` pairs it with
    another such bundle, or with a recording, and names the first layer that parts."""
    groups = [dataclasses.replace(group, saved_block_ids=[], before={}, after={}) for group in step.kv.groups]
    layers_step = dataclasses.replace(
        step, kv=KVSnapshot(mode="none", groups=groups), rng={}, outputs=StepOutputs(layers=dict(layers)),
        timing=StepTiming(), extras={**step.extras, "layers_from": "eager replay (tracekit replay --layers)"},
    )
    return write_steps(Path(path), here, content.engine, [layers_step])


def step_result(step: Step, observed: Any, checks: list[CheckedItem], content: BundleContent,
                shared: dict[str, Any]) -> ReplayResult:
    """One step's result: its checks, dispatch audit and notes (`shared`: the fields every step of
    the replay shares, its kernel comparisons among them)."""
    ran = observed is not None and observed.dispatch is not None
    audited = dispatch_audit.audit(step.graph, observed.dispatch) if ran else {}
    notes = _kernel_notes(content, shared["reference_mode"], checks, shared["kernel_choices"])
    if audited and not dispatch_audit.same_graph(audited):
        notes[:0] = ["the replay could not run the step through the recorded dispatch: " + "; ".join(
            line for line in audited["differences"] if line.split(":")[0] in dispatch_audit.STEP_FIELDS)]
    return ReplayResult(
        step_index=step.index,
        trigger=step.trigger,
        checks=checks,
        recorded_timing=step.timing.to_plain(),
        replay_forward_us=observed.forward_us if observed is not None else None,
        notes=notes,
        error_step=step.error is not None,
        kv_recomputed=step.kv.mode == KVMode.RECOMPUTE.value,
        dispatch=audited,
        padding_findings=padding_findings(observed, step) if ran else [],
        **shared,
    )


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


# What `_kernel_notes` says of each kind of kernel `kernel_choices.compare` finds, and how it joins them.
_KERNEL_FINDINGS = (
    ("other", "Inductor's kernels ran with another configuration than recorded (a reduction's block sizes decide "
              "its rounding): ", "; "),
    ("several", "copies of one Inductor kernel source ran with several configurations (one copy per compiled graph "
                "whose kernels came back from Inductor's compile workers) and could not all be told apart by the "
                "graph binding each, so some may have run with another configuration than recorded: ", "; "),
    ("unapplied", "copies this replay could not give their recorded configuration: ", "; "),
    ("unrecorded", "Inductor's kernels autotuned here, no choice recorded: ", ", "),
)


def _kernel_notes(content: BundleContent, reference_mode: str, checks: list[CheckedItem],
                  kernels: dict[str, list[str]]) -> list[str]:
    """Where a compiled step parted by float rounding alone, what its Triton kernels had to do
    with it: Inductor's kernels that ran with other configurations than recorded or were
    autotuned here with none recorded are named; where every kernel ran as recorded, they are
    ruled out."""
    deciding = [check for check in checks if check.decides]
    if (reference_mode != "compiled" or all(check.bit_exact for check in deciding)
            or any(not check.bit_exact and check.float_dtype is None and not check.digest_only for check in deciding)):
        return []
    named = [text + joiner.join(kernels[kind]) for kind, text, joiner in _KERNEL_FINDINGS if kernels.get(kind)]
    if named:
        return ["only float items parted, and not every kernel ran as recorded: " + "; ".join(named)]
    recorded = content.engine.kernel_choices
    if recorded and not kernels.get("same"):
        return [f"only float items parted, in a compiled step; none of the {len(recorded)} kernel choices the "
                "bundle records met a kernel autotuned or configured in this process, so Inductor's configurations "
                "are neither named nor ruled out"]
    if recorded:
        return [f"only float items parted, in a compiled step, though every one of the {len(kernels['same'])} "
                "autotuned kernels ran with its recorded configuration: the rounding difference lies elsewhere "
                "(see dispatch and environment differences)"]
    return []
