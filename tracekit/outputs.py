"""Output files appear whole or not at all, and never in place of something the user has.

A run that fails or is interrupted half-way must not leave a truncated file that a CI step or a
person would then read as a result: each report file (JSON lines, traces, plots, exported cases)
is written under a hidden partial name beside its target and renamed over it only once complete
(bundles, by the bundle writer, the same way). And before any work, every command checks the
outputs it was given (`claim_outputs`): one that exists, an existing bundle above all, or one
that is the command's own input, is written over only with `--force` — `tracekit replay --json
copy.zst other.zst`, meant as two bundles to replay, must not turn `copy.zst` into a JSON line.
"""

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from tracekit.errors import UsageError
from tracekit.format.layout import HEADER_FRAME_MAGIC, SKIPPABLE_HEADER

# The output name meaning standard output (`--json -`): nothing on disk to guard.
STDOUT = "-"


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


def claim_outputs(outputs: Mapping[str, str | Path | None] | Iterable[tuple[str, str | Path | None]],
                  inputs: Iterable[str | Path] = (), force: bool = False) -> None:
    """Refuse, before any work, outputs (option -> path, as a map or pairs; None and `-` name
    none) that would lose something: a path whose folder is missing, a folder, two options naming
    one file; and unless `force`, a file that exists (a bundle or not) or is one of the command's
    `inputs`."""
    claimed: dict[Path, str] = {}
    inputs = [Path(path) for path in inputs]
    for option, target in outputs.items() if isinstance(outputs, Mapping) else outputs:
        if target is None or str(target) == STDOUT:
            continue
        target = Path(target)
        require_parent(target, f"{option} {target}")
        identity = Path(os.path.realpath(target))
        if identity in claimed:
            raise UsageError(f"{claimed[identity]} and {option} both name {target}: give each its own file")
        claimed[identity] = option
        if target.is_dir():
            raise UsageError(f"cannot write {option} {target}: it is a folder; name a file")
        if force:
            continue
        if any(identity == Path(os.path.realpath(source)) for source in inputs):
            raise UsageError(f"{option} {target} is this command's own input: name another file "
                             "(--force writes over it)")
        if target.exists():
            raise UsageError(f"{option} {target} exists ({describe_existing(target)}): name another file, or pass "
                             "--force to write over it")


def describe_existing(path: Path) -> str:
    """What a file about to be written over is, in a few words (`a tracekit bundle`, `a file`)."""
    try:
        with path.open("rb") as stream:
            head = stream.read(SKIPPABLE_HEADER.size)
    except OSError:
        return "a file"
    if len(head) == SKIPPABLE_HEADER.size and SKIPPABLE_HEADER.unpack(head)[0] == HEADER_FRAME_MAGIC:
        return "a tracekit bundle"
    return "a file"


def write_json(value, target: str | Path, indent: int | None = None) -> None:
    """`value` as strict JSON (`json_text`) into `target`, whole or not at all; `-`: standard output."""
    text = json_text(value, indent) + "\n"
    if str(target) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text_atomically(target, text)


def json_text(value, indent: int | None = None) -> str:
    """`value` as strict JSON (RFC 8259 has no NaN or Infinity, and strict parsers refuse them):
    a float that is not finite becomes null, with `KEY_not_finite` beside it saying what it was
    ("inf", "-inf", "nan"; for a list, a map of positions to those). Values JSON has no type for
    are written as their str()."""
    return json.dumps(_finite(value), indent=indent, default=str, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        plain = {}
        for key, item in value.items():
            plain[key] = _finite(item)
            what = _not_finite(item)
            if what is not None:
                plain[f"{key}_not_finite"] = what
        return plain
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _not_finite(value):
    """What a non-finite float (or the non-finite floats of a list, by position) was; else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        found = {str(position): str(item) for position, item in enumerate(value)
                 if isinstance(item, float) and not math.isfinite(item)}
        return found or None
    return None
