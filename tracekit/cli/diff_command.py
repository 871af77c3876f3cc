"""`tracekit diff A B`: where two bundles differ — tensors first, then metadata.

Exit 0 when every tensor is bit-identical (metadata such as versions may still differ), 1 when
a tensor differs or exists in one bundle only, 2 on a bad bundle.
"""

import json
import sys

import click


@click.command("diff")
@click.argument("first", type=click.Path(dir_okay=False, exists=True))
@click.argument("second", type=click.Path(dir_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def diff_command(first, second, as_json):
    """Compare two bundles tensor by tensor (e.g. one step recorded on two machines)."""
    from rich.console import Console
    from rich.table import Table

    from tracekit.cli.terminal import inert
    from tracekit.format.diff import diff_bundles

    result = diff_bundles(first, second)
    if as_json:
        click.echo(json.dumps(result.to_plain(), indent=2, default=str))
        sys.exit(0 if result.identical_tensors else 1)
    console = Console(highlight=False)
    table = Table(title="tensors", title_justify="left")
    table.add_column("name", overflow="fold")
    for column in ("bit-exact", "max_abs", "relative_rms"):
        table.add_column(column)
    for tensor in result.tensors:
        table.add_row(
            inert(tensor["name"]),
            "[green]yes[/green]" if tensor["bit_exact"] else "[red]NO[/red]",
            f"{tensor['max_abs']:.3g}",
            f"{tensor['relative_rms']:.3g}",
        )
    console.print(table)
    for name in result.only_in_first:
        console.print(f"only in {first}: {inert(name)}")
    for name in result.only_in_second:
        console.print(f"only in {second}: {inert(name)}")
    for entry in result.metadata:
        console.print(f"{inert(entry['field'])}: {inert(repr(entry['first']))} -> {inert(repr(entry['second']))}")
    first = result.first_difference
    if first is not None:
        console.print(
            f"first difference: [bold]{inert(first['name'])}[/bold] max_abs {first['max_abs']:.3g} "
            f"relative_rms {first['relative_rms']:.3g}"
        )
    console.print("[green]tensors identical[/green]" if result.identical_tensors else "[red]tensors differ[/red]")
    sys.exit(0 if result.identical_tensors else 1)
