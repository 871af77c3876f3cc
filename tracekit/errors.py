"""Errors that carry a user-facing message and the CLI exit code they map to.

The exit codes are a contract (`git bisect run`, CI); what each means: docs/GUIDE.md, "Replaying"
and "Verdicts" (4 says nothing yet about whether the step reproduces; 6 that it cannot be told).
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
    that raised it instead, as `package/module.py:LINE in FUNCTION` from the top package (`vllm/...`),
    not the machine's folders: without it the line says nothing a user can act on."""
    text = str(error).strip()
    if text:
        return f"{type(error).__name__}: {text.splitlines()[0]}"
    frames = traceback.extract_tb(error.__traceback__)
    place = "an unknown place"
    if frames:
        parts = frames[-1].filename.replace("\\", "/").split("/")
        tops = [index for index, part in enumerate(parts) if part in ("vllm", "tracekit", "torch", "vllm_ascend")]
        place = f"{'/'.join(parts[tops[0]:] if tops else parts[-2:])}:{frames[-1].lineno} in {frames[-1].name}"
    return f"{type(error).__name__}: (no message) raised at {place}"
