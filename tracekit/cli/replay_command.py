"""`tracekit replay BUNDLE...`: reproduce, check and time recorded steps — one bundle in detail,
many as a regression suite; exit codes: docs/GUIDE.md, "Verdicts" and "Bundles as a regression
suite"."""

import sys
from pathlib import Path

import click

from tracekit.cli.arguments import (
    ENGINE_ARGUMENTS,
    force_option,
    json_option,
    one_step,
    refuse_unknown_options,
    renamed_option,
    steps_option,
    verbose_option,
    weights_options,
)
from tracekit.errors import UsageError


@click.command("replay", context_settings=ENGINE_ARGUMENTS)
@click.argument("arguments", nargs=-1, metavar="BUNDLE... [ENGINE ARGS]")
@steps_option("The step to replay, of a bundle holding several (default: the first).")
@click.option("--from", "from_step", type=int, default=None,
              help="In a window of steps: rebuild the model runner's state at this step as a single-step replay "
                   "builds it, instead of letting the runner carry it there (the steps before still run, carried).")
@weights_options()
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="Where LoRA adapter NAME is here, when the bundle does not keep its files and it is not at "
                   "the recorded path (checked against the recorded fingerprint). Repeatable.")
@click.option("--mode", "modes", default="reference", show_default=True,
              help="Modes to run and time the forward in: eager|compiled|compiled-no-graph|vllm-piecewise|graph|"
                   "piecewise|all, or reference (the mode the engine ran: compiled, or eager if it did not compile).")
@click.option("--no-timing", is_flag=True, help="Only reproduce and check; time nothing.")
@click.option("--iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed forwards per sample.")
@click.option("--samples", type=click.IntRange(min=1), default=3, show_default=True,
              help="Samples (their medians' spread is reported).")
@click.option("--tolerance", type=float, default=0.0, show_default=True,
              help="Largest relative RMS accepted as reproduced for float tensors (0: bit-exact).")
@click.option("--strict", is_flag=True, help="Exit 0 only for a bit-exact replay.")
@click.option("--repeats", type=click.IntRange(min=0), default=2, show_default=True,
              help="Where a step does not reproduce, replay it this many more times from the same restored state, "
                   "and where it diverged and those agree, as often in a fresh process: replays that disagree "
                   "among themselves make it nondeterministic (exit 6). 0: not at all.")
@click.option("--save-layers", "layers_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also run the step eagerly capturing every decoder layer's output (and its norms, "
                   "attention, MLP) into a small bundle here; `tracekit diff` two of them. One bundle only.")
@json_option("one record per bundle (JSON lines)")
@click.option("--keep-going", is_flag=True,
              help="With many bundles, replay every one instead of stopping at the first that fails.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None, metavar="FOLDER",
              help="Write a torch profiler trace (Chrome trace JSON, opens in Perfetto) of each timed "
                   "mode's forwards into this folder.")
@click.option("--full-engine", is_flag=True,
              help="Build the engine as vLLM builds it (every compile size, a CUDA graph of every capture "
                   "size) instead of a lean one with only what the step needs (its graph; the default).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Draw the latency distributions against the recorded time (and, where a replay is "
                   "not bit-exact, the relative error per layer) into this PNG, SVG or PDF. Needs matplotlib.")
@force_option()
@verbose_option()
@renamed_option("--step", "--steps")
@renamed_option("--layers", "--save-layers", "--layers is `tracekit record`'s flag (keep every layer's output in "
                                             "the bundle); a replay writes its per-layer outputs with --save-layers FILE")
@click.pass_context
def replay_command(ctx, arguments, json_out, plot_path, force, verbose, keep_going, profile_dir, **flags):
    """Rebuild the engine of each BUNDLE (a file, a folder of .zst bundles, a glob), run its
    step, compare with the recording. Any vLLM engine argument after the bundles overrides the
    recorded one."""
    from tracekit.cli.replay_run import replay_isolated, write_reports
    from tracekit.replay.request import plan

    specs, engine_argv = _split_arguments(arguments)
    refuse_unknown_options(engine_argv, ctx.command)
    options = _options(**flags)
    with plan(specs, options, engine_argv, keep_going, Path(profile_dir) if profile_dir else None) as request:
        _claim_outputs(request, json_out, plot_path, force)
        records, exit_code = replay_isolated(request, verbose, report_to_stderr=json_out == "-")
    write_reports(records, json_out, plot_path)
    sys.exit(exit_code)


def _options(steps, loras, modes, no_timing, **named_alike):
    """The replay's options, typed (`ReplayOptions`, whose other fields are named as the
    options are), or what is wrong with them (usage)."""
    from tracekit.replay.options import ReplayOptions

    return ReplayOptions(step=one_step(steps), lora_paths=_lora_paths(loras), modes=None if no_timing else modes,
                         **named_alike)


def _claim_outputs(request, json_out, plot_path, force) -> None:
    """Refuse, before any engine, outputs that would be lost or lose a file (`claim_outputs`),
    what cannot be drawn, and profiling with nothing timed."""
    from tracekit.outputs import claim_outputs

    if request.profile_dir and request.options.modes is None:
        raise UsageError("--profile traces the timed forwards; drop --no-timing")
    if plot_path and request.multi_rank:
        raise UsageError("--plot draws one rank's replay: a multi-rank step's is not drawn yet, leave --plot out")
    if plot_path:
        from tracekit.replay.plots import require_matplotlib

        require_matplotlib(plot_path)
    outputs = [("--json", json_out), ("--plot", plot_path), ("--save-layers", request.options.layers_out)]
    folder = request.profile_dir  # where an earlier replay of these bundles may have left their traces
    traces = [] if folder is None else [trace for name in request.names.values()
                                        for trace in sorted(folder.glob(f"{name}.*.trace.json"))]
    claim_outputs(outputs + [("--profile", trace) for trace in traces], request.bundles, force)


def _lora_paths(specs: tuple[str, ...]) -> dict[str, str]:
    """`--lora NAME=PATH` values as {name: path}."""
    paths = {}
    for spec in specs:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path:
            raise UsageError(f"bad --lora {spec!r}: give NAME=PATH (the adapter's recorded name, its folder here)")
        paths[name] = path
    return paths


def _split_arguments(arguments: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Bundles first, then vLLM engine arguments (from the first one that starts with `-`)."""
    first_option = next((i for i, argument in enumerate(arguments) if argument.startswith("-")), len(arguments))
    specs, engine_argv = list(arguments[:first_option]), list(arguments[first_option:])
    if not specs:
        raise UsageError("name at least one bundle, before any engine arguments: tracekit replay BUNDLE... [--ARG ...]")
    return specs, engine_argv
