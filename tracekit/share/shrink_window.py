"""Shrinking a window of steps (`tracekit shrink` of a `record --window` bundle, issue 32): the
fewest steps and requests that still part from the recording at the same step and item (`--until
diverges`), or still raise the recorded error in the window's last step (`--until raises`).

1. The steps after the one that parts (or raises), S, are dropped.
2. Leading steps: for K = S, S-1, ..., the window is replayed with the runner's state rebuilt at
   K (`replay --from K`, cut at S); K holds when the steps before it replayed bit-exact — so the
   KV cache at K is the recording's, as far as any check sees — and S still parts (raises) as
   before. The largest K that holds becomes the first step: whole, its request states derived from
   the bundle, the KV blocks it reads copied from the replay engine's cache just before its
   forward (the derivation says so). Windows are short: at most S replays of at most S steps.
3. Requests: delta debugging (`shrink.ddmin`) over the window's requests, where the window parts
   first in what the runner fed the model — batch order, input ids, positions — which depend on
   the requests' tokens and the schedule alone. A cut drops a request from every step (its
   scheduler outputs rebuilt, its token rows of the inputs, its sampled ids) and drops the float
   outputs (hidden states, logits: a smaller batch may round otherwise); a smaller batch may also
   sample otherwise (V1 draws unseeded requests from one generator), which shows as a sampled id
   parting, in the same step or an earlier one, so never as the item the window parts at. Where
   the window parts first in a float item or a sampled id, its requests are kept (the derivation
   says so); a cut that leaves a step with no request does not hold.
"""

import dataclasses
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from tracekit.errors import UsageError
from tracekit.format.schema import (
    BundleContent,
    CarriedStep,
    KVMode,
    KVSnapshot,
    Step,
    StepOutputs,
)
from tracekit.outputs import require_parent
from tracekit.share.reduce_step import reduce_step
from tracekit.share.shrink_trials import EngineReplayer, ShrinkReport, ddmin, shrink_derivation, write_step

WINDOW_PROPERTIES = ("diverges", "raises")
# The items a window may part at for its requests to be cut: what the runner fed the model, which
# a smaller batch does not change.
FED_ITEMS = ("batch_order", "input_ids", "positions")


@dataclasses.dataclass
class _Trial:
    holds: bool
    detail: str
    result: Any = None


class _WindowTrials:
    """Replays candidate windows on one engine and judges them against the original's target."""

    def __init__(self, replayer: EngineReplayer, until: str, console: Console):
        self.replayer = replayer
        self.until = until
        self.console = console
        self.replays = 0
        self.target: str | None = None  # the original's first divergence (`step S/item`), or the step that raises

    def run(self, first: Step, from_step: int | None = None, last: int | None = None, keep_kv_read: bool = False) -> Any:
        from tracekit.replay.replayer import replay_candidate

        self.replays += 1
        return replay_candidate(self.replayer.engine(), self.replayer.content, first, from_step=from_step, until=last,
                                keep_kv_read=keep_kv_read, lora_paths=self.replayer.lora_paths)

    def judge(self, result: Any, before: int | None = None) -> _Trial:
        """Whether the replay keeps the property: the steps before `before` (a rebuilt step) bit-exact,
        and the same step and item parting (or the last step raising as recorded)."""
        if before is not None:
            parted = [step.step_index for step in result.steps if step.step_index < before and not step.bit_exact]
            if parted:
                return _Trial(False, f"step {parted[0]} before the rebuilt one parted", result)
        if self.until == "raises":
            verdict = result.verdict.name.value
            return _Trial(verdict == "error_reproduced", verdict, result)
        found = result.first_divergence
        return _Trial(found == self.target, f"first divergence {found or 'none'}", result)

    def show(self, what: str, trial: _Trial) -> None:
        mark = "[green]holds[/green]" if trial.holds else "[dim]no[/dim]"
        self.console.print(f"  replay {self.replays:>3}: {what}  {mark}  [dim]{trial.detail}[/dim]", highlight=False)


