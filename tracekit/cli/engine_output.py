"""vLLM's and torch's own output kept out of tracekit's report, in a log file the report names.

An engine prints a dozen lines of its own per command (the Triton banner, deprecation warnings,
NUMA and thread binding, progress bars while it loads), some from C code straight to the process's
file descriptors. So while an engine command works, descriptors 1 and 2 go to a log file, and the
command writes its report to copies of the terminal's descriptors it took before
(`EngineOutput.report`, `.errors`). With `-v` nothing is redirected and vLLM logs as it would.
"""

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tracekit.errors import TracekitError


@dataclass
class EngineOutput:
    """Where a command writes its report (`errors`: its standard error) while an engine may
    print, and the log file holding everything else (None with `-v`)."""

    report: TextIO
    errors: TextIO
    log: Path | None

    def log_line(self) -> str | None:
        """The line naming the log file, if anything went there."""
        if self.log is None or not self.log.exists() or self.log.stat().st_size == 0:
            return None
        return f"vLLM's and torch's own output: {self.log} (-v shows it as it comes)"


@contextlib.contextmanager
def engine_output(verbose: bool, command: str) -> Iterator[EngineOutput]:
    """Inside the block, the process's standard output and error go to a log file (unless
    `verbose`); the streams yielded reach the terminal. An empty log is removed at the end."""
    if verbose:
        yield EngineOutput(sys.stdout, sys.stderr, None)
        return
    handle, name = tempfile.mkstemp(prefix=f"tracekit-{command}-", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    report, errors = (os.fdopen(os.dup(fd), "w", buffering=1) for fd in (1, 2))
    for fd in (1, 2):
        os.dup2(handle, fd)
    os.close(handle)
    output = EngineOutput(report, errors, Path(name))
    try:
        yield output
    except TracekitError:  # a refusal: its one line says it all
        raise
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        if output.log_line() is not None:
            print(f"tracekit: {output.log_line()}", file=errors)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for stream, fd in ((report, 1), (errors, 2)):
            stream.flush()
            os.dup2(stream.fileno(), fd)
            stream.close()
        if os.path.getsize(name) == 0:
            os.unlink(name)
