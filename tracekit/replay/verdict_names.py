"""The verdicts a bundle can get and the exit code of each: the contract of `tracekit replay`.

Kept apart from the logic that decides them (`verdict.py`, which needs torch) so the command's
parent process, which never imports torch (`cli/isolation.py`), can name a crashed replay.
"""

from enum import Enum

from tracekit.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_RUN_HERE,
    EXIT_NONDETERMINISTIC,
    EXIT_NOT_REPLAYABLE_YET,
    EXIT_NOT_REPRODUCED,
    EXIT_OK,
    EXIT_REPLAY_FAILED,
)


class VerdictName(str, Enum):
    """Every verdict a bundle can get: the seven of a replayed step, the five only a replay under
    another vLLM release than the recording's gives, and the five of a step that did not replay."""

    BIT_EXACT = "bit_exact"
    WITHIN_TOLERANCE = "within_tolerance"
    PLATFORM_DIFFERENCE = "platform_difference"
    DIVERGED = "diverged"
    # Not reproduced, and replays of the step from the same restored state disagree among
    # themselves (`tracekit.replay.repeats`): the engine does not repeat itself there.
    NONDETERMINISTIC = "nondeterministic"
    ERROR_REPRODUCED = "error_reproduced"  # a step recorded because it raised, raised again
    ERROR_NOT_REPRODUCED = "error_not_reproduced"
    # Under another release: only float rounding moved; the recorded error or non-finite outputs
    # are gone, or an error or non-finite outputs appeared.
    RELEASE_DIFFERENCE = "release_difference"
    ERROR_GONE = "error_gone"
    ERROR_APPEARED = "error_appeared"
    NONFINITE_GONE = "nonfinite_gone"
    NONFINITE_APPEARED = "nonfinite_appeared"
    BAD_INPUT = "bad_input"
    CANNOT_RUN_HERE = "cannot_run_here"
    # the step used something tracekit records but cannot replay yet (exit 5): no machine can
    CANNOT_REPLAY_YET = "cannot_replay_yet"
    CRASHED = "crashed"  # the replay itself failed (exit 4)
    NO_STEP = "no_step"  # a bundle holding no recorded step: nothing to replay

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES.get(self, EXIT_OK)


_EXIT_CODES = {
    VerdictName.DIVERGED: EXIT_NOT_REPRODUCED,
    VerdictName.NONDETERMINISTIC: EXIT_NONDETERMINISTIC,
    VerdictName.ERROR_NOT_REPRODUCED: EXIT_NOT_REPRODUCED,
    VerdictName.ERROR_GONE: EXIT_NOT_REPRODUCED,
    VerdictName.ERROR_APPEARED: EXIT_NOT_REPRODUCED,
    VerdictName.NONFINITE_GONE: EXIT_NOT_REPRODUCED,
    VerdictName.NONFINITE_APPEARED: EXIT_NOT_REPRODUCED,
    VerdictName.BAD_INPUT: EXIT_BAD_INPUT,
    VerdictName.CANNOT_RUN_HERE: EXIT_CANNOT_RUN_HERE,
    VerdictName.CANNOT_REPLAY_YET: EXIT_NOT_REPLAYABLE_YET,
    VerdictName.CRASHED: EXIT_REPLAY_FAILED,
}
NOT_REPLAYED = {verdict.exit_code: verdict for verdict in (VerdictName.BAD_INPUT, VerdictName.CANNOT_RUN_HERE,
                                                          VerdictName.CANNOT_REPLAY_YET, VerdictName.CRASHED)}


def not_replayed(exit_code: int) -> VerdictName:
    """The verdict of a bundle that did not replay, by the exit code of what stopped it (`NOT_REPLAYED`)."""
    return NOT_REPLAYED.get(exit_code, VerdictName.BAD_INPUT)

# Worst last; the order, and why: docs/GUIDE.md, "Bundles as a regression suite".
EXIT_SEVERITY = (EXIT_OK, EXIT_CANNOT_RUN_HERE, EXIT_NOT_REPLAYABLE_YET, EXIT_BAD_INPUT, EXIT_REPLAY_FAILED,
                 EXIT_NONDETERMINISTIC, EXIT_NOT_REPRODUCED)


def worst_exit_code(codes) -> int:
    """The exit code of many bundles' replays: the worst of theirs (`EXIT_SEVERITY`)."""
    return max(codes, key=EXIT_SEVERITY.index, default=EXIT_OK)
