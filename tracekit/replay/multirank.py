"""Replaying one step of a multi-rank (tensor-parallel) engine: every rank at once, on an engine of
the recorded parallel layout, so its collectives run as they did (docs/GUIDE.md, "Multi-rank
engines"). Each rank restores and checks its own part inside its worker (`replay_in_workers`);
the first divergence is named with its rank.
"""

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tracekit.format.rankset import find_rank_set
from tracekit.graphs.timing import HOST_CLOCK, latency_summary
from tracekit.integrations.vllm.replay_engine import (
    EngineSpec,
    build_replay_engine,
    require_layout_buildable,
    require_recorded_release_here,
    require_replayable_kind,
)
from tracekit.replay import replay_in_workers
from tracekit.replay.checks import first_divergence
from tracekit.replay.opened import OpenedBundle
from tracekit.replay.options import ReplayOptions
from tracekit.replay.result import ReplayResult, outcome_fields
from tracekit.replay.verdict import Verdict


@dataclass
class RankSetReplayResult:
    bundle: str
    step_index: int
    trigger: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    ranks: list[ReplayResult]  # by rank, each checked against its own recording
    # Per timed run, the slowest rank's forward: the step takes as long as its slowest rank.
    step_latency_us: dict[str, Any] | None = None
    environment_differences: list[dict[str, Any]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    tolerance: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def bit_exact(self) -> bool:
        return all(rank.bit_exact for rank in self.ranks)

    @property
    def reproduced(self) -> bool:
        return all(rank.reproduced for rank in self.ranks)

    @property
    def first_divergence(self) -> str | None:
        """`rank R: ITEM` — the earliest item in forward order that diverged on any rank (the
        lowest such rank on a tie)."""
        diverged = []
        for rank, result in enumerate(self.ranks):
            item = first_divergence(result.checks)
            if item is not None:
                diverged.append((result.checks.index(item), rank, item.name))
        if not diverged:
            return None
        _, rank, name = min(diverged)
        return f"rank {rank}: {name}"

    @property
    def worst_rank(self) -> ReplayResult:
        """The rank whose verdict decides the step's (the first of those with the worst exit code)."""
        return max(self.ranks, key=lambda rank: rank.exit_code)

    @property
    def verdict(self) -> Verdict:
        return self.worst_rank.verdict

    @property
    def exit_code(self) -> int:
        """The worst rank's: each rank's verdict decides as a single-rank replay's does."""
        return self.worst_rank.exit_code

    def to_plain(self) -> dict[str, Any]:
        return {
            **outcome_fields(self),
            "world_size": self.world_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "tolerance_relative_rms": self.tolerance,
            "ranks": [{"rank": rank, **result.to_plain()} for rank, result in enumerate(self.ranks)],
            "step_latency_us": self.step_latency_us,
            "environment_differences": self.environment_differences,
            "overrides": self.overrides,
        }


def replay_rank_set(bundle: str | Path | OpenedBundle, options: ReplayOptions) -> RankSetReplayResult:
    """Replay the step `bundle` (any rank's part) belongs to, on every rank: checked, and timed as
    the engine ran it unless `options.modes` is None (`plan` refuses the options it cannot honour)."""
    with OpenedBundle.of(bundle) as opened:
        rank_set = find_rank_set(opened.path)  # reads the part's rank fields (and checks them)
        rank_set.require_complete()
        content = opened.content
    overrides = dict(options.engine_overrides)
    for step in content.steps:
        require_replayable_kind(step)
    require_recorded_release_here(content)
    require_layout_buildable(content.parallel, overrides)
    bundles = [str(Path(rank_set.parts[rank]).absolute()) for rank in range(rank_set.parallel.world_size)]
    runs = options.iters * options.samples if options.modes is not None else 0
    engine = build_replay_engine(EngineSpec(content.engine, recorded=content.environment, model=options.model,
                                            allow_weights_mismatch=options.allow_weights_mismatch, overrides=overrides))
    session = uuid.uuid4().hex
    try:
        prepared = engine.on_every_worker(replay_in_workers.prepare_replay, session, bundles)
        outcomes = engine.on_every_worker(replay_in_workers.run_replay, session, options.tolerance, runs)
        engine.forget_cached_prefixes()
    finally:
        engine.release()
    step = content.steps[0]
    per_rank = [
        ReplayResult(
            bundle=bundles[rank],
            step_index=step.index,
            trigger=step.trigger,
            reference_mode=outcome["reference_mode"],
            checks=outcome["checks"],
            modes={outcome["reference_mode"]: {
                "mode": outcome["reference_mode"],
                "available": True,
                "latency_us": latency_summary(outcome["times_us"], options.samples, HOST_CLOCK),
            }} if runs else {},
            recorded_timing=outcome["recorded_timing"],
            replay_forward_us=outcome["forward_us"],
            environment_differences=prepared[rank]["environment_differences"],
            tolerance=options.tolerance,
            strict=options.strict,
        )
        for rank, outcome in enumerate(outcomes)
    ]
    slowest = np.max([outcome["times_us"] for outcome in outcomes], axis=0) if runs else None
    return RankSetReplayResult(
        bundle=str(opened.path),
        step_index=step.index,
        trigger=step.trigger,
        tensor_parallel_size=rank_set.parallel.tensor_parallel_size,
        pipeline_parallel_size=rank_set.parallel.pipeline_parallel_size,
        ranks=per_rank,
        step_latency_us=latency_summary(slowest, options.samples, "perf_counter, slowest rank") if runs else None,
        environment_differences=prepared[0]["environment_differences"],
        overrides=overrides,
        tolerance=options.tolerance,
    )
