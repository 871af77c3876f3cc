"""The human-readable report of what `tracekit replay` came to (`print_report`), of every kind:
one bundle in detail, a window of steps, a multi-rank step, a suite, a crash. On a terminal it
fits its width; piped, every line and table row is one unwrapped line (`terminal.console_for`)."""

from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from tracekit.cli.isolation import print_crash
from tracekit.cli.terminal import console_for, inert, table
from tracekit.errors import EXIT_NOT_REPRODUCED, EXIT_OK
from tracekit.replay import verdict as verdicts
from tracekit.replay.checks import KV_DIGEST_ITEM, LAYER_PREFIX
from tracekit.replay.kv_sources import describe
from tracekit.replay.multirank import RankSetReplayResult
from tracekit.replay.result import ReplayResult
from tracekit.replay.suite import SuiteOutcome, SuiteRecord
from tracekit.replay.verdict import VerdictName


def _ms(value: Any, places: int = 3) -> str:
    """A time in microseconds, shown in milliseconds ("-" where there is none)."""
    return f"{value / 1000:.{places}f}" if isinstance(value, (int, float)) else "-"


def _us(value: Any) -> str:
    """A time in microseconds, shown in milliseconds with its unit."""
    return "-" if _ms(value) == "-" else f"{_ms(value)} ms"


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else ("-" if value is None else str(value))


def describe_engine_build(build: dict[str, Any]) -> str:
    """`lean (captured FULL 8; compile sizes 8), built in 12.3 s` or `full (as vLLM builds it), ...`."""
    if build["kind"] == "full":
        what = "full (as vLLM builds it: every graph and compile size)"
    else:
        captured = build["graphs_captured"]
        graphs = "no graphs" if not captured else "captured " + ", ".join(f"{mode} {size}" for mode, size in captured)
        sizes = "" if build["compile_sizes"] is None else f"; compile sizes {build['compile_sizes'] or 'none'}"
        what = f"lean ({graphs}{sizes}; --full-engine builds it as vLLM does)"
    if not build.get("built_for_this_step", True):
        return f"{what}, reused"
    if build.get("seconds") is None:
        return what
    imports = f" ({build['import_seconds']:.1f} s of it importing vLLM)" if build.get("import_seconds") is not None else ""
    return f"{what}, built in {build['seconds']:.1f} s{imports}"


def _print_differences(console: Console, environment_differences: list[dict[str, Any]], overrides: dict[str, Any]) -> None:
    """How this machine differs from the recording one where that can change the numbers (the
    others are only counted: `--json` lists them all), and the engine arguments overridden."""
    numeric = [difference for difference in environment_differences if difference["affects_numerics"]]
    others = len(environment_differences) - len(numeric)
    if numeric:
        console.print("   differs from the recording machine where it can change the numbers:")
    for difference in numeric:
        console.print(f"     {inert(str(difference['field']))}: recorded {inert(repr(difference['recorded']))}, "
                      f"here {inert(repr(difference['here']))}")
    if others:
        console.print(f"   {others} other environment difference(s) that cannot change the numbers (--json lists them)")
    for name, value in overrides.items():
        console.print(f"   engine argument given here: {inert(name)} = {inert(repr(value))}")


def print_report(report: Any, stream: TextIO | None = None, needs: str | None = None) -> None:
    """What a replay came to (`ReplayOutcome.report`), by its kind; `needs`: the bundle's needs line."""
    if isinstance(report, dict):  # the record of a replay that broke off
        print_crash(report, stream)
    elif isinstance(report, SuiteOutcome):
        _print_suite(console_for(stream), report)
    elif isinstance(report, RankSetReplayResult):
        _print_rank_set(console_for(stream), report, needs)
    else:
        _print_replay(console_for(stream), report, needs)


