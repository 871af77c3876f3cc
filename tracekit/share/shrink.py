"""`shrink(bundle, output, until)`: the smallest batch of a recorded step that keeps a property.

Delta debugging (Zeller's ddmin) over the step's requests in batch order, then, for each prefill
chunk that remains, the shortest chunk (a binary search over where it ends) that still keeps
the property. Every trial is a replay of the cut step on one engine, reused throughout; a trial
already judged is never replayed again. The search order depends only on the bundle, so a second
run on the same bundle and engine gives the same bundle, byte for byte.

The result records where it came from (file name and sha256), the property and the counts in its
`derivations`; it holds no outputs (a cut batch was never run by the engine that recorded it).
"""

import hashlib
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from tracekit import __version__
from tracekit.errors import UsageError
from tracekit.format.schema import BundleContent, Step
from tracekit.outputs import require_parent
from tracekit.share.properties import PropertyOutcome, StepProperty, StepReplayer, parse_property
from tracekit.share.reduce_step import reduce_step, scheduled_tokens


@dataclass
class ShrinkReport:
    output: str
    property: str
    requests_before: int
    requests_after: int
    tokens_before: int
    tokens_after: int
    replays: int
    seconds: float
    kept: dict[str, int] = field(default_factory=dict)

    def to_plain(self) -> dict[str, Any]:
        return dict(vars(self))


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ddmin(items: list[str], holds: Callable[[list[str]], bool]) -> list[str]:
    """A 1-minimal sublist of `items` (order kept) for which `holds` is true; `holds(items)` is."""
    granularity = 2
    while len(items) >= 2:
        size = -(-len(items) // granularity)
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        for chunk in chunks:
            if holds(chunk):
                items, granularity = chunk, 2
                break
        else:
            for chunk in chunks:
                complement = [item for item in items if item not in chunk]
                if holds(complement):
                    items, granularity = complement, max(granularity - 1, 2)
                    break
            else:
                if granularity >= len(items):
                    break
                granularity = min(len(items), 2 * granularity)
    return items


def shortest_length(length: int, holds: Callable[[int], bool]) -> int:
    """The smallest n in [1, length] found by bisection with `holds(n)` (true at `length`)."""
    low, high = 1, length
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return high


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


class EngineReplayer(StepReplayer):
    """Builds the recorded engine on first use (or takes `llm`) and runs steps on it (also
    `tracekit invariance`'s variants)."""

    def __init__(self, content: BundleContent, llm: Any, model: str | None, allow_weights_mismatch: bool,
                 workdir: Path | None = None, recorded: Step | None = None):
        self.content = content
        self.llm = llm
        self.recorded = recorded  # the step the trials cut (its LoRA adapters are found with the engine)
        self.adapters: Any = None  # where they are here (`LocatedAdapters`), once the engine is built
        self.model = model
        self.allow_weights_mismatch = allow_weights_mismatch
        self.workdir = workdir

    def engine(self) -> Any:
        """The replay engine (a `tracekit.integrations.vllm.replay_engine.ReplayEngine`), built on
        first use; a fresh view of it, with a fresh runner adapter, for every trial."""
        from tracekit.integrations.vllm.replay_engine import (
            EngineSpec,
            build_replay_engine,
            engine_of,
            locate_lora_adapters,
            require_recorded_release_here,
        )

        content = self.content
        if self.adapters is None and self.recorded is not None:
            self.adapters = locate_lora_adapters(self.recorded, {}, self.allow_weights_mismatch)
        if self.llm is None:
            require_recorded_release_here(content)
            self.llm = build_replay_engine(EngineSpec(content.engine, recorded=content.environment, model=self.model,
                                                      allow_weights_mismatch=self.allow_weights_mismatch)).llm
        return engine_of(self.llm, content.engine.runner)

    def close(self) -> None:
        """Remove what was written to find the LoRA adapters (the engine stays: `llm`)."""
        if self.adapters is not None:
            self.adapters.close()

    def adapter(self) -> Any:
        return self.engine().adapter

    def run(self, step: Step, on_forward: Any) -> Any:
        engine = self.engine()
        try:
            return engine.driver(step, self.adapters.paths if self.adapters is not None else None).run(on_forward)
        finally:
            engine.forget_cached_prefixes()

    def engine_mode(self) -> str:
        return self.adapter().reference_mode

    def write(self, step: Step) -> Path:
        path = self.workdir / "candidate.zst"
        write_step(path, self.content, step, [])
        return path


def write_step(path: str | Path, content: BundleContent, step: Step, derivations: list[dict[str, Any]]) -> Path:
    from tracekit.format.content import write_content

    return write_content(path, BundleContent(
        environment=content.environment,
        engine=content.engine,
        steps=[step],
        schema_version=content.schema_version,
        created_at=content.created_at,  # the step was recorded then; keeps a rerun byte-identical
        derivations=[*content.derivations, *derivations],
        extras=dict(content.extras),
    ))


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
    prop = parse_property(until, tolerance)
    output = Path(output)
    require_parent(output)
    content, recorded = load_step(bundle, step)
    require_replayable_kind(recorded)
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
        derivation = {
            "kind": "shrink",
            "tool": f"tracekit {__version__}",
            "from": {"file": Path(bundle).name, "sha256": file_sha256(bundle), "step": recorded.index},
            "property": until,
            **({"tolerance": tolerance} if until == "modes-differ" else {}),
            **{name: getattr(report, name) for name in (
                "requests_before", "requests_after", "tokens_before", "tokens_after", "replays", "kept")},
        }
        write_step(output, content, final, [derivation])
    report.seconds = time.perf_counter() - started
    return report
