"""`tracekit export BUNDLE... -o cases.yaml`: the recorded batches as `vllm bench forward --shapes`
cases (docs/GUIDE.md, "Exporting the recorded batches"), its one format: `--shapes`, once
required, is still taken and says so.
"""

import click

from tracekit.cli.arguments import force_option


@click.command("export")
@click.argument("bundles", nargs=-1, required=True, metavar="BUNDLE...")
@click.option("-o", "--output", required=True,
              help="The cases file: YAML for .yaml/.yml (or '-' for stdout), JSON otherwise, as vLLM reads them.")
@click.option("--shapes", is_flag=True, hidden=True, help="The one format; no longer needed.")
@force_option()
def export_command(bundles, output, shapes, force):
    """Export the batch shapes BUNDLE... recorded (files, folders of .zst bundles, globs) as
    `vllm bench forward --shapes` cases."""
    from tracekit.bundles import find_bundles
    from tracekit.integrations.vllm.records.bench_shapes import render, shape_cases
    from tracekit.outputs import STDOUT, claim_outputs, write_text_atomically

    if shapes:
        click.echo("tracekit: --shapes is the one format export writes: it is no longer needed", err=True)
    found = find_bundles(bundles)
    claim_outputs({"-o": output}, found, force)
    cases, engines = shape_cases(found)
    text = render(cases, engines, output)
    if output == STDOUT:
        click.echo(text, nl=False)
        return
    write_text_atomically(output, text)
    click.echo(f"wrote {len(cases)} case(s) to {output}; run: vllm bench forward --shapes {output} "
               "--kv-len-jitter 0 --model MODEL ...", err=True)