def _print_replay(console: Console, result: ReplayResult, needs: str | None) -> None:
    """One replayed bundle: the verdict first, what the bundle needs, then what differs here, what
    matched and how fast it ran (of several steps: each step's row, then the first that parted)."""
    padding = any(item.is_padding for step in result.steps for item in step.checks)
    print_verdict(console, result.verdict, result.first_divergence, result.tolerance, padding)
    if needs:
        console.print(inert(needs))
    facts = result.sequence
    if result.several:
        carried = "rebuilt at " + ", ".join(map(str, facts.rebuilt)) + ", carried by the runner from step to step"
        console.print(f"[bold]replay[/bold] {inert(result.bundle)}  window of steps {facts.recorded[0]}.."
                      f"{facts.recorded[-1]} ({len(facts.recorded)} of {facts.requested} asked for; {carried})")
    else:
        console.print(f"[bold]replay[/bold] {inert(result.bundle)}  step {result.step_index} ({inert(result.trigger)})")
    if result.engine_build is not None:
        console.print(f"   engine: {inert(describe_engine_build(result.engine_build))}")
    _print_differences(console, result.environment_differences, result.overrides)
    step = next((step for step in result.steps if step.verdict.exit_code() != 0), result.steps[0])
    if result.several:
        _print_steps(console, result)
        if step.verdict.exit_code() == 0:
            return
        console.print(f"step {step.step_index}, where the window parts:")
    for note in step.notes:
        console.print(f"   note: {inert(note)}")
    _print_dispatch(console, step.dispatch, attention=not step.bit_exact)
    _print_checks(console, step, step.verdict)
    _print_not_deciding(console, step)
    _print_layers(console, step)
    _print_timing(console, step)
    _print_kv_sources(console, result)


def _dispatch_cell(audited: dict[str, Any]) -> str:
    """The step's graph mode and padded rows here, flagged where they differ from the recording."""
    here = audited.get("replayed") or {}
    if not here:
        return "-"
    shown = f"{here.get('runtime_mode')} {here.get('num_tokens_padded')}"
    return f"[yellow]{shown} (differs)[/yellow]" if audited.get("differences") else shown


def _print_steps(console: Console, result: ReplayResult) -> None:
    """One row per step of several."""
    steps = table(console, "steps vs recorded",
                  ["step", "state", "dispatch", "verdict", "first divergence", "forward ms recorded", "replayed"])
    for step in result.steps:
        steps.add_row(
            str(step.step_index), "rebuilt" if step.step_index in result.sequence.rebuilt else "carried",
            _dispatch_cell(step.dispatch), _verdict_cell(step.verdict.name.value, step.verdict.exit_code()),
            inert(step.first_divergence or "-"), _ms(step.recorded_timing.get("forward_us")),
            _ms(step.replay_forward_us),
        )
    for index in result.sequence.not_run:
        steps.add_row(str(index), "not run", "-", "-", "(after the step that raised)", "-", "-")
    console.print(steps)


KV_SOURCE_LINES = 12  # the most lines on where parted steps' KV came from (`--json` has them all)


def _print_kv_sources(console: Console, result: ReplayResult) -> None:
    """Of several steps, per parted step and request, where the KV it read came from: computed
    bit-exact (the step parts in itself), or by a step before it that parted."""
    lines = [f"   KV read: {inert(describe(index, req_id, source))}"
             for index, sources in sorted(result.sequence.kv_sources.items())
             for req_id, source in sources.items()] if result.several else []
    _print_at_most(console, lines, KV_SOURCE_LINES, "")


def _print_at_most(console: Console, lines: list[str], most: int, what: str) -> None:
    """The first `most` of `lines`, and how many more `what` `--json` holds."""
    for line in lines[:most]:
        console.print(line)
    if len(lines) > most:
        console.print(f"   ... {len(lines) - most} more{what} (--json)")


def _print_layers(console: Console, result: ReplayResult) -> None:
    """The recorded per-layer outputs against this replay's, and where this replay's were written."""
    if result.layer_checks:
        first_layer = result.first_diverging_layer
        agreeing = sum(item.bit_exact for item in result.layer_checks)
        console.print(
            f"layers vs recorded (eager): {agreeing}/{len(result.layer_checks)} bit-exact"
            + ("" if first_layer is None else
               f"; first diverging layer [bold]{inert(first_layer.name.removeprefix(LAYER_PREFIX))}[/bold] "
               f"max_abs {_number(first_layer.details.get('max_abs'))} "
               f"relative_rms {_number(first_layer.details.get('relative_rms'))}")
        )
    if result.layers_bundle:
        console.print(f"per-layer outputs (eager) written to {inert(result.layers_bundle)}")


