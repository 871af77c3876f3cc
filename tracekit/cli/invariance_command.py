"""`tracekit invariance BUNDLE`: does each request of the recorded step come out bit-identical
in other batches (docs/GUIDE.md#batch-invariance, with the exit codes)? The work runs in a child
process, as `tracekit replay`'s does (`isolation`).
"""

import sys

import click

from tracekit.cli.arguments import bundle_argument, one_step, one_step_options
from tracekit.cli.isolation import crash_record, print_crash, run_isolated
from tracekit.cli.terminal import console_for, inert


@click.command("invariance")
@bundle_argument()
@click.option("--variants", default="all", show_default=True,
              help="Comma-separated variant kinds to run: repeat, alone, order, fillers, recomputed (or all).")
@one_step_options("The step to check, of a bundle holding several (default: the first).", "the report")
def invariance_command(bundle, variants, steps, model, allow_weights_mismatch, json_out, force, verbose):
    """Replay BUNDLE's step in other batches on one engine and check, per request, that its
    logits row and sampled ids stay bit-identical to its result in the recorded batch."""
    from tracekit.outputs import claim_outputs, write_json

    claim_outputs({"--json": json_out}, [bundle], force)
    step = one_step(steps)
    to_stderr = json_out == "-"

    outcome = run_isolated(
        lambda progress: _check(bundle, variants, step, model, allow_weights_mismatch, progress, verbose, to_stderr))
    records = outcome.records
    if outcome.died_on is not None:
        crashed = crash_record(outcome.died_on, outcome.death)
        print_crash(crashed, sys.stderr if to_stderr else sys.stdout)
        records = [crashed]
    if json_out and records:
        write_json(records[-1], json_out, indent=1)
    sys.exit(outcome.exit_code)


def _check(bundle, variants, step, model, allow_weights_mismatch, progress, verbose, to_stderr) -> int:
    from tracekit.cli.engine_output import engine_output
    from tracekit.errors import TracekitError, one_line
    from tracekit.replay.opened import OpenedBundle
    from tracekit.replay.verdict_names import not_replayed
    from tracekit.share.invariance import check_invariance

    with OpenedBundle(bundle) as opened:
        facts = opened.facts(step)
    progress.started(bundle, **facts)
    with engine_output(verbose, "invariance") as output:
        stream = output.errors if to_stderr else output.report
        console_for(stream).print(f"[bold]invariance[/bold] {inert(bundle)}  step {inert(facts.get('step'))}: the "
                               "recorded batch, then each variant, on one engine")
        try:
            report = check_invariance(bundle, kinds=variants, step=step, model=model,
                                      allow_weights_mismatch=allow_weights_mismatch,
                                      on_variant=lambda outcome: _print_variant(outcome, stream))
        except TracekitError as error:  # refused: one line (printed by the caller), and its record
            progress.finished({"bundle": bundle, **facts, "verdict": not_replayed(error.exit_code).value,
                               "exit_code": error.exit_code, "error": str(error)})
            raise
        except Exception as error:  # inside vLLM, the device or tracekit: says nothing about the step
            crashed = crash_record({"started": bundle, **facts}, one_line(error))
            print_crash(crashed, stream)
            progress.finished(crashed)
            return crashed["exit_code"]
        print_summary(report.to_plain(), stream)
        if output.log_line():
            console_for(stream).print(f"   {inert(output.log_line())}")
    progress.finished(report.to_plain())
    return report.exit_code


def _print_variant(outcome, stream) -> None:
    console = console_for(stream)
    if not outcome.applicable:
        console.print(f"  {inert(outcome.name):<28} [dim]not applicable: {inert(outcome.reason)}[/dim]")
        return
    head = f"  {inert(outcome.name):<28} {outcome.num_tokens:>5} tok {len(outcome.compared):>3} req  "
    if outcome.reordered_by_runner:
        head += f"[dim](the runner ran {inert(outcome.batch_order)})[/dim] "
    if outcome.invariant:
        console.print(head + "[green]same[/green]")
        return
    console.print(head + f"[bold red]{len(outcome.moved)} moved[/bold red]")
    for req_id, moved in outcome.moved.items():
        console.print(f"      {inert(req_id)}: {_moved_text(moved)}")


def _moved_text(moved: dict) -> str:
    parts = []
    logits = moved.get("logits")
    if logits:
        parts.append(f"logits max_abs {logits['max_abs']:.3g}, relative RMS {logits['relative_rms']:.3g}, "
                     f"argmax {'same' if logits.get('argmax_agreement', 1.0) == 1.0 else 'CHANGED'}")
    if "sampled" in moved:
        parts.append(f"sampled {inert(moved['sampled']['baseline'])} -> {inert(moved['sampled']['variant'])}")
    return "; ".join(parts)


def print_summary(plain: dict, stream) -> None:
    """What was compared, the thresholds chosen, and the verdict (after the per-variant lines)."""
    console = console_for(stream)
    thresholds = plain["thresholds"]
    console.print(f"  engine: {plain['runner'].upper()} runner, {plain['engine_mode']}")
    if any(variant["kind"] == "fillers" for variant in plain["variants"]):
        console.print(f"  fillers to: {inert(thresholds['filler_targets'] or 'none')} tokens "
                      f"(step {thresholds['step_tokens']}, most per step {thresholds['max_num_batched_tokens']}; "
                      f"thresholds out of reach {inert(thresholds['unreachable'] or 'none')})")
    for req_id, how in plain["sampling"].items():
        console.print(f"  sampled ids of {inert(req_id)}: {inert(how)}")
    for note in plain["notes"]:
        console.print(f"  [yellow]note[/yellow]: {inert(note)}")
    if plain["invariant"]:
        ran = sum(1 for variant in plain["variants"] if variant["applicable"])
        console.print(f"verdict [bold green]invariant[/bold green]: every request bit-identical in {ran} variant(s) (exit 0)")
        return
    layer = plain["first_layer"] or {}
    where = (f"; first module that moved: {inert(layer['module'])} (request {inert(layer['request'])}, "
             f"max_abs {layer['max_abs']:.3g})" if layer.get("module") else f"; layer: {inert(layer.get('reason'))}")
    console.print(f"verdict [bold red]not invariant[/bold red]: first broken variant "
                  f"{inert(plain['first_broken_variant'])}{where} (exit 1)")
