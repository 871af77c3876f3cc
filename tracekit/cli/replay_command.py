"""`tracekit replay BUNDLE...`: reproduce, check and time recorded steps.

One bundle gets the detailed report. Many (files, folders, globs) run as a regression suite: one
engine per engine configuration, a summary table, one JSON line per bundle.

Exit codes (for `git bisect run` and CI): 0 for the verdicts bit_exact, within_tolerance,
platform_difference, release_difference and error_reproduced (with --strict: bit_exact only), 1
for diverged, error_not_reproduced and, under another vLLM release than the recording's,
error_gone, error_appeared, nonfinite_gone and nonfinite_appeared, 2 bad input or usage, 3 this
machine (or this vLLM release) cannot replay it, 4 the replay crashed, 5 (cannot_replay_yet) the
step used something tracekit records but cannot replay yet. A suite exits with the worst of its
bundles' codes, in the order 0 < 3 < 5 < 2 < 4 < 1 (`tracekit.replay.suite`).
"""

import sys
import time
from pathlib import Path

import click

from tracekit.errors import CannotRunHere, UsageError


@click.command(
    "replay",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("arguments", nargs=-1, metavar="BUNDLE... [ENGINE ARGS]")
@click.option("--step", type=int, default=None, help="Engine step index to replay (default: the first).")
@click.option("--from", "from_step", type=int, default=None,
              help="In a window of steps: rebuild the model runner's state at this step as a single-step replay "
                   "builds it, instead of letting the runner carry it there (the steps before still run, carried).")
@click.option("--model", default=None, help="Where the weights are here, if not at the recorded path.")
@click.option("--allow-weights-mismatch", is_flag=True,
              help="Replay even if the weights' fingerprint (the model's, a LoRA adapter's) differs.")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="Where LoRA adapter NAME is here, when the bundle does not keep its files and it is not at "
                   "the recorded path (checked against the recorded fingerprint). Repeatable.")
@click.option("--mode", "modes", default="reference", show_default=True,
              help="Modes to run and time the forward in: eager|compiled|compiled-no-graph|vllm-piecewise|graph|"
                   "piecewise|all, or reference (the mode the engine ran: compiled, or eager if it did not compile).")
@click.option("--no-timing", is_flag=True, help="Only reproduce and check; time nothing.")
@click.option("--iters", type=int, default=10, show_default=True, help="Timed forwards per sample.")
@click.option("--samples", type=int, default=3, show_default=True, help="Samples (their medians' spread is reported).")
@click.option("--tolerance", type=float, default=0.0, show_default=True,
              help="Largest relative RMS accepted as reproduced for float tensors (0: bit-exact).")
@click.option("--strict", is_flag=True, help="Exit 0 only for a bit-exact replay (not for a platform difference).")
@click.option("--layers", "layers_out", type=click.Path(dir_okay=False), default=None,
              help="Also run the step eagerly capturing every decoder layer's output (and its norms, "
                   "attention, MLP) into a small bundle here; `tracekit diff` two of them. One bundle only.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write one JSON line per bundle here ('-' for stdout).")
@click.option("--keep-going", is_flag=True,
              help="With many bundles, replay every one instead of stopping at the first that fails.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None,
              help="Write a torch profiler trace (Chrome trace JSON, opens in Perfetto) of each timed "
                   "mode's forwards into this folder.")
@click.option("--full-engine", is_flag=True,
              help="Build the engine as vLLM builds it (every compile size, a CUDA graph of every capture "
                   "size) instead of a lean one with only what the step needs (its graph; the default).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw the latency distributions against the recorded time (and, where a replay is "
                   "not bit-exact, the relative error per layer) into this PNG. Needs matplotlib.")
