"""Errors that carry a user-facing message and the CLI exit code they map to.

The exit codes are a contract (`git bisect run`, CI): 0 reproduced/ok, 1 ran but did not
reproduce, 2 bad input or usage, 3 this machine cannot do it (missing weights, vLLM absent or
incompatible, no graph-capable device), 4 the replay itself failed inside vLLM, CUDA or tracekit
(a device-side assert, an illegal address, an unexpected exception): it says nothing yet about
whether the step reproduces; 5 no machine can replay it with this tracekit: the step used
something tracekit records but cannot replay yet (multimodal inputs, prompt embeds, ...); 6 the
engine does not repeat itself: replays of the step from the same restored state disagree among
themselves (vLLM is non-deterministic there), so whether it reproduces cannot be told.
"""

import traceback

EXIT_OK = 0
EXIT_NOT_REPRODUCED = 1
EXIT_BAD_INPUT = 2
EXIT_CANNOT_RUN_HERE = 3
EXIT_REPLAY_FAILED = 4
EXIT_NOT_REPLAYABLE_YET = 5
EXIT_NONDETERMINISTIC = 6


class TracekitError(Exception):
    """Base class: `str(error)` is one readable line for the user."""

    exit_code = EXIT_BAD_INPUT


class BundleError(TracekitError):
    """A bundle is malformed, damaged, too large, or from an unsupported format version."""


class UsageError(TracekitError):
    """Bad arguments: an unknown trigger expression, an unwritable output path, ..."""


class CannotRunHere(TracekitError):
    """The request is valid but this machine cannot carry it out."""

    exit_code = EXIT_CANNOT_RUN_HERE


class NotReplayableYet(TracekitError):
    """The step used something this tracekit records but cannot replay yet: no machine could
    replay it with this tracekit (unlike `CannotRunHere`, which another machine may)."""

    exit_code = EXIT_NOT_REPLAYABLE_YET


def one_line(error: BaseException) -> str:
    """`Type: message` of an exception, its message cut to the first line (CUDA errors come with
    paragraphs of advice). An exception with no message (a bare `assert` in vLLM) names the line
    that raised it instead: without it the line says nothing a user can act on."""
    text = str(error).strip()
    if text:
        return f"{type(error).__name__}: {text.splitlines()[0]}"
    return f"{type(error).__name__}: (no message) raised at {raised_at(error)}"


def raised_at(error: BaseException) -> str:
    """`package/module.py:LINE in FUNCTION` of the frame that raised `error`; its path from the
    top package (`vllm/...`, `tracekit/...`), not the machine's folders."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    raiser = frames[-1]
    parts = raiser.filename.replace("\\", "/").split("/")
    tops = [index for index, part in enumerate(parts) if part in ("vllm", "tracekit", "torch", "vllm_ascend")]
    path = "/".join(parts[tops[0]:] if tops else parts[-2:])
    return f"{path}:{raiser.lineno} in {raiser.name}"