def _print_timing(console: Console, result: ReplayResult) -> None:
    """The forward's times, each beside the recorded one where that is comparable (why not, else);
    nothing when nothing was timed."""
    timed = {mode: report for mode, report in result.modes.items() if report.get("available")}
    for mode, report in result.modes.items():
        if not report.get("available"):
            console.print(f"   {mode}: unavailable here ({inert(report['reason'])})")
    if not timed:
        return
    timing = table(console, "forward time", ["mode", "median", "min", "p90", "spread", "/ recorded", "output vs recorded"],
                   right=("median", "min", "p90", "spread", "/ recorded"))
    timing.add_row("recorded (engine)", _us(result.recorded_timing.get("forward_us")), "", "", "", "", "")
    timing.add_row("replay, cold run", _us(result.replay_forward_us), "", "", "", "", "")
    for mode, report in timed.items():
        latency, versus = report["latency_us"], report.get("vs_recorded") or {}
        timing.add_row(mode, _us(latency["median"]), _us(latency["min"]), _us(latency["p90"]),
                       f"{latency['sample_spread_pct']:.1f}%", _shown_ratio(report),
                       "bit-exact" if versus.get("bit_exact") else f"rel_rms {_number(versus.get('relative_rms'))}")
    console.print(timing)
    _print_ratio_reasons(console, timed)
    recorded_timer = result.recorded_timing.get("forward_timer") or "host clock around the forward and a sync"
    timers = sorted({report["latency_us"].get("timer", "?") for report in timed.values()})
    console.print(f"   timed by: recorded {recorded_timer}; replayed {', '.join(timers)}")
    _print_mode_agreement(console, result.mode_agreement)
    for mode, report in timed.items():
        if report.get("profile_trace"):
            console.print(f"   {mode}: profile trace {inert(report['profile_trace'])} (open in ui.perfetto.dev)")


def _shown_ratio(report: dict[str, Any]) -> str:
    """A mode's time over the recorded one, shown only where the recorded time is comparable."""
    ratio = report.get("ratio_to_recorded")
    if not isinstance(ratio, float) or report.get("ratio_not_comparable"):
        return "-"
    return f"{ratio:.2f}x"


def _print_ratio_reasons(console: Console, timed: dict[str, dict[str, Any]]) -> None:
    """Why a ratio to the recorded time is not shown, or means little (each reason once)."""
    said = set()
    for report in timed.values():
        for key, how in (("ratio_not_comparable", "/ recorded not shown: "), ("ratio_means_little", "/ recorded: ")):
            reason = report.get(key)
            if reason and reason not in said:
                said.add(reason)
                console.print(f"   {how}{inert(reason)}")


def _print_mode_agreement(console: Console, agreement: dict[str, Any] | None) -> None:
    if agreement is None:
        return
    if agreement["agree"]:
        console.print(f"   modes agree: {', '.join(agreement['bit_exact_with_recording'])} bit-exact with the recording")
    else:
        parted = ", ".join(f"{mode} (rel_rms {_number(rms)})" for mode, rms in agreement["parted"].items())
        console.print(f"   [bold yellow]modes disagree[/bold yellow]: {parted} part from the recording"
                      + (f"; bit-exact: {', '.join(agreement['bit_exact_with_recording'])}"
                         if agreement["bit_exact_with_recording"] else ""))
    if agreement["nonfinite"]:
        console.print(f"   [bold red]non-finite real rows[/bold red] in: {', '.join(agreement['nonfinite'])}")


