"""`tracekit redact BUNDLE -o SHAREABLE`: a copy that replays bit-exact without the prompts.

What is removed and what a KV cache still reveals: docs/GUIDE.md, "What a redacted bundle still
reveals".
"""

import click

from tracekit.cli.arguments import bundle_argument, force_option
from tracekit.cli.terminal import console_for, inert


@click.command("redact")
@bundle_argument()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the redacted bundle.")
@force_option()
def redact_command(bundle, output, force):
    """Remove from BUNDLE what its step's forward and sampling do not read (prompts, ids, ...)."""
    from tracekit.outputs import claim_outputs
    from tracekit.share.redact import redact

    claim_outputs({"-o": output}, [bundle], force)
    _print_redacted(bundle, output, redact(bundle, output))


def _print_redacted(bundle: str, output: str, record: dict) -> None:
    console = console_for()
    console.print(f"[bold green]redacted[/bold green] {inert(bundle)} -> {inert(output)}")
    for step in record["steps"]:
        blanked = sum(step["token_ids_blanked"].values())
        console.print(f"  {step['request_ids_renamed']} request id(s) renamed, {blanked} token id(s) set to "
                      f"{record['neutral_token_id']}")
        for req_id, readers in step["history_kept"].items():
            console.print(f"  [yellow]kept[/yellow] every token id of {inert(req_id)}: its sampling or the drafter "
                          f"reads them ({inert(', '.join(readers))})")
        for req_id, fields in step["sampling_fields_removed"].items():
            console.print(f"  removed {inert(', '.join(fields))} of {inert(req_id)}")
    if record["env_vars_removed"]:
        console.print(f"  removed environment variables {inert(', '.join(record['env_vars_removed']))}")
