"""`tracekit export --shapes BUNDLE... -o cases.yaml`: recorded batches for other tools.

`--shapes` writes each recorded step's batch (query and KV length per request) in the case
format of `vllm bench forward --shapes`, so the exact production batches can be benchmarked on
any vLLM without the bundles. Reads metadata only: no torch, no vLLM needed.
"""

import click

from tracekit.errors import UsageError


@click.command("export")
@click.argument("bundles", nargs=-1, required=True, metavar="BUNDLE...")
@click.option("--shapes", is_flag=True, help="Export the batch shapes as `vllm bench forward --shapes` cases.")
@click.option("-o", "--output", required=True,
              help="The cases file: YAML for .yaml/.yml (or '-' for stdout), JSON otherwise, as vLLM reads them.")
def export_command(bundles, shapes, output):
    """Export what BUNDLE... recorded (files, folders of .zst bundles, globs) for other tools."""
    from tracekit.bundles import find_bundles
    from tracekit.integrations.vllm.records.bench_shapes import render, shape_cases
    from tracekit.outputs import require_parent, write_text_atomically

    if not shapes:
        raise UsageError("say what to export: --shapes (batch shapes for `vllm bench forward --shapes`)")
    if output != "-":
        require_parent(output)
    cases, engines = shape_cases(find_bundles(bundles))
    text = render(cases, engines, output)
    if output == "-":
        click.echo(text, nl=False)
    else:
        write_text_atomically(output, text)
        click.echo(f"wrote {len(cases)} case(s) to {output}; run: vllm bench forward --shapes {output} "
                   "--kv-len-jitter 0 --model MODEL ...", err=True)