# Words beside the headline for the verdicts that want them (any other verdict shows its reason).
_DETAILS = {
    VerdictName.BIT_EXACT: "bit-exact",
    VerdictName.PLATFORM_DIFFERENCE: "up to the platform difference",
    VerdictName.RELEASE_DIFFERENCE: "up to the release difference",
    VerdictName.ERROR_REPRODUCED: "the recorded error",
    VerdictName.ERROR_NOT_REPRODUCED: "the recorded error",
    VerdictName.ERROR_GONE: "the recorded error is gone",
    VerdictName.ERROR_APPEARED: "an error appeared",
    VerdictName.NONFINITE_GONE: "the non-finite outputs are gone",
    VerdictName.NONFINITE_APPEARED: "non-finite outputs appeared",
    VerdictName.NONDETERMINISTIC: "the engine does not repeat itself",
}
# The headline of a verdict that exits 0 or 1 (any other shows its name).
_HEADLINES = {EXIT_OK: "[bold green]REPRODUCED[/bold green]",
              EXIT_NOT_REPRODUCED: "[bold red]NOT REPRODUCED[/bold red]"}


def print_verdict(console: Console, verdict: Any, first_divergence: str | None, tolerance: float, padding: bool) -> None:
    """The report's first line: the verdict, in words, and why (`padding`: padding rows were
    compared apart). Any verdict is shown by its exit code: 0 reproduced, 1 not, else its name."""
    code = verdict.exit_code()
    shown = inert(verdict.name.value.replace("_", " ").upper())
    headline = _HEADLINES.get(code) or f"[bold yellow]{shown}[/bold yellow]"
    detail = _DETAILS.get(verdict.name)
    if verdict.name == VerdictName.WITHIN_TOLERANCE:
        detail = f"within tolerance {tolerance:g}"
    if verdict.name == VerdictName.DIVERGED:
        detail = f"first divergence at [bold]{inert(str((verdict.beyond_bound or [first_divergence])[0]))}[/bold]"
    headline += f" ({detail})" if detail else ""
    real_rows = " (real rows; padding rows reported apart)" if padding else ""
    console.print(f"verdict [bold]{verdict.name.value}[/bold]: {headline}{real_rows} ({inert(verdict.reason)}; "
                  f"exit {code})")


def _print_checks(console: Console, result: ReplayResult, verdict: Any) -> None:
    """The step's items that decide against the recording, then the requests whose sampled ids
    differ and the grammar mask rows that differ (`verdict`: how a not bit-exact item counts)."""
    deciding = [item for item in result.checks if item.decides]
    checks = table(console, f"vs recorded ({result.reference_mode} forward)",
                   ["item", "bit-exact", "max_abs", "relative_rms", "argmax/tokens"])
    for item in deciding:
        details = item.details
        checks.add_row(inert(item.name), _agreement(item, verdict), _number(details.get("max_abs")),
                       _number(details.get("relative_rms")),
                       _number(details.get("argmax_agreement", details.get("agreement"))))
    if deciding:
        console.print(checks)
    for item in result.checks:
        for row in item.details.get("differing_rows", []):
            console.print(f"   {inert(verdicts.describe_differing_row(row))}")
        for row in item.details.get("differing_mask_rows", []):
            console.print(f"   {inert(verdicts.describe_mask_row(row))}")
        if item.name == KV_DIGEST_ITEM:
            _print_kv_writes(console, item)


def _agreement(item: Any, verdict: Any) -> str:
    """How an item that decides the verdict agrees with the recording: bit-exact, within the
    tolerance, within the platform's or the release's bound (what the verdict allowed), or not."""
    if item.bit_exact:
        return "[green]yes[/green]"
    allowed = "within tol" if item.within_tolerance else {
        VerdictName.PLATFORM_DIFFERENCE: "platform", VerdictName.RELEASE_DIFFERENCE: "release"}.get(verdict.name)
    return f"[yellow]{allowed}[/yellow]" if allowed else "[red]NO[/red]"


KV_WRITER_LINES = 8  # the most requests named whose KV writes differ (`--json` has them all)


def _print_kv_writes(console: Console, item: Any) -> None:
    """A window step's digest of its KV writes: each request that wrote other KV, from which
    layer on; or why the replay could not check them."""
    if "problem" in item.details:
        console.print(f"   kv_written not checked: {inert(item.details['problem'])}")
    _print_at_most(console, [f"   request {inert(req_id)} wrote other KV than recorded, from layer {inert(layer)} on"
                              for req_id, layer in item.details.get("requests_moved", {}).items()],
                   KV_WRITER_LINES, " requests")


