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


def require_parent(target: str | Path) -> None:
    """Refuse an output whose folder does not exist before any work is done, not after."""
    parent = Path(target).parent
    if not parent.is_dir():
        raise UsageError(f"cannot write {target}: folder {parent} does not exist")
