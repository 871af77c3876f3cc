"""A bundle to replay, opened once and handed down from the command line to the replay.

`tracekit replay` must know, before it forks the process that does the work, whether a bundle
is one rank's part of a multi-rank step; the work then needs the step's tensors. So the metadata
is read when the bundle is opened and the file kept open: the replay loads the tensors from it
(reads at offsets: a forked child reads it as well as its parent). A bundle that cannot be read
keeps the error, raised where its replay reports on it (bad input, exit 2).
"""

from pathlib import Path
from typing import Any

from tracekit.errors import TracekitError, UsageError
from tracekit.format import open_bundle
from tracekit.format.content import read_step
from tracekit.format.schema import BundleContent, Step


class OpenedBundle:
    """One bundle: its content (metadata only) read at once, one step's tensors on demand."""

    def __init__(self, path: str | Path):
        self.path = path
        self._reader: Any = None
        self._content: BundleContent | None = None
        self._error: BaseException | None = None
        try:
            self._reader = open_bundle(path)
            self._content = BundleContent.from_plain(self._reader.metadata)
        except (TracekitError, OSError) as error:
            self._error = error
            self.close()

    @classmethod
    def of(cls, bundle: "str | Path | OpenedBundle") -> "OpenedBundle":
        return bundle if isinstance(bundle, OpenedBundle) else cls(bundle)

    def __enter__(self) -> "OpenedBundle":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Let the file go (the content stays; a step loaded later opens it again)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    @property
    def content(self) -> BundleContent:
        """The bundle's content, metadata only (raises what opening it raised)."""
        if self._error is not None:
            raise self._error
        return self._content

    def content_or_none(self) -> BundleContent | None:
        """The content, or None where the bundle cannot be read (its replay says why)."""
        return None if self._error is not None else self._content

    @property
    def multi_rank(self) -> bool:
        """Whether it is one rank's part of a multi-rank step (a bundle that cannot be read, its
        rank fields damaged among them, is not: its own replay says what is wrong with it)."""
        if self._error is not None:
            return False
        return self._content.parallel.multi_rank and len(self._content.steps) == 1

    def facts(self, index: int | None = None) -> dict[str, Any]:
        """{"step", "trigger"} of the step a replay would run, from metadata alone (empty when the
        bundle cannot be read or lacks that step: its replay says why)."""
        if self._error is not None:
            return {}
        for recorded in self._content.steps:
            if index is None or recorded.index == index:
                return {"step": recorded.index, "trigger": recorded.trigger}
        return {}

    def load_step(self, index: int | None = None) -> Step:
        """The step of engine step index `index` (the first by default) with its tensors loaded
        (`format.content.read_step`); the file is let go afterwards. A later step of a window is
        refused, naming the window."""
        content = self.content
        if index is not None and index not in [step.index for step in content.steps]:
            opener = next((step for step in content.steps if index in step.window_indices), None)
            if opener is not None:
                raise UsageError(f"step {index} of {self.path} is a later step of the window step {opener.index} opens: "
                                 f"replay the window (--from {index} rebuilds the runner's state there)")
        reader = self._reader or open_bundle(self.path)
        try:
            return read_step(reader, content, self.path, index)
        finally:
            reader.close()
            self._reader = None
