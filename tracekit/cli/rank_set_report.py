"""The human-readable report of a multi-rank replay: the verdict, one row per rank, then what diverged where."""

from typing import Any, TextIO

from tracekit.cli.replay_report import print_differences
from tracekit.cli.terminal import console_for, inert, table
from tracekit.replay.multirank import RankSetReplayResult
from tracekit.replay.verdict import VerdictName


def _ms(value: Any) -> str:
    return f"{value / 1000:.2f}" if isinstance(value, (int, float)) else "-"


def print_rank_set_report(result: RankSetReplayResult, stream: TextIO | None = None, needs: str | None = None) -> None:
    """Every rank's replay of one step: the verdict first, what the bundle needs, one row per rank,
    then each rank's items that are not bit-exact."""
    console = console_for(stream)
    _print_verdict(console, result)
    if needs:
        console.print(inert(needs))
    layout = f"TP={result.tensor_parallel_size}" + (
        f" PP={result.pipeline_parallel_size}" if result.pipeline_parallel_size > 1 else ""
    )
    console.print(
        f"[bold]replay[/bold] {inert(result.bundle)}  step {inert(result.step_index)} ({inert(result.trigger)}), "
        f"{result.world_size} ranks ({layout})"
    )
    print_differences(console, result.environment_differences, result.overrides)
    _print_ranks(console, result)
    for rank, replayed in enumerate(result.ranks):
        diverged = [item for item in replayed.checks if not item.bit_exact]
        if not diverged:
            continue
        detail = table(console, f"rank {rank}: items not bit-exact", ["item", "within tol", "max_abs", "relative_rms"])
        for item in diverged:
            detail.add_row(inert(item.name), "yes" if item.within_tolerance else "[red]no[/red]",
                           str(item.details.get("max_abs", "-")), str(item.details.get("relative_rms", "-")))
        console.print(detail)


def _print_ranks(console, result: RankSetReplayResult) -> None:
    """One row per rank (forward times in ms: recorded, replayed cold, then the timed runs), and
    the step's, its slowest rank's per run."""
    ranks = table(console, "per rank (forward times in ms: recorded, replayed cold, then timed runs)",
                  ["rank", "verdict", "first divergence", "recorded", "replay", "median", "min"],
                  right=("recorded", "replay", "median", "min"))
    for rank, replayed in enumerate(result.ranks):
        latency = next(iter(replayed.modes.values()), {}).get("latency_us", {})
        name = replayed.verdict.name
        colour = "green" if name == VerdictName.BIT_EXACT else "red" if replayed.exit_code else "yellow"
        ranks.add_row(str(rank), f"[{colour}]{name.value}[/{colour}]", inert(replayed.first_divergence or "-"),
                      _ms(replayed.recorded_timing.get("forward_us")), _ms(replayed.replay_forward_us),
                      _ms(latency.get("median")), _ms(latency.get("min")))
    if result.step_latency_us:
        step = result.step_latency_us
        ranks.add_row("step", "", "slowest rank per run",
                      _ms(max((r.recorded_timing.get("forward_us") or 0 for r in result.ranks), default=None)),
                      _ms(max((r.replay_forward_us or 0 for r in result.ranks), default=None)),
                      _ms(step["median"]), _ms(step["min"]))
    console.print(ranks)


def _print_verdict(console, result: RankSetReplayResult) -> None:
    verdict = result.verdict
    if result.exit_code == 0:
        how = {VerdictName.BIT_EXACT: "bit-exact", VerdictName.WITHIN_TOLERANCE: f"within tolerance {result.tolerance:g}"}
        console.print(f"verdict [bold]{verdict.name.value}[/bold]: [bold green]REPRODUCED[/bold green] on all "
                      f"{result.world_size} ranks ({how.get(verdict.name, inert(verdict.reason))}; exit 0)")
    else:
        console.print(f"verdict [bold]{verdict.name.value}[/bold]: [bold red]NOT REPRODUCED[/bold red]: first "
                      f"divergence at [bold]{inert(result.first_divergence or '-')}[/bold] ({inert(verdict.reason)}; "
                      f"exit {result.exit_code})")
