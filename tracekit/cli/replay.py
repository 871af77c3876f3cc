"""`tracekit replay BUNDLE...`: reproduce, check and time recorded steps.

One bundle gets the detailed report. Many (files, folders, globs) run as a regression suite: one
engine per engine configuration, a summary table, one JSON line per bundle.

Exit codes (for `git bisect run` and CI): 0 for the verdicts bit_exact, within_tolerance,
platform_difference and error_reproduced (with --strict: bit_exact only), 1 for diverged and
error_not_reproduced, 2 bad input or usage, 3 this machine cannot replay it. A suite exits
with the worst of its bundles' codes, in the order 0 < 3 < 2 < 1 (`tracekit.replay.suite`).
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
@click.option("--model", default=None, help="Where the weights are here, if not at the recorded path.")
@click.option("--allow-weights-mismatch", is_flag=True, help="Replay even if the weights' fingerprint differs.")
@click.option("--mode", "modes", default="reference", show_default=True,
              help="Modes to run and time the forward in: eager|compiled|graph|piecewise|all, or "
                   "reference (the mode the engine ran: compiled, or eager if it did not compile).")
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
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw the latency distributions against the recorded time (and, where a replay is "
                   "not bit-exact, the relative error per layer) into this PNG. Needs matplotlib.")
@click.pass_context
def replay_command(ctx, arguments, step, model, allow_weights_mismatch, modes, no_timing, iters, samples, tolerance,
                   strict, layers_out, json_out, keep_going, profile_dir, plot_path):
    """Rebuild the engine of each BUNDLE (a file, a folder of .zst bundles, a glob), run its
    step, compare with the recording. Any vLLM engine argument after the bundles overrides the
    recorded one."""
    from tracekit.bundles import find_bundles, unique_names
    from tracekit.integrations.vllm.engine import parse_engine_cli_args
    from tracekit.outputs import require_parent
    from tracekit.replay.multirank import is_multi_rank

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
    if any(is_multi_rank(bundle) for bundle in bundles):
        if len(bundles) > 1:
            raise UsageError("a multi-rank step replays on its own: name one rank's bundle "
                             "(tracekit replay step3.rank0.zst), the other ranks' are found from it")
        if profile_dir or plot_path or layers_out or modes not in ("reference", None) and not no_timing:
            raise CannotRunHere("a multi-rank step is checked and timed as the engine ran it only "
                                "(no --mode other than reference, --profile, --plot or --layers yet)")
        _replay_rank_set(bundles[0], parse_engine_cli_args(engine_argv), json_out, model=model,
                         allow_weights_mismatch=allow_weights_mismatch, timing=not no_timing,
                         iters=iters, samples=samples, tolerance=tolerance, strict=strict)
    options = dict(
        step=step,
        model=model,
        allow_weights_mismatch=allow_weights_mismatch,
        engine_overrides=parse_engine_cli_args(engine_argv),
        modes=None if no_timing else modes,
        iters=iters,
        samples=samples,
        tolerance=tolerance,
        strict=strict,
    )
    if layers_out:
        options["layers_out"] = layers_out
    profile = Path(profile_dir) if profile_dir else None
    report_stream = sys.stderr if json_out == "-" else sys.stdout
    if len(bundles) == 1:
        records = [_replay_single(bundles[0], unique_names(bundles)[0], profile, options, report_stream)]
        exit_code = records[0].exit_code
    else:
        from tracekit.cli.replay_report import print_suite_summary, suite_progress
        from tracekit.replay.suite import run_suite

        with suite_progress(len(bundles)) as progress:
            outcome = run_suite(bundles, keep_going=keep_going, profile_dir=profile,
                                on_start=progress.start, on_done=progress.done, **options)
        print_suite_summary(outcome, report_stream)
        records, exit_code = outcome.records, outcome.exit_code
    if json_out:
        _write_json_lines(records, json_out)
    if plot_path:
        from tracekit.replay.plots import plot_records

        click.echo(f"plot: {plot_records(records, plot_path)}", file=report_stream)
    sys.exit(exit_code)


def _split_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """Bundles first, then vLLM engine arguments (from the first one that starts with `-`)."""
    first_option = next((i for i, argument in enumerate(arguments) if argument.startswith("-")), len(arguments))
    specs, engine_argv = arguments[:first_option], arguments[first_option:]
    if not specs:
        raise UsageError("name at least one bundle, before any engine arguments: tracekit replay BUNDLE... [--ARG ...]")
    return specs, engine_argv


def _replay_single(bundle: Path, name: str, profile: Path | None, options: dict, stream):
    """One bundle: the detailed report; its errors stay one line with their own exit code."""
    from tracekit.replay.replayer import replay
    from tracekit.cli.replay_report import print_report
    from tracekit.replay.suite import record_of

    started = time.perf_counter()
    result = replay(bundle, profile_prefix=profile / name if profile else None, **options)
    print_report(result, stream)
    return record_of(result, name, engine=1, engine_built=True, seconds=time.perf_counter() - started)


def _replay_rank_set(bundle: Path, engine_overrides: dict, json_out: str | None, **options) -> None:
    """Every rank of one multi-rank step: the per-rank report, one JSON line, its exit code."""
    import json

    from tracekit.replay.multirank import replay_rank_set
    from tracekit.cli.rank_set_report import print_rank_set_report

    result = replay_rank_set(bundle, engine_overrides=engine_overrides, **options)
    print_rank_set_report(result, sys.stderr if json_out == "-" else sys.stdout)
    if json_out == "-":
        click.echo(json.dumps(result.to_plain(), default=str))
    elif json_out:
        from tracekit.outputs import write_text_atomically

        write_text_atomically(json_out, json.dumps(result.to_plain(), default=str) + "\n")
    sys.exit(result.exit_code)


def _write_json_lines(records, json_out: str) -> None:
    text = "".join(record.json_line() + "\n" for record in records)
    if json_out == "-":
        click.echo(text, nl=False)
        return
    from tracekit.outputs import write_text_atomically

    write_text_atomically(json_out, text)