def shrink_window(bundle: str | Path, output: str | Path, until: str, *, content: BundleContent, first: Step,
                  replayer: EngineReplayer, console: Console) -> ShrinkReport:
    """Shrink the window `first` opens (see the module doc) and write it to `output`."""
    from tracekit.integrations.vllm.replay_engine import expand_window

    started = time.perf_counter()
    if until not in WINDOW_PROPERTIES:
        raise UsageError(f"--until {until} is not for a window of steps: choose one of {', '.join(WINDOW_PROPERTIES)}")
    if until == "raises" and not any(carried.error for carried in first.later):
        raise UsageError("--until raises needs a window whose last step raised when it was recorded")
    output = Path(output)
    require_parent(output)
    trials = _WindowTrials(replayer, until, console)
    steps = expand_window(first, content)
    console.print(f"[bold]shrink[/bold] {bundle}: a window of steps {steps[0].index}..{steps[-1].index}, until {until}",
                  highlight=False)
    original = trials.judge(trials.run(first))
    last = _last_step(original.result, until)
    if last is None:
        raise UsageError(f"--until {until} does not hold on {bundle} ({original.detail}); nothing written")
    trials.target = original.result.first_divergence
    trials.show(f"steps {steps[0].index}..{steps[-1].index}", dataclasses.replace(original, holds=True))
    start, kept_first = _drop_leading_steps(trials, first, steps, last)
    window = _window_from(start, kept_first, steps, first.runner_calls, last)
    requests_before = _requests_of(window)
    final, cut_note = _drop_requests(trials, window, requests_before)
    final_steps = expand_window(final, content)
    kept: dict[str, int] = {}
    for each in final_steps:
        for request in each.step.requests:
            kept[request.req_id] = kept.get(request.req_id, 0) + request.num_scheduled_tokens
    report = ShrinkReport(
        output=str(output), property=until, requests_before=len(requests_before), requests_after=len(kept),
        tokens_before=_tokens(steps), tokens_after=_tokens(final_steps), replays=trials.replays, seconds=0.0,
        kept=kept,
    )
    derivation = shrink_derivation(
        bundle, first.index, until, report,
        target=trials.target if until == "diverges" else f"step {last} raises",
        steps_before=[each.index for each in steps],
        steps_after=final.window_indices,
        # the KV blocks the first step reads: from the recording, or from the replay engine's
        # cache after a bit-exact replay of the steps dropped before it
        first_step_kv="recorded" if start == steps[0].index else "replayed",
        **({"requests_not_cut": cut_note} if cut_note else {}),
    )
    write_step(output, content, final, [derivation])
    report.seconds = time.perf_counter() - started
    return report


def _last_step(result: Any, until: str) -> int | None:
    """The step the property is about (the first that parts, the one that raises), None: it does not hold."""
    if until == "raises":
        return result.steps[-1].step_index if result.verdict.name.value == "error_reproduced" else None
    if result.first_divergence is None:
        return None
    return int(result.first_divergence.split("/", 1)[0].removeprefix("step "))


def _drop_leading_steps(trials: _WindowTrials, first: Step, steps: list[Any], last: int) -> tuple[int, Step]:
    """The latest step the window can start at (rebuilt there) and keep the property; with it,
    the blocks that step read in the replay that showed it (None for the recorded first step)."""
    for start in range(last, steps[0].index, -1):
        result = trials.run(first, from_step=start, last=last, keep_kv_read=True)
        trial = trials.judge(result, before=start)
        trials.show(f"steps {start}..{last}, rebuilt at {start}", trial)
        if trial.holds:
            return start, _with_kv(next(each.step for each in steps if each.index == start), result.sequence.kv_read[start])
    return steps[0].index, first


def _with_kv(step: Step, kv_read: list[dict[str, Any]]) -> Step:
    """A later step of a window made a first step: the blocks it reads, as a replay's forward read
    them, saved with it (mode `read`)."""
    groups = [dataclasses.replace(group, saved_block_ids=list(group.read_block_ids), before=blocks, after={})
              for group, blocks in zip(step.kv.groups, kv_read)]
    return dataclasses.replace(step, kv=KVSnapshot(mode=KVMode.READ.value, groups=groups), window=None)


def _window_from(start: int, first: Step, steps: list[Any], calls: list[dict[str, Any]], last: int) -> Step:
    """`first` (step `start`) followed by the recorded steps after it up to `last`."""
    by_index = {each.index: each for each in steps}
    carried = [by_index[index].carried for index in range(start + 1, last + 1)]
    return first.with_later(carried, by_index[start].held, [call for call in calls if start <= call["step"] <= last],
                            requested=len(carried) + 1)