def _print_dispatch(console: Console, audited: dict[str, Any], attention: bool) -> None:
    """What the engine chose for the step, recorded and here; differences flagged (and, with
    `attention`, how the attention metadata differs: a lead when the replay is not bit-exact)."""
    if not audited:
        return
    before, after = audited.get("recorded") or {}, audited.get("replayed") or {}

    def shape(view: dict[str, Any]) -> str:
        if not view:
            return "unknown"
        return f"{view.get('runtime_mode')} graph at {view.get('num_tokens_padded')} rows for {view.get('num_tokens')} tokens"

    console.print(f"   dispatch: recorded {inert(shape(before))}; here {inert(shape(after))}")
    for line in audited.get("differences", []):
        console.print(f"     [yellow]differs[/yellow]: {inert(line)}")
    for line in audited.get("attention_differences", []) if attention else []:
        console.print(f"     attention metadata differs: {inert(line.removeprefix('attention '))}")


def _print_not_deciding(console: Console, result: ReplayResult) -> None:
    """The items that do not decide the verdict: padding rows, and what could not be compared."""
    for item in result.checks:
        if not item.decides and "why_not_deciding" in item.details:
            console.print(f"   {inert(item.name)} not compared: {inert(str(item.details['why_not_deciding']))}")
    for item in [item for item in result.checks if item.is_padding]:
        rows = item.details.get("rows", ["?", "?"])
        state = "bit-exact" if item.bit_exact else (
            f"differ (max_abs {_number(item.details.get('max_abs'))}; does not decide the verdict)")
        console.print(f"   padding rows {rows[0]}..{rows[1]} of {inert(item.name.removesuffix('/padding'))}: {state}")
    for finding in result.padding_findings:
        console.print(f"   [red]padding[/red]: {inert(finding)}")


def _verdict_cell(verdict: str, exit_code: int) -> str:
    """A verdict in a table row: green where it exits 0, red otherwise."""
    colour = "green" if exit_code == EXIT_OK else "red"
    return f"[{colour}]{verdict}[/{colour}]"


def _suite_ratio(record: SuiteRecord) -> str:
    """A bundle's timed forward over its recorded one, where comparable and not too noisy to mean much."""
    if not record.timed.get("available") or record.timed.get("ratio_means_little"):
        return "-"
    return _shown_ratio(record.timed)


def _print_suite(console: Console, outcome: SuiteOutcome) -> None:
    """One row per bundle, in the order they ran (the times only where any was timed); errors and
    bundles left unrun below."""
    timed = any(record.forward_us is not None for record in outcome.records)
    columns = ["bundle", "step", "engine", "verdict", "first divergence"]
    summary = table(console, f"{len(outcome.records)} bundle(s) on {outcome.engines_built} engine(s)",
                    columns + (["forward", "recorded", "/ recorded"] if timed else []),
                    right=("step", "engine", "forward", "recorded", "/ recorded"))
    for record in outcome.records:
        result = record.result
        row = [inert(record.name), "-" if result is None else str(result.step_index),
               "-" if record.engine is None else str(record.engine), _verdict_cell(record.verdict, record.exit_code),
               inert((result.first_divergence if result else None) or "-")]
        summary.add_row(*row, *([_us(record.forward_us), _us(record.recorded_forward_us), _suite_ratio(record)]
                                if timed else []))
    console.print(summary)
    if timed:
        console.print("   / recorded: shown where the recorded time is comparable and the timed samples agree "
                      "(--json says why not: ratio_not_comparable, ratio_means_little)")
    _print_suite_notes(console, outcome)


def _print_suite_notes(console: Console, outcome: SuiteOutcome) -> None:
    """The bundles' errors, profile traces, the bundles not run, and the tally."""
    for record in outcome.records:
        if record.error:
            console.print(f"   {inert(record.name)}: {inert(record.error)}")
    traces = [report["profile_trace"] for record in outcome.records if record.result
              for report in record.result.modes.values() if report.get("profile_trace")]
    if traces:
        console.print(f"   profile traces: {len(traces)} in {inert(str(Path(traces[0]).parent))} (open in ui.perfetto.dev)")
    if outcome.not_run:
        console.print(f"[bold red]stopped at the first failure[/bold red]: {len(outcome.not_run)} bundle(s) not run "
                      "(--keep-going runs them all)")
    failed, ran = sum(record.exit_code != EXIT_OK for record in outcome.records), len(outcome.records)
    console.print(f"[bold red]{failed} of {ran} bundle(s) failed[/bold red] (exit {outcome.exit_code})" if failed
                  else f"[bold green]all {ran} bundle(s) reproduced[/bold green]")


