"""`tracekit redact BUNDLE -o SHAREABLE`: a copy that replays bit-exact without the prompts.

What is removed and what a KV cache still reveals: docs/GUIDE.md, "Redact".
"""

import click


@click.command("redact")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the redacted bundle.")
def redact_command(bundle, output):
    """Remove from BUNDLE what its step's forward and sampling do not read (prompts, ids, ...)."""
    from pathlib import Path

    from rich.console import Console

    from tracekit.errors import UsageError
    from tracekit.share.redact import redact

    if not Path(bundle).is_file():
        raise UsageError(f"no bundle at {bundle}")
    record = redact(bundle, output)
    console = Console(highlight=False)
    console.print(f"[bold green]redacted[/bold green] {bundle} -> {output}")
    for step in record["steps"]:
        blanked = sum(step["token_ids_blanked"].values())
        console.print(f"  {step['request_ids_renamed']} request id(s) renamed, {blanked} token id(s) set to "
                      f"{record['neutral_token_id']}")
        for req_id, readers in step["history_kept"].items():
            console.print(f"  [yellow]kept[/yellow] every token id of {req_id}: its sampling or the drafter reads them "
                          f"({', '.join(readers)})")
        for req_id, fields in step["sampling_fields_removed"].items():
            console.print(f"  removed {', '.join(fields)} of {req_id}")
    if record["env_vars_removed"]:
        console.print(f"  removed environment variables {', '.join(record['env_vars_removed'])}")
