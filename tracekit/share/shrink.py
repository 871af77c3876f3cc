"""`shrink(bundle, output, until)`: the smallest batch of a recorded step that keeps a property.

Delta debugging (Zeller's ddmin) over the step's requests in batch order, then, for each prefill
chunk that remains, the shortest chunk (a binary search over where it ends) that still keeps
the property. Every trial is a replay of the cut step on one engine, reused throughout; a trial
already judged is never replayed again. The search order depends only on the bundle, so a second
run on the same bundle and engine gives the same bundle, byte for byte.

A window of steps (`record --window`) is shrunk by `shrink_window`, by steps, then requests.

The result records where it came from (file name and sha256), the property and the counts in its
`derivations`; it holds no outputs (a cut batch was never run by the engine that recorded it).
"""

import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from rich.console import Console

from tracekit.errors import UsageError
from tracekit.format.schema import Step
from tracekit.outputs import require_parent
from tracekit.share.properties import PropertyOutcome, StepProperty, StepReplayer, parse_property
from tracekit.share.reduce_step import reduce_step, scheduled_tokens
from tracekit.share.shrink_trials import (
    EngineReplayer,
    ShrinkReport,
    ddmin,
    shortest_length,
    shrink_derivation,
    write_step,
)


class _Trials:
    """Judges cut steps, each at most once, and shows each judgement as it comes."""

    def __init__(self, step: Step, prop: StepProperty, replayer: StepReplayer, console: Console):
        self.step = step
        self.prop = prop
        self.replayer = replayer
        self.console = console
        self.outcomes: dict[tuple[tuple[str, int], ...], PropertyOutcome] = {}

    def holds(self, keep: dict[str, int]) -> bool:
        key = tuple((req_id, keep[req_id]) for req_id in self.step.batch_order if req_id in keep)
        if key not in self.outcomes:
            candidate = self.step if dict(key) == scheduled_tokens(self.step) else reduce_step(self.step, dict(key))
            with self.console.status(f"replay {len(self.outcomes) + 1}: {len(key)} request(s), "
                                     f"{sum(count for _, count in key)} token(s)"):
                outcome = self.prop.evaluate(candidate, self.replayer)
            self.outcomes[key] = outcome
            mark = "[green]holds[/green]" if outcome.holds else "[dim]no[/dim]"
            self.console.print(
                f"  replay {len(self.outcomes):>3}: {len(key):>3} request(s) {sum(c for _, c in key):>5} token(s)  "
                f"{mark}  [dim]{outcome.detail}[/dim]", highlight=False,
            )
        return self.outcomes[key].holds


def shrink(
    bundle: str | Path,
    output: str | Path,
    until: str,
    *,
    tolerance: float = 0.0,
    step: int | None = None,
    model: str | None = None,
    allow_weights_mismatch: bool = False,
    llm: Any = None,
    console: Console | None = None,
) -> ShrinkReport:
    """Cut the step down while `until` holds and write the result to `output`. Pass `llm` to
    replay on an engine you hold (it must be built for the bundle's engine arguments)."""
    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.replay_engine import require_replayable_kind

    started = time.perf_counter()
    console = console or Console(stderr=True, highlight=False)
    output = Path(output)
    require_parent(output)
    content, recorded = load_step(bundle, step)
    require_replayable_kind(recorded)
    if recorded.later:
        from tracekit.share.shrink_window import shrink_window

        with closing(EngineReplayer(content, llm, model, allow_weights_mismatch, recorded=recorded)) as replayer:
            return shrink_window(bundle, output, until, content=content, first=recorded, replayer=replayer,
                                 console=console)
    prop = parse_property(until, tolerance)
    prop.check_bundle(recorded)
    original = scheduled_tokens(recorded)
    with tempfile.TemporaryDirectory(prefix="tracekit-shrink-") as workdir, \
            closing(EngineReplayer(content, llm, model, allow_weights_mismatch, Path(workdir), recorded)) as replayer:
        trials = _Trials(recorded, prop, replayer, console)
        console.print(f"[bold]shrink[/bold] {bundle}: {len(original)} request(s), {sum(original.values())} "
                      f"token(s), until {until}", highlight=False)
        if not trials.holds(original):
            detail = next(iter(trials.outcomes.values())).detail
            raise UsageError(f"--until {until} does not hold on {bundle} ({detail}); nothing written")
        kept_ids = ddmin(list(original), lambda ids: trials.holds({i: original[i] for i in ids}))
        keep = {req_id: original[req_id] for req_id in kept_ids}
        for req_id in kept_ids:  # a decode schedules one token; a prefill chunk can end earlier
            if keep[req_id] > 1:
                keep[req_id] = shortest_length(keep[req_id], lambda n, r=req_id: trials.holds({**keep, r: n}))
        final = recorded if keep == original else reduce_step(recorded, keep)
        report = ShrinkReport(
            output=str(output),
            property=until,
            requests_before=len(original),
            requests_after=len(keep),
            tokens_before=sum(original.values()),
            tokens_after=sum(keep.values()),
            replays=len(trials.outcomes),
            seconds=0.0,
            kept=keep,
        )
        derivation = shrink_derivation(bundle, recorded.index, until, report,
                                       **({"tolerance": tolerance} if until == "modes-differ" else {}))
        write_step(output, content, final, [derivation])
    report.seconds = time.perf_counter() - started
    return report