@click.pass_context
def replay_command(ctx, arguments, step, from_step, model, allow_weights_mismatch, loras, modes, no_timing, iters,
                   samples, tolerance, strict, layers_out, json_out, keep_going, profile_dir, full_engine, plot_path):
    """Rebuild the engine of each BUNDLE (a file, a folder of .zst bundles, a glob), run its
    step, compare with the recording. Any vLLM engine argument after the bundles overrides the
    recorded one."""
    from tracekit.bundles import find_bundles, unique_names
    from tracekit.cli.isolation import crash_record, run_isolated
    from tracekit.outputs import require_parent
    from tracekit.replay.opened import OpenedBundle

    specs, engine_argv = _split_arguments([*arguments, *ctx.args])
    if iters < 1 or samples < 1:
        raise UsageError("--iters and --samples must be at least 1")
    if profile_dir and no_timing:
        raise UsageError("--profile traces the timed forwards; drop --no-timing")
    if plot_path:
        from tracekit.replay.plots import require_matplotlib

        require_matplotlib(plot_path)
    for output in (json_out, plot_path, layers_out):
        if output and output != "-":
            require_parent(output)
    bundles = find_bundles(specs)
    if layers_out and len(bundles) > 1:
        raise UsageError("--layers writes one bundle's per-layer outputs: replay one bundle with it")
    # One bundle is read here once, and its replay takes it from here; of many, each is looked
    # at and let go (a suite reads each again when its turn comes).
    single = OpenedBundle(bundles[0]) if len(bundles) == 1 else None
    multi_rank = single.multi_rank if single is not None else any(_multi_rank(bundle) for bundle in bundles)
    refusal = _rank_set_refusal(len(bundles), profile_dir or plot_path or layers_out
                                or modes not in ("reference", None) and not no_timing) if multi_rank else None
    if refusal is not None:
        if single is not None:
            single.close()
        raise refusal
    options = dict(
        step=step,
        model=model,
        allow_weights_mismatch=allow_weights_mismatch,
        lora_paths=_lora_paths(loras),
        modes=None if no_timing else modes,
        iters=iters,
        samples=samples,
        tolerance=tolerance,
        strict=strict,
        full_engine=full_engine,
    )
    if layers_out:
        options["layers_out"] = layers_out
    if from_step is not None:
        options["from_step"] = from_step
    profile = Path(profile_dir) if profile_dir else None
    report_stream = sys.stderr if json_out == "-" else sys.stdout
    names = dict(zip(bundles, unique_names(bundles)))

    records, exit_codes, left = [], [], list(bundles)
    while left:
        def work(progress, todo=tuple(left)):
            engine_overrides = _engine_overrides(engine_argv)
            if multi_rank:
                return _replay_rank_set(single, engine_overrides, progress, report_stream, options)
            if single is not None:
                return _replay_single(single, names[todo[0]], profile, {**options, "engine_overrides": engine_overrides},
                                      progress, report_stream)
            return _replay_suite(list(todo), keep_going, profile, {**options, "engine_overrides": engine_overrides},
                                 progress, report_stream)

        try:
            outcome = run_isolated(work)
        finally:
            if single is not None:
                single.close()
        records.extend(outcome.records)
        exit_codes.append(outcome.exit_code)
        if outcome.died_on is None:
            break
        from tracekit.cli.isolation import print_crash

        dead = Path(outcome.died_on["started"])
        crashed = crash_record(outcome.died_on, outcome.death, names.get(dead))
        records.append(crashed)
        print_crash(str(dead), crashed["step"], crashed["trigger"], outcome.death, report_stream)
        done = {Path(record["bundle"]) for record in records}
        left = [bundle for bundle in bundles if bundle not in done]
        if not keep_going or len(bundles) == 1:
            if left:
                click.echo(f"tracekit: {len(left)} bundle(s) not run (--keep-going runs them all)", file=report_stream)
            break
    if json_out:
        _write_json_lines(records, json_out)
    if plot_path and records and not multi_rank:
        from tracekit.replay.plots import plot_records

        click.echo(f"plot: {plot_records(records, plot_path)}", file=report_stream)
    from tracekit.replay.suite import worst_exit_code

    sys.exit(worst_exit_code(exit_codes))


def _rank_set_refusal(num_bundles: int, asks_beyond_reference: bool) -> Exception | None:
    """Why a multi-rank step cannot be replayed as asked (None: it can)."""
    if num_bundles > 1:
        return UsageError("a multi-rank step replays on its own: name one rank's bundle "
                          "(tracekit replay step3.rank0.zst), the other ranks' are found from it")
    if asks_beyond_reference:
        return CannotRunHere("a multi-rank step is checked and timed as the engine ran it only "
                             "(no --mode other than reference, --profile, --plot or --layers yet)")
    return None


def _multi_rank(bundle: Path) -> bool:
    from tracekit.replay.opened import OpenedBundle

    with OpenedBundle(bundle) as opened:
        return opened.multi_rank


def _engine_overrides(engine_argv: list[str]) -> dict:
    from tracekit.integrations.vllm.engines.build import parse_engine_cli_args

    return parse_engine_cli_args(engine_argv)


def _lora_paths(specs: tuple[str, ...]) -> dict[str, str]:
    """`--lora NAME=PATH` values as {name: path}."""
    paths = {}
    for spec in specs:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path:
            raise UsageError(f"bad --lora {spec!r}: give NAME=PATH (the adapter's recorded name, its folder here)")
        paths[name] = path
    return paths


