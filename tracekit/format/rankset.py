"""The bundles of one multi-rank step: finding a part's siblings and telling whether the set is whole.

A tensor- or pipeline-parallel step is one bundle per rank (`ParallelRank`). Given any part, this
finds the others (at their recorded paths first, then among the bundles of the same folder) and
reports the ranks missing and any part that does not belong. Only metadata is read, and the paths
a stranger's bundle names are only opened as bundles, a capped number of them.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.errors import BundleError
from tracekit.format.reader import open_bundle
from tracekit.format.schema import BundleContent, ParallelRank, SchedulerOutputRecord

MAX_FOLDER_SCAN = 256  # bundles of a part's folder read when looking for renamed siblings


@dataclass
class RankSet:
    """The parts found for one step of one recording session."""

    parallel: ParallelRank  # the layout and session, as the part the set was found from has them
    step_index: int
    parts: dict[int, Path] = field(default_factory=dict)  # rank -> bundle
    expected: dict[int, Path] = field(default_factory=dict)  # rank -> where the recorder wrote it
    problems: list[str] = field(default_factory=list)  # parts that do not belong to this step

    @property
    def missing(self) -> list[int]:
        return [rank for rank in range(self.parallel.world_size) if rank not in self.parts]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.problems

    def require_complete(self) -> None:
        """Raise `BundleError` (exit 2) naming what is wrong with the set."""
        if self.problems:
            raise BundleError(f"the ranks' bundles do not belong together: {self.problems[0]}")
        if self.missing:
            where = ", ".join(
                f"rank {rank}" + (f" (expected at {self.expected[rank]})" if rank in self.expected else "")
                for rank in self.missing
            )
            raise BundleError(
                f"step {self.step_index} was recorded on {self.parallel.world_size} ranks, but {where} "
                f"{'is' if len(self.missing) == 1 else 'are'} missing; replaying needs every rank's bundle"
            )

    def to_plain(self) -> dict:
        return {
            "world_size": self.parallel.world_size,
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
            "pipeline_parallel_size": self.parallel.pipeline_parallel_size,
            "set_id": self.parallel.set_id,
            "step": self.step_index,
            "parts": {str(rank): str(path) for rank, path in sorted(self.parts.items())},
            "missing": self.missing,
            "problems": self.problems,
            "complete": self.complete,
        }


def read_part(path: str | Path) -> BundleContent:
    """A bundle's content (metadata only; its rank fields are checked with it)."""
    with open_bundle(path) as reader:
        content = BundleContent.from_plain(reader.metadata)
    if len(content.steps) != 1 and content.parallel.multi_rank:
        raise BundleError(f"{path}: a rank's bundle holds exactly one step, this one holds {len(content.steps)}")
    return content


def find_rank_set(path: str | Path) -> RankSet:
    """The set `path` belongs to; a single-rank bundle is a set of one."""
    path = Path(path)
    content = read_part(path)
    parallel = content.parallel
    found = RankSet(parallel, content.steps[0].index if content.steps else 0, parts={parallel.rank: path})
    if not parallel.multi_rank:
        return found
    folder = path.parent
    reference = content.steps[0].scheduler_output
    for rank, relative in enumerate(parallel.parts):
        if rank == parallel.rank or os.path.isabs(relative):
            continue
        expected = folder / relative
        found.expected[rank] = expected
        if expected.is_file():
            _consider(found, expected, reference, listed_rank=rank)
    if found.missing:
        for candidate in _folder_bundles(folder, path):
            _consider(found, candidate, reference, listed_rank=None)
            if not found.missing:
                break
    return found


def _consider(found: RankSet, candidate: Path, reference: SchedulerOutputRecord, listed_rank: int | None) -> None:
    """Add `candidate` to the set if it is another rank of the same step; where the recorder put
    a sibling (`listed_rank`), a bundle that is not one is a problem, elsewhere it is ignored."""
    try:
        content = read_part(candidate)
    except (BundleError, OSError) as error:
        if listed_rank is not None:
            found.problems.append(f"rank {listed_rank}'s bundle {candidate} cannot be read: {error}")
        return
    parallel = content.parallel
    step = content.steps[0] if content.steps else None
    if parallel.set_id != found.parallel.set_id or step is None or step.index != found.step_index or not parallel.multi_rank:
        if listed_rank is not None:
            found.problems.append(
                f"{candidate} (where rank {listed_rank}'s bundle of step {found.step_index} belongs) holds "
                f"{_describe(parallel, step)}, not step {found.step_index} of session {found.parallel.set_id}"
            )
        return
    if parallel.rank in found.parts:
        return
    if (parallel.world_size, parallel.tensor_parallel_size) != (found.parallel.world_size, found.parallel.tensor_parallel_size):
        found.problems.append(f"{candidate} has another parallel layout (world size {parallel.world_size})")
    elif step.scheduler_output != reference:
        found.problems.append(f"{candidate}: rank {parallel.rank} ran another batch than the other ranks")
    else:
        found.parts[parallel.rank] = candidate


def _describe(parallel: ParallelRank, step) -> str:
    if step is None:
        return "no step"
    if not parallel.multi_rank:
        return f"step {step.index} of a single-rank engine"
    return f"rank {parallel.rank} of step {step.index} of session {parallel.set_id}"


def _folder_bundles(folder: Path, exclude: Path) -> list[Path]:
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if entry.is_file())
    except OSError:
        return []
    candidates = [folder / name for name in names if name != exclude.name]
    return candidates[:MAX_FOLDER_SCAN]
