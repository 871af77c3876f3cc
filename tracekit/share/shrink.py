"""`shrink(bundle, output, until)`: the fewest steps, requests and tokens of a recorded bundle of
N >= 1 steps that keep a property (`properties`), so that a failure is shared as small as it gets.

One search (docs/GUIDE.md#shrink): by steps (`_Search.fewest_steps`), then requests (`ddmin`),
then, of a single step, each prefill chunk's end (`shortest_length`). Every trial is judged once,
in an order that depends only on the bundle, so a second run writes the same bundle byte for byte.
"""

import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from tracekit.errors import UsageError
from tracekit.format.schema import Step
from tracekit.outputs import require_parent
from tracekit.share.properties import PropertyOutcome, StepProperty, parse_property
from tracekit.share.reduce_step import cut_steps, reduce_step, scheduled_tokens, steps_between
from tracekit.share.shrink_trials import (
    EngineReplayer,
    ShrinkReport,
    ddmin,
    shortest_length,
    write_step,
)


class _Search:
    """The steps a shrink has come down to, and the candidates judged on them: each at most once,
    each judgement shown as it comes."""

    def __init__(self, prop: StepProperty, replayer: EngineReplayer, console: Console, first: Step):
        self.prop = prop
        self.replayer = replayer
        self.console = console
        self.several = bool(first.later)
        self.outcomes: dict[Any, PropertyOutcome] = {}
        self.replays = 0
        self.start_at(first)

    def start_at(self, first: Step) -> None:
        """Go on with the steps `first` opens."""
        from tracekit.integrations.vllm.replay_engine import expand_window

        self.first = first
        self.steps = expand_window(first, self.replayer.content)
        self.requests = scheduled_tokens(*(each.step for each in self.steps))

    def judge(self, key: Any, what: str, evaluate: Callable[[], PropertyOutcome]) -> PropertyOutcome:
        if key not in self.outcomes:
            self.replays += 1
            with self.console.status(f"replay {self.replays}: {what}"):
                outcome = self.outcomes[key] = evaluate()
            mark = "[green]holds[/green]" if outcome.holds else "[dim]no[/dim]"
            self.console.print(f"  replay {self.replays:>3}: {what}  {mark}  [dim]{outcome.detail}[/dim]",
                               highlight=False)
        return self.outcomes[key]

    def candidate(self, keep: dict[str, int]) -> Step | None:
        """The steps with only the requests in `keep` (req_id -> its tokens; of a single step, how
        many of its scheduled tokens it keeps); None where a step would run none."""
        if keep == self.requests:
            return self.first
        if self.several:
            return cut_steps(self.steps, self.first, set(keep))
        return reduce_step(self.first, keep)

    def outcome(self, keep: dict[str, int]) -> PropertyOutcome:
        key = (self.first.index, len(self.steps), tuple(keep.items()))
        if key not in self.outcomes:
            candidate = self.candidate(keep)
            if candidate is None:
                return PropertyOutcome(False, "a step runs none of the requests")
            what = f"{len(keep):>3} request(s) {sum(keep.values()):>5} token(s)"
            self.judge(key, what, lambda: self.prop.evaluate(candidate, self.replayer))
        return self.outcomes[key]

    def holds(self, req_ids: list[str]) -> bool:
        return self.outcome({req_id: self.requests[req_id] for req_id in req_ids}).holds

    def fewest_steps(self, bundle_replay: Any) -> dict[str, Any]:
        """Go on with the steps from the latest K that keeps the property, rebuilt there, to the
        step S it is about (`bundle_replay`: the bundle's own;
        docs/GUIDE.md#windows-bugs-that-live-between-steps, "Shrinking"); the derivation's fields."""
        before = [each.index for each in self.steps]
        last, target = self.prop.aim(bundle_replay)
        start, kv_read = before[0], None
        for rebuilt in range(last, before[0], -1):
            outcome = self.judge(("from", rebuilt), f"steps {rebuilt}..{last}, rebuilt at {rebuilt}", lambda k=rebuilt: (
                self.prop.judge(self.replayer.replay(self.first, from_step=k, until=last, keep_kv_read=True), before=k)))
            if outcome.holds:
                start, kv_read = rebuilt, outcome.result.sequence.kv_read[rebuilt]
                break
        self.start_at(steps_between(self.first, self.steps, start, last, kv_read))
        return {
            "target": target,
            "steps_before": before,
            "steps_after": self.first.window_indices,
            # the KV blocks the first step reads: from the recording, or from the replay engine's
            # cache after a bit-exact replay of the steps dropped before it
            "first_step_kv": "recorded" if kv_read is None else "replayed",
        }


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
    """Cut the bundle's steps down while `until` holds and write the result to `output`. Pass
    `llm` to replay on an engine you hold (it must be built for the bundle's engine arguments)."""
    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.replay_engine import require_replayable_kind

    started = time.perf_counter()
    console = console or Console(stderr=True, highlight=False)
    output = Path(output)
    require_parent(output)
    content, recorded = load_step(bundle, step)
    require_replayable_kind(recorded)
    prop = parse_property(until, tolerance, several=bool(recorded.later))
    prop.check_bundle(recorded)
    with tempfile.TemporaryDirectory(prefix="tracekit-shrink-") as workdir, \
            closing(EngineReplayer(content, recorded, llm, model, allow_weights_mismatch, Path(workdir))) as replayer:
        search = _Search(prop, replayer, console, recorded)
        original = search.requests
        steps = f"steps {recorded.index}..{search.steps[-1].index}, " if search.several else ""
        console.print(f"[bold]shrink[/bold] {bundle}: {steps}{len(original)} request(s), {sum(original.values())} "
                      f"token(s), until {until}", highlight=False)
        itself = search.outcome(original)
        if not itself.holds:
            raise UsageError(f"--until {until} does not hold on {bundle} ({itself.detail}); nothing written")
        # a command is judged on the written bundle, not on a replay to find the steps it needs in
        more = search.fewest_steps(itself.result) if search.several and itself.result is not None else {}
        not_cut = prop.requests_kept(search.first) if search.several else None
        kept = list(search.requests) if not_cut else ddmin(list(search.requests), search.holds)
        keep = {req_id: search.requests[req_id] for req_id in kept}
        for req_id in [] if search.several else kept:  # a decode schedules one token; a chunk can end earlier
            if keep[req_id] > 1:
                keep[req_id] = shortest_length(keep[req_id], lambda n, r=req_id: search.outcome({**keep, r: n}).holds)
        report = ShrinkReport(
            output=str(output),
            property=until,
            requests_before=len(original),
            requests_after=len(keep),
            tokens_before=sum(original.values()),
            tokens_after=sum(keep.values()),
            replays=search.replays,
            seconds=0.0,
            kept=keep,
        )
        if not_cut:
            more["requests_not_cut"] = not_cut
        if until == "modes-differ":
            more["tolerance"] = tolerance
        write_step(output, content, search.candidate(keep), [report.derivation(bundle, recorded.index, **more)])
    report.seconds = time.perf_counter() - started
    return report
