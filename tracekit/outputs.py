"""Report files (JSON lines, traces, plots, exported cases) appear whole or not at all.

A run that fails or is interrupted half-way must not leave a truncated file that a CI step or a
person would then read as a result: each is written under a hidden partial name beside its
target and renamed over it only once complete.
"""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tracekit.errors import UsageError


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a partial path to write; it replaces `target` when the block ends without error."""
    target = Path(target)
    partial = target.with_name(f".{target.name}.partial")
    try:
        yield partial
        os.replace(partial, target)
    except OSError as error:
        raise UsageError(f"cannot write {target}: {error.strerror or error}") from None
    finally:
        partial.unlink(missing_ok=True)


def write_text_atomically(target: str | Path, text: str) -> None:
    with atomic_path(target) as partial:
        partial.write_text(text)


def require_parent(target: str | Path, what: str | None = None) -> Path:
    """Refuse an output whose folder does not exist (or is not a folder) before any work is
    done, not after; returns the folder. The one such check: every command that writes a file
    the user named calls it. `what` names the output in the message (default: `target`). The
    folder is judged as the system will open the path (`absent/../x` is refused)."""
    parent = Path(target).parent
    if not parent.is_dir():
        problem = "is not a folder" if parent.exists() else "does not exist"
        raise UsageError(f"cannot write {what or target}: folder {parent} {problem}")
    return parent
