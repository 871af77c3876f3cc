"""Temporary files of bundle writers: how they are named, and cleaning up after dead writers.

A writer killed with SIGKILL cannot delete its partial file, so every new writer deletes, in its
folder, those whose writer is gone (docs/FORMAT.md, "Writing"): same host and no such process,
or not written to for `STALE_AFTER_SECONDS` (a live writer appends every few seconds).
"""

import os
import re
import secrets
import socket
import time

from tracekit.format.layout import PARTIAL_SUFFIX

STALE_AFTER_SECONDS = 6 * 3600
_PARTIAL_NAME = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9_]{1,32})-(?P<pid>\d+)-[0-9a-f]{8}" + re.escape(PARTIAL_SUFFIX) + "$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32] or "host"


def temporary_path(path: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # someone else's live process (or a pid no process can have)
    return True


def is_stale(name: str, mtime: float, now: float) -> bool:
    match = _PARTIAL_NAME.match(name)
    if match is None:
        return False
    if now - mtime > STALE_AFTER_SECONDS:
        return True
    return match["host"] == _host() and not _process_exists(int(match["pid"]))


def remove_stale_partials(directory: str) -> list[str]:
    """Delete dead writers' partial files in `directory`; returns the names deleted. Never
    raises: a folder that cannot be listed or a file another writer removed first is skipped."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.endswith(PARTIAL_SUFFIX):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and is_stale(entry.name, entry.stat(follow_symlinks=False).st_mtime, now):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
    return removed