def _requests_of(first: Step) -> list[str]:
    """Every request a window's steps run, in the order they first run."""
    seen = dict.fromkeys(first.batch_order)
    for carried in first.later:
        seen.update(dict.fromkeys(carried.batch_order))
    return list(seen)


def _tokens(steps: list[Any]) -> int:
    return sum(request.num_scheduled_tokens for each in steps for request in each.step.requests)


def _drop_requests(trials: _WindowTrials, first: Step, requests: list[str]) -> tuple[Step, str | None]:
    """The window with the fewest requests that keeps the property (delta debugging); a note
    where requests cannot be cut."""
    from tracekit.integrations.vllm.replay_engine import expand_window

    if trials.until == "diverges" and trials.target.split("/", 1)[1] not in FED_ITEMS:
        return first, (f"the window parts first at {trials.target}, which a smaller batch may change by itself "
                       "(float rounding, random draws): its requests are kept")
    if first.grammar is not None or any(carried.grammar is not None
                                        for carried in first.later):
        return first, "a step holds a grammar mask (structured outputs): its requests are kept"
    steps = expand_window(first, trials.replayer.content)
    judged: dict[tuple[str, ...], bool] = {}

    def holds(kept: list[str]) -> bool:
        key = tuple(kept)
        if key not in judged:
            candidate = _cut(steps, first, set(kept))
            if candidate is None:
                judged[key] = False
            else:
                trial = trials.judge(trials.run(candidate))
                trials.show(f"{len(kept)} request(s)", trial)
                judged[key] = trial.holds
        return judged[key]

    kept = ddmin(list(requests), holds) if len(requests) > 1 else list(requests)
    if kept == list(requests):
        return first, None
    return _cut(steps, first, set(kept)), None


def _cut(steps: list[Any], first: Step, keep: set[str]) -> Step | None:
    """The window with only the requests in `keep` (None where a step would run none): each step's
    batch, scheduler output and inputs cut (`reduce_step`), its discrete outputs kept for them."""
    cut_steps = []
    for each in steps:
        step = each.step
        counts = {request.req_id: request.num_scheduled_tokens for request in step.requests if request.req_id in keep}
        if not counts:
            return None
        cut = reduce_step(step, counts)
        cut_steps.append(dataclasses.replace(cut, outputs=_discrete_outputs(step, counts)))
    held = [request for request in steps[0].held if request.req_id in keep]
    carried = [_as_carried(cut, each.carried, keep) for cut, each in zip(cut_steps[1:], steps[1:])]
    return cut_steps[0].with_later(carried, held, first.runner_calls)


def _discrete_outputs(step: Step, kept: dict[str, int]) -> StepOutputs | None:
    """The sampled ids of the kept requests (their float outputs depend on the whole batch)."""
    if step.outputs is None or step.outputs.sampled_token_ids is None:
        return None
    rows = [ids for req_id, ids in zip(step.batch_order, step.outputs.sampled_token_ids) if req_id in kept]
    return StepOutputs(sampled_token_ids=rows)


def _as_carried(cut: Step, recorded: CarriedStep, keep: set[str]) -> CarriedStep:
    """A cut later step back as a window's step: the drafter's proposals of the kept requests (token
    ids, as the sampled ones), and no digest of its KV writes (floats: they depend on the batch)."""
    rows = [row for row, req_id in enumerate(recorded.batch_order) if req_id in keep]
    proposals = recorded.proposals
    if proposals is not None and proposals.dim() >= 1 and proposals.shape[0] == len(recorded.batch_order):
        proposals = proposals[rows]
    return dataclasses.replace(
        recorded,
        scheduler_output=cut.scheduler_output,
        batch_order=cut.batch_order,
        runner_states={req_id: state for req_id, state in recorded.runner_states.items() if req_id in keep},
        input_ids=cut.input_ids,
        positions=cut.positions,
        graph=cut.graph,
        outputs=cut.outputs,
        timing=dataclasses.replace(recorded.timing),
        proposals=proposals,
        kv_written=[],
    )

