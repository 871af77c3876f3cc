"""What the shrink search is built from (`tracekit invariance` replays on the same engine): the
engine candidates replay on, the searches over what to keep, the report, and the written result
with where it came from.
"""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tracekit.format.schema import BundleContent, Step


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

    def derivation(self, bundle: str | Path, step: int, **more: Any) -> dict[str, Any]:
        """The `shrink` entry of the result's `derivations`: where it came from, the property,
        `more` (the search's own fields) and the counts."""
        from tracekit import __version__

        return {
            "kind": "shrink",
            "tool": f"tracekit {__version__}",
            "from": {"file": Path(bundle).name, "sha256": file_sha256(bundle), "step": step},
            "property": self.property,
            **more,
            **{name: getattr(self, name) for name in (
                "requests_before", "requests_after", "tokens_before", "tokens_after", "replays", "kept")},
        }


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


class EngineReplayer:
    """Builds the recorded engine on first use (or takes `llm`) and runs steps on it (also
    `tracekit invariance`'s variants)."""

    def __init__(self, content: BundleContent, recorded: Step, llm: Any, model: str | None,
                 allow_weights_mismatch: bool, workdir: Path | None = None):
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
        if self.adapters is None:
            self.adapters = locate_lora_adapters(self.recorded, {}, self.allow_weights_mismatch)
        if self.llm is None:
            require_recorded_release_here(content)
            self.llm = build_replay_engine(EngineSpec(content.engine, recorded=content.environment, model=self.model,
                                                      allow_weights_mismatch=self.allow_weights_mismatch)).llm
        return engine_of(self.llm, content.engine.runner)

    @property
    def lora_paths(self) -> dict[int, str] | None:
        """Where the recorded step's LoRA adapters are here, by int id (None: not looked for)."""
        return self.adapters.paths if self.adapters is not None else None

    def close(self) -> None:
        """Remove what was written to find the LoRA adapters (the engine stays: `llm`)."""
        if self.adapters is not None:
            self.adapters.close()

    def run(self, step: Step, on_forward: Any) -> Any:
        """The step replayed (an `ObservedStep`); raises what its forward raises."""
        engine = self.engine()
        try:
            return engine.driver(step, self.lora_paths, on_forward=on_forward).run_one()
        finally:
            engine.forget_cached_prefixes()

    def replay(self, first: Step, **window: Any) -> Any:
        """`first` and the steps after it replayed, checked against the recording (a
        `ReplayResult`; `window`: `replay_candidate`'s from_step, until, keep_kv_read)."""
        from tracekit.replay.replayer import replay_candidate

        return replay_candidate(self.engine(), self.content, first, lora_paths=self.lora_paths, **window)

    def write(self, step: Step) -> Path:
        """A bundle file holding the step (for a `command:` property)."""
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
