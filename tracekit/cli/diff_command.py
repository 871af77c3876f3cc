"""`tracekit diff A B`: where two bundles differ — tensors first, then metadata.

Exit 0 when every tensor is bit-identical (metadata such as versions may still differ), 1 when
a tensor differs or exists in one bundle only, 2 on a bad bundle. `--json` is strict JSON: a
difference that is not a finite number is null, with what it was beside it.
"""

import sys

import click

from tracekit.cli.arguments import force_option, json_option, json_took_an_argument
from tracekit.cli.terminal import console_for, inert, table


@click.command("diff")
@click.argument("first", type=click.Path(dir_okay=False, exists=True), required=False)
@click.argument("second", type=click.Path(dir_okay=False, exists=True), required=False)
@json_option("the comparison")
@force_option()
def diff_command(first, second, json_out, force):
    """Compare two bundles tensor by tensor (e.g. one step recorded on two machines)."""
    from tracekit.format.diff import diff_bundles
    from tracekit.outputs import claim_outputs, write_json

    if first is None or second is None:
        json_took_an_argument(json_out, "SECOND" if first else "FIRST")
    claim_outputs({"--json": json_out}, [first, second], force)
    result = diff_bundles(first, second)
    if json_out:
        write_json(result.to_plain(), json_out, indent=2)
    else:
        _print_diff(result, first, second)
    sys.exit(0 if result.identical_tensors else 1)


def _print_diff(result, first: str, second: str) -> None:
    console = console_for()
    tensors = table(console, "tensors", ["name", "bit-exact", "max_abs", "relative_rms"])
    for tensor in result.tensors:
        tensors.add_row(inert(tensor["name"]), "[green]yes[/green]" if tensor["bit_exact"] else "[red]NO[/red]",
                        f"{tensor['max_abs']:.3g}", f"{tensor['relative_rms']:.3g}")
    if result.tensors:
        console.print(tensors)
    for bundle, names in ((first, result.only_in_first), (second, result.only_in_second)):
        for name in names:
            console.print(f"only in {inert(bundle)}: {inert(name)}")
    for entry in result.metadata:
        console.print(f"{inert(entry['field'])}: {inert(repr(entry['first']))} -> {inert(repr(entry['second']))}")
    difference = result.first_difference
    if difference is not None:
        console.print(f"first difference: [bold]{inert(difference['name'])}[/bold] max_abs {difference['max_abs']:.3g} "
                      f"relative_rms {difference['relative_rms']:.3g}")
    console.print("[green]tensors identical[/green]" if result.identical_tensors else "[red]tensors differ[/red]")