def _print_rank_set(console: Console, result: RankSetReplayResult, needs: str | None) -> None:
    """Every rank's replay of one step: the verdict first, what the bundle needs, one row per rank,
    then each rank's items that are not bit-exact."""
    _print_rank_set_verdict(console, result)
    if needs:
        console.print(inert(needs))
    layout = f"TP={result.tensor_parallel_size}" + (
        f" PP={result.pipeline_parallel_size}" if result.pipeline_parallel_size > 1 else ""
    )
    console.print(
        f"[bold]replay[/bold] {inert(result.bundle)}  step {inert(result.step_index)} ({inert(result.trigger)}), "
        f"{result.world_size} ranks ({layout})"
    )
    _print_differences(console, result.environment_differences, result.overrides)
    _print_ranks(console, result)
    for rank, replayed in enumerate(result.ranks):
        diverged = [item for item in replayed.checks if not item.bit_exact]
        if not diverged:
            continue
        detail = table(console, f"rank {rank}: items not bit-exact", ["item", "within tol", "max_abs", "relative_rms"])
        for item in diverged:
            detail.add_row(inert(item.name), "yes" if item.within_tolerance else "[red]no[/red]",
                           str(item.details.get("max_abs", "-")), str(item.details.get("relative_rms", "-")))
        console.print(detail)


def _print_ranks(console: Console, result: RankSetReplayResult) -> None:
    """One row per rank (forward times in ms: recorded, replayed cold, then the timed runs), and
    the step's, its slowest rank's per run."""
    ranks = table(console, "per rank (forward times in ms: recorded, replayed cold, then timed runs)",
                  ["rank", "verdict", "first divergence", "recorded", "replay", "median", "min"],
                  right=("recorded", "replay", "median", "min"))
    for rank, replayed in enumerate(result.ranks):
        latency = next(iter(replayed.modes.values()), {}).get("latency_us", {})
        name = replayed.verdict.name
        colour = "green" if name == VerdictName.BIT_EXACT else "red" if replayed.exit_code else "yellow"
        ranks.add_row(str(rank), f"[{colour}]{name.value}[/{colour}]", inert(replayed.first_divergence or "-"),
                      _ms(replayed.recorded_timing.get("forward_us"), 2), _ms(replayed.replay_forward_us, 2),
                      _ms(latency.get("median"), 2), _ms(latency.get("min"), 2))
    if result.step_latency_us:
        step = result.step_latency_us
        ranks.add_row("step", "", "slowest rank per run",
                      _ms(max((r.recorded_timing.get("forward_us") or 0 for r in result.ranks), default=None), 2),
                      _ms(max((r.replay_forward_us or 0 for r in result.ranks), default=None), 2),
                      _ms(step["median"], 2), _ms(step["min"], 2))
    console.print(ranks)


def _print_rank_set_verdict(console: Console, result: RankSetReplayResult) -> None:
    verdict = result.verdict
    if result.exit_code == 0:
        how = {VerdictName.BIT_EXACT: "bit-exact", VerdictName.WITHIN_TOLERANCE: f"within tolerance {result.tolerance:g}"}
        console.print(f"verdict [bold]{verdict.name.value}[/bold]: {_HEADLINES[EXIT_OK]} on all "
                      f"{result.world_size} ranks ({how.get(verdict.name, inert(verdict.reason))}; exit 0)")
    else:
        console.print(f"verdict [bold]{verdict.name.value}[/bold]: {_HEADLINES[EXIT_NOT_REPRODUCED]}: first "
                      f"divergence at [bold]{inert(result.first_divergence or '-')}[/bold] ({inert(verdict.reason)}; "
                      f"exit {result.exit_code})")