def _split_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """Bundles first, then vLLM engine arguments (from the first one that starts with `-`)."""
    first_option = next((i for i, argument in enumerate(arguments) if argument.startswith("-")), len(arguments))
    specs, engine_argv = arguments[:first_option], arguments[first_option:]
    if not specs:
        raise UsageError("name at least one bundle, before any engine arguments: tracekit replay BUNDLE... [--ARG ...]")
    return specs, engine_argv


def _replay_single(opened, name: str, profile: Path | None, options: dict, progress, stream) -> int:
    """One bundle (an `OpenedBundle`): the detailed report; its refusals stay one line with their
    own exit code, and a failure inside vLLM or the device is reported as a crash (exit 4)."""
    from tracekit.cli.isolation import print_crash
    from tracekit.cli.replay_report import print_report
    from tracekit.cli.window_report import print_window_report
    from tracekit.errors import EXIT_REPLAY_FAILED, TracekitError, one_line
    from tracekit.replay.replayer import WindowReplayResult, replay
    from tracekit.replay.suite import SuiteRecord, record_of
    from tracekit.replay.verdict_names import NOT_REPLAYED, VerdictName

    bundle = opened.path
    facts = opened.facts(options.get("step"))
    progress.started(str(bundle), **facts)
    started = time.perf_counter()
    try:
        result = replay(opened, profile_prefix=profile / name if profile else None, **options)
    except TracekitError as error:  # refused: one line (printed by the caller), and its record
        verdict = NOT_REPLAYED.get(error.exit_code, VerdictName.BAD_INPUT)
        progress.finished({**SuiteRecord(str(bundle), name, verdict.value, error.exit_code, error=str(error)).to_plain(),
                           **facts})
        raise
    except Exception as error:  # inside vLLM, the device or tracekit: not a verdict on the step
        reason = one_line(error)
        print_crash(str(bundle), facts.get("step"), facts.get("trigger"), reason, stream)
        record = SuiteRecord(str(bundle), name, VerdictName.CRASHED.value, EXIT_REPLAY_FAILED, error=reason,
                             seconds=time.perf_counter() - started)
        progress.finished({**record.to_plain(), **facts})
        return record.exit_code
    seconds = time.perf_counter() - started
    if isinstance(result, WindowReplayResult):  # one record per step of the window
        print_window_report(result, stream)
        for step_record in result.step_records():
            progress.finished({"name": name, "engine": 1, "engine_built": True, "seconds": round(seconds, 3), **step_record})
        return result.exit_code
    print_report(result, stream)
    record = record_of(result, name, engine=1, engine_built=True, seconds=seconds)
    progress.finished(record.to_plain())
    return record.exit_code


def _replay_suite(bundles: list[Path], keep_going: bool, profile: Path | None, options: dict, progress, stream) -> int:
    from tracekit.cli.replay_report import print_suite_summary, suite_progress
    from tracekit.replay.suite import run_suite

    with suite_progress(len(bundles)) as bar:
        def on_start(position, bundle, building):
            progress.started(str(bundle))
            bar.start(position, bundle, building)

        def on_done(record):
            progress.finished(record.to_plain())
            bar.done(record)

        outcome = run_suite(bundles, keep_going=keep_going, profile_dir=profile, on_start=on_start, on_done=on_done,
                            **options)
    print_suite_summary(outcome, stream)
    return outcome.exit_code


def _replay_rank_set(opened, engine_overrides: dict, progress, stream, options: dict) -> int:
    """Every rank of one multi-rank step (any rank's `OpenedBundle`): the per-rank report, one
    JSON record, its exit code."""
    from tracekit.cli.rank_set_report import print_rank_set_report
    from tracekit.replay.multirank import replay_rank_set

    progress.started(str(opened.path))
    result = replay_rank_set(
        opened, engine_overrides=engine_overrides, model=options["model"],
        allow_weights_mismatch=options["allow_weights_mismatch"], timing=options["modes"] is not None,
        iters=options["iters"], samples=options["samples"], tolerance=options["tolerance"], strict=options["strict"],
    )
    print_rank_set_report(result, stream)
    progress.finished(result.to_plain())
    return result.exit_code


def _write_json_lines(records: list[dict], json_out: str) -> None:
    import json

    text = "".join(json.dumps(record, default=str) + "\n" for record in records)
    if json_out == "-":
        click.echo(text, nl=False)
        return
    from tracekit.outputs import write_text_atomically

    write_text_atomically(json_out, text)
