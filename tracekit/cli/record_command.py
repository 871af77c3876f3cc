"""`tracekit record`: run a workload on a real vLLM engine and record the steps it picks (with no
arguments, the first mixed step of the built-in workload on the embedded tiny model). Options it
does not know are vLLM engine arguments (`arguments.refuse_unknown_options`).
"""

import click

from tracekit.cli.arguments import (
    ENGINE_ARGUMENTS,
    comma_separated,
    force_option,
    refuse_unknown_options,
    steps_option,
    verbose_option,
)
from tracekit.errors import UsageError
from tracekit.format.schema import KV_MODES
from tracekit.record.triggers import DEFAULT_MAX_BUNDLES, EVENT_TRIGGERS

DEFAULT_OUTPUT = "tracekit-bundle.zst"


@click.command("record", context_settings=ENGINE_ARGUMENTS)
@click.option("--model", default=None,
              help="Model path or name, run with vLLM's own engine defaults. Default: the embedded tiny Llama "
                   "(float32, a 64 MiB KV cache, a 64-token budget).")
@click.option("--prompts", type=click.Path(dir_okay=False), help="JSON lines or one prompt per line.")
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate per request (default 12).")
@steps_option("Step indices to record: 7, 5:9, 3,7,10:12.")
@click.option("--when", default=None, help="Predicate: e.g. 'num_reqs>=2 and has_prefill', 'mixed'.")
@click.option("--on", "events", multiple=True, metavar="EVENTS",
              help=f"Record a step whose forward raises / whose outputs are not finite: {', '.join(EVENT_TRIGGERS)}, "
                   f"or both comma separated ({','.join(EVENT_TRIGGERS)}).")
@click.option("--kv", type=click.Choice(KV_MODES), default="read", show_default=True,
              help="KV blocks to save: all the forward reads, only those it writes, or none; recompute: none, "
                   "and the replay rebuilds them by prefilling the recorded tokens.")
@click.option("-o", "--output", default=DEFAULT_OUTPUT, show_default=True,
              help="Bundle path; put {step} in it to record every matching step, one bundle each.")
@click.option("--max-bundles", type=int, default=DEFAULT_MAX_BUNDLES, show_default=True,
              help="With {step} in the output: the most bundles one run writes.")
@click.option("--layers", is_flag=True,
              help="Also store every decoder layer's output (norms, attention, MLP) of a recorded step, so "
                   "a replay names the first layer that diverges. Needs an eager engine (--enforce-eager).")
@click.option("--window", type=int, default=1, show_default=True,
              help="Keep this many consecutive steps in each bundle from a firing step on: the first whole, "
                   "each later one as the engine handed it to the model runner and what came out, so a replay "
                   "lets the runner carry its state from step to step. Starts at --steps/--when.")
@click.option("--keep-lora-weights", is_flag=True,
              help="Keep every LoRA adapter's files in the bundles, whatever their size (by default only "
                   "adapters up to 64 MiB; a replay finds the others by fingerprint, or through --lora).")
@force_option()
@verbose_option()
@click.pass_context
def record_command(ctx, verbose, prompts, events, **options):
    """Record engine steps of a real vLLM engine into bundles."""
    refuse_unknown_options(ctx.args, ctx.command)  # before anything imports torch or vLLM
    from tracekit.cli.engine_output import engine_output
    from tracekit.record.session import record_workload

    events = comma_separated(events)
    if options["steps"] is None and options["when"] is None and not events:
        options["when"] = "mixed"
    with engine_output(verbose, "record") as output:
        written = record_workload(engine_argv=list(ctx.args), prompts_file=prompts, events=events, **options)
        if not written:
            raise UsageError("no step matched the trigger; nothing was recorded")
        for path in written:
            click.echo(f"recorded {path}", file=output.report)
        if output.log_line():
            click.echo(output.log_line(), file=output.report)
