"""Replaying many bundles as a regression suite, one engine per engine configuration (why, exit
codes and what a suite reports: docs/GUIDE.md, "Bundles as a regression suite"). The bundles are
read first (metadata only) and grouped by `engine_key` (kernel choices that disagree part a group);
each group's engine holds what all its steps need (`EngineNeeds`, their union).
"""

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.bundles import unique_names
from tracekit.errors import (
    EXIT_CANNOT_RUN_HERE,
    EXIT_OK,
    EXIT_REPLAY_FAILED,
    TracekitError,
    one_line,
)
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, EngineConfig, KernelChoice
from tracekit.graphs import kernel_choices
from tracekit.integrations.vllm.replay_engine import (
    EngineNeeds,
    engine_key,
    needs_of,
    release_llm,
    require_replayable_kind,
    union_of,
)
from tracekit.replay.opened import OpenedBundle
from tracekit.replay.options import ReplayOptions, options_from
from tracekit.replay.replayer import ReplayResult, replay
from tracekit.replay.verdict_names import NOT_REPLAYED, VerdictName, not_replayed, worst_exit_code


@dataclass
class SuiteRecord:
    """One bundle's outcome: a replay result, or the error that kept it from replaying."""

    bundle: str
    name: str  # unique among the suite's bundles (profile files are named after it)
    verdict: str
    exit_code: int
    engine: int | None = None  # which engine it replayed on, counting from 1
    engine_built: bool = False  # whether its replay built that engine
    seconds: float = 0.0  # wall time of its replay, engine build included
    error: str | None = None
    result: ReplayResult | None = field(default=None, repr=False)

    @property
    def timed(self) -> dict[str, Any]:
        """The timing of the forwards in the mode the engine ran (empty where none ran)."""
        return self.result.modes.get(self.result.reference_mode, {}) if self.result else {}

    @property
    def forward_us(self) -> float | None:
        """The median of the timed forwards in the mode the engine ran (None when not timed: the
        checked run alone is cold, no match for the recorded time of a warm engine)."""
        return self.timed["latency_us"]["median"] if self.timed.get("available") else None

    @property
    def recorded_forward_us(self) -> float | None:
        return self.result.recorded_timing.get("forward_us") if self.result else None

    def to_plain(self) -> dict[str, Any]:
        """One JSON line: the suite's fields, then the full replay result (docs/GUIDE.md, "JSON fields")."""
        plain = {key: getattr(self, key) for key in ("bundle", "name", "verdict", "exit_code", "error", "engine",
                                                    "engine_built", "seconds", "forward_us", "recorded_forward_us")}
        plain["seconds"] = round(self.seconds, 3)
        if self.result is not None:
            plain.update({key: value for key, value in self.result.to_plain().items() if key not in plain})
        return plain


def record_of(result: ReplayResult, name: str, **suite_fields: Any) -> SuiteRecord:
    return SuiteRecord(result.bundle, name, result.verdict.name.value, result.exit_code, result=result, **suite_fields)


def refused_record(bundle: Path, name: str, error: TracekitError) -> SuiteRecord:
    """The record of a bundle refused before or by its replay: the verdict of the error's exit code."""
    return SuiteRecord(str(bundle), name, not_replayed(error.exit_code).value, error.exit_code, error=str(error))


@dataclass
class SuiteOutcome:
    records: list[SuiteRecord]
    not_run: list[str]  # bundles left after the first failure (without --keep-going)
    engines_built: int

    @property
    def exit_code(self) -> int:
        return worst_exit_code([record.exit_code for record in self.records])


