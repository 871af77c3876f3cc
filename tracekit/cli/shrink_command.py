"""`tracekit shrink BUNDLE -o SMALL --until PROPERTY`: the smallest batch that still fails.

Exit codes: 0 shrunk and written, 2 bad input — including a property that does not hold on the
bundle itself (nothing is written then), 3 this machine cannot replay the bundle.
"""

import json

import click


@click.command("shrink")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the shrunk bundle.")
@click.option("--until", "until", required=True,
              help="What must stay true: raises | nonfinite | modes-differ | command:CMD "
                   "(CMD exits 0 on the cut bundle; {bundle} in CMD is its path, else it is appended); for a "
                   "window of steps: diverges (parts from the recording at the same step and item) | raises.")
@click.option("--tolerance", type=float, default=0.0, show_default=True,
              help="modes-differ: the relative RMS the two modes must differ by (0: any bit).")
@click.option("--step", type=int, default=None, help="Engine step index to shrink (default: the first).")
@click.option("--model", default=None, help="Where the weights are here, if not at the recorded path.")
@click.option("--allow-weights-mismatch", is_flag=True, help="Replay even if the weights' fingerprint differs.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the shrink report as JSON here ('-' for stdout).")
def shrink_command(bundle, output, until, tolerance, step, model, allow_weights_mismatch, json_out):
    """Delta-debug BUNDLE's step down to the fewest requests and tokens for which PROPERTY holds."""
    from pathlib import Path

    from rich.console import Console

    from tracekit.errors import UsageError
    from tracekit.share.shrink import shrink

    if not Path(bundle).is_file():
        raise UsageError(f"no bundle at {bundle}")
    report = shrink(bundle, output, until, tolerance=tolerance, step=step, model=model,
                    allow_weights_mismatch=allow_weights_mismatch)
    console = Console(stderr=json_out == "-", highlight=False)
    console.print(
        f"[bold green]shrunk[/bold green] to {report.output}: requests {report.requests_before} -> "
        f"{report.requests_after}, tokens {report.tokens_before} -> {report.tokens_after}, "
        f"{report.replays} replays, {report.seconds:.1f} s"
    )
    if json_out:
        text = json.dumps(report.to_plain(), indent=2)
        if json_out == "-":
            click.echo(text)
        else:
            Path(json_out).write_text(text + "\n")
