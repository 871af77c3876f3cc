"""`tracekit shrink BUNDLE -o SMALL --until PROPERTY`: the smallest batch that still fails.

Exit codes: 0 shrunk and written, 2 bad input — including a property that does not hold on the
bundle itself (nothing is written then), 3 this machine cannot replay the bundle.
"""

import click

from tracekit.cli.arguments import bundle_argument, one_step, one_step_options


@click.command("shrink")
@bundle_argument()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the shrunk bundle.")
@click.option("--until", "until", required=True,
              help="What must stay true: raises | nonfinite | modes-differ (a single step) | command:CMD "
                   "(CMD exits 0 on the cut bundle; {bundle} in CMD is its path, else it is appended) | diverges "
                   "(a window of steps parts from the recording at the same step and item).")
@click.option("--tolerance", type=float, default=0.0, show_default=True,
              help="modes-differ: the relative RMS the two modes must differ by (0: any bit).")
@one_step_options("The step to shrink, of a bundle holding several (default: the first).", "the shrink report")
def shrink_command(bundle, output, until, tolerance, steps, model, allow_weights_mismatch, json_out, force, verbose):
    """Delta-debug BUNDLE's step down to the fewest requests and tokens for which PROPERTY holds."""
    from tracekit.cli.engine_output import engine_output
    from tracekit.cli.terminal import console_for, inert
    from tracekit.outputs import claim_outputs, write_json
    from tracekit.share.shrink import shrink

    claim_outputs({"-o": output, "--json": json_out}, [bundle], force)
    with engine_output(verbose, "shrink") as engine:
        report = shrink(bundle, output, until, tolerance=tolerance, step=one_step(steps), model=model,
                        allow_weights_mismatch=allow_weights_mismatch, console=console_for(engine.errors))
        console = console_for(engine.errors if json_out == "-" else engine.report)
        console.print(f"[bold green]shrunk[/bold green] to {inert(report.output)}: requests {report.requests_before} -> "
                      f"{report.requests_after}, tokens {report.tokens_before} -> {report.tokens_after}, "
                      f"{report.replays} replays, {report.seconds:.1f} s")
        if engine.log_line():
            console.print(f"   {inert(engine.log_line())}")
    if json_out:
        write_json(report.to_plain(), json_out, indent=2)