def run_suite(
    bundles: Sequence[Path],
    options: ReplayOptions | None = None,
    *,
    keep_going: bool = False,
    profile_dir: Path | None = None,
    on_start: Callable[[int, Path, bool], None] = lambda index, bundle, building: None,
    on_done: Callable[[SuiteRecord], None] = lambda record: None,
    names: dict[Path, str] | None = None,
    **fields: Any,
) -> SuiteOutcome:
    """Replay every bundle with `options` (or its fields as keywords; model and engine overrides
    shape every engine built; profiles go to `profile_dir`), stopping at the first that does not exit
    0 unless `keep_going`; `on_start(position, bundle, building_engine)` and `on_done(record)` report
    progress; `names`: the bundles' names where a caller named them among more (after a crash)."""
    options = options_from(options, fields)
    names = names or dict(zip(bundles, unique_names(bundles)))
    records: list[SuiteRecord] = []
    groups: list[EngineGroup] = []
    for bundle in bundles:
        try:  # read, and refused where no engine is needed to say so
            with open_bundle(bundle) as reader:
                content = BundleContent.from_plain(reader.metadata)
            step = next((s for s in content.steps if options.step in (None, s.index)), None)
            if step is not None:
                require_replayable_kind(step)
        except TracekitError as error:
            records.append(refused_record(bundle, names[bundle], error))
        else:
            if content.steps:
                group = group_of(groups, engine_key(content), content.engine)
                group.bundles.append(bundle)
                if step is not None:  # a bundle without the step is refused by its replay
                    group.needs.append(needs_of(step, options.modes))
                continue
            records.append(SuiteRecord(str(bundle), names[bundle], VerdictName.NO_STEP.value, EXIT_OK,
                                       error="holds no recorded step"))
        on_done(records[-1])
    queue = [bundle for group in groups for bundle in group.bundles]
    if any(record.exit_code != EXIT_OK for record in records) and not keep_going:
        return SuiteOutcome(records, [str(bundle) for bundle in queue], 0)

    engines_built = 0
    for group in groups:
        llm, engine_error = None, None
        # A diverged bundle is replayed again on the group's engine only: a fresh process for
        # each would cost an engine build, and on a device the group's engine with it.
        group_options = dataclasses.replace(options, engine_needs=union_of(group.needs),
                                            kernel_choices=group.choice_list(), repeat_fresh=False)
        try:
            for bundle in group.bundles:
                queue.remove(bundle)
                on_start(len(records), bundle, llm is None and engine_error is None)
                if engine_error is not None:  # this group's engine could not be built here
                    record = refused_record(bundle, names[bundle], engine_error)
                else:
                    building = llm is None
                    record, llm, refusal = replay_one(bundle, names[bundle], llm, profile_dir, group_options)
                    # Refused before an engine existed (weights not here, vLLM refused the arguments): every
                    # bundle of the group needs that same engine.
                    if building and refusal is not None and refusal.exit_code == EXIT_CANNOT_RUN_HERE:
                        engine_error = refusal
                    engines_built += record.engine_built
                    if record.verdict not in {name.value for name in NOT_REPLAYED.values()}:
                        record.engine = engines_built
                records.append(record)
                on_done(record)
                if record.exit_code != EXIT_OK and not keep_going:
                    return SuiteOutcome(records, [str(bundle) for bundle in queue], engines_built)
        finally:
            if llm is not None:
                release_llm(llm)
    return SuiteOutcome(records, [], engines_built)


@dataclass
class EngineGroup:
    """The bundles one engine of a suite replays: they need the same engine (`engine_key`) and
    their kernel choices (by lookup hash; the engine is built under their union) agree."""

    key: str
    choices: dict[str, KernelChoice] = field(default_factory=dict)
    bundles: list[Path] = field(default_factory=list)
    needs: list[EngineNeeds] = field(default_factory=list)  # each bundle's step's, for a lean engine

    def choice_list(self) -> list[KernelChoice]:
        return sorted(self.choices.values(), key=lambda choice: choice.source_hash)


def group_of(groups: list[EngineGroup], key: str, recorded: EngineConfig) -> EngineGroup:
    """The group of engine `key` that takes `recorded`'s kernel choices; a new one where every
    such group has one of its kernels in another configuration (its kernels are built under
    another lookup table)."""
    for group in groups:
        if group.key == key and kernel_choices.merged_if_consistent(group.choices, recorded.kernel_choices):
            return group
    groups.append(EngineGroup(key))
    kernel_choices.merged_if_consistent(groups[-1].choices, recorded.kernel_choices)
    return groups[-1]


def replay_one(bundle: Path | OpenedBundle, name: str, llm: Any, profile_dir: Path | None,
               options: ReplayOptions) -> tuple[SuiteRecord, Any, TracekitError | None]:
    """Replay one bundle (a path, or one the caller opened) on `llm` (None: build one): its record,
    the engine for the next bundle, and the error that refused it (None where it ran or crashed)."""
    building = llm is None
    path = bundle.path if isinstance(bundle, OpenedBundle) else bundle
    options = dataclasses.replace(options, profile_prefix=profile_dir / name if profile_dir else None)
    if not building:  # model and overrides shaped the engine when it was built
        options = dataclasses.replace(options, model=None, engine_overrides={})
    started = time.perf_counter()
    try:
        result = replay(bundle, options, llm=llm)
    except TracekitError as error:
        return refused_record(path, name, error), llm, error
    except Exception as error:  # inside vLLM, the device or tracekit (exit 4): the engine may be left mid-step
        if llm is not None:
            try:
                release_llm(llm)
            except Exception:  # a device the failure poisoned: the next engine says so itself
                pass
        return SuiteRecord(str(path), name, VerdictName.CRASHED.value, EXIT_REPLAY_FAILED, error=one_line(error),
                           engine_built=building, seconds=time.perf_counter() - started), None, None
    return record_of(result, name, engine_built=building, seconds=time.perf_counter() - started), result.llm, None
