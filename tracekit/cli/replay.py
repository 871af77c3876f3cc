"""`tracekit replay BUNDLE`: reproduce, check and time a recorded step.

Exit codes (for `git bisect run` and CI): 0 for the verdicts bit_exact, within_tolerance,
platform_difference and error_reproduced (with --strict: bit_exact only), 1 for diverged and
error_not_reproduced, 2 bad input or usage, 3 this machine cannot replay it.
"""

import json
import sys
from pathlib import Path

import click

from tracekit.errors import UsageError


@click.command(
    "replay",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("bundle", type=click.Path(dir_okay=False))
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
                   "attention, MLP) into a small bundle here; `tracekit diff` two of them.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the full result as JSON here ('-' for stdout).")
@click.pass_context
def replay_command(ctx, bundle, step, model, allow_weights_mismatch, modes, no_timing, iters, samples, tolerance,
                   strict, layers_out, json_out):
    """Rebuild the engine from BUNDLE, run its step, compare with the recording."""
    from tracekit.integrations.vllm.engine import parse_engine_cli_args
    from tracekit.replay.replayer import replay
    from tracekit.replay.report import print_report

    if not Path(bundle).is_file():
        raise UsageError(f"no bundle at {bundle}")
    if iters < 1 or samples < 1:
        raise UsageError("--iters and --samples must be at least 1")
    if layers_out is not None and not Path(layers_out).resolve().parent.is_dir():
        raise UsageError(f"cannot write --layers {layers_out}: its directory does not exist")
    result = replay(
        bundle,
        step=step,
        model=model,
        allow_weights_mismatch=allow_weights_mismatch,
        engine_overrides=parse_engine_cli_args(list(ctx.args)),
        modes=None if no_timing else modes,
        iters=iters,
        samples=samples,
        tolerance=tolerance,
        layers_out=layers_out,
    )
    print_report(result, sys.stderr if json_out == "-" else sys.stdout)
    if json_out:
        text = json.dumps(result.to_plain(), indent=2, default=str)
        if json_out == "-":
            click.echo(text)
        else:
            Path(json_out).write_text(text + "\n")
    sys.exit(result.exit_code(strict))
