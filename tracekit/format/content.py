"""A bundle's typed content to and from its file: the one pair every writer and reader uses.

Tensors are stored as frames named by their place in the content tree; `load_step` loads one
step's only. torch is imported only by the functions that handle tensors, so `tracekit.format`
stays importable without it.
"""

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tracekit.errors import UsageError
from tracekit.format.reader import open_bundle
from tracekit.format.schema import BundleContent, EngineConfig, Environment, ParallelRank, Step
from tracekit.format.writer import BundleWriter


def write_content(path: str | Path, content: BundleContent) -> Path:
    """A bundle holding `content`, its tensors named by their place in the content tree."""
    with BundleWriter(path) as writer:
        writer.set_metadata(_store_tensors(content.to_plain(), writer, ""))
    return Path(path)


def write_steps(
    path: str | Path, environment: Environment, engine: EngineConfig, steps: list[Step],
    parallel: ParallelRank | None = None,
) -> Path:
    """A new bundle of `steps`, created now."""
    return write_content(path, BundleContent(
        environment=environment,
        engine=engine,
        steps=steps,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        parallel=parallel or ParallelRank(),
    ))


def load_step(bundle: str | Path, step: int | None = None) -> tuple[BundleContent, Step]:
    """The bundle's content and one step (the first, or the one of engine step index `step`)
    with its tensors loaded; a bundle without that step is a `UsageError`."""
    with open_bundle(bundle) as reader:
        content = BundleContent.from_plain(reader.metadata)
        return content, read_step(reader, content, bundle, step)


def read_step(reader: Any, content: BundleContent, bundle: str | Path, step: int | None = None) -> Step:
    """`load_step`'s step, from a bundle already open (`reader`, its `content`)."""
    position = _position(bundle, content, step)
    return Step.from_plain(reader.resolve(reader.metadata["steps"][position], to="torch"))


def _position(bundle: str | Path, content: BundleContent, step: int | None) -> int:
    """Where the step of engine step index `step` (None: the first) is in `content.steps`."""
    indices = [recorded.index for recorded in content.steps]
    if not indices:
        raise UsageError(f"bundle {bundle} holds no recorded step")
    if step is not None and step not in indices:
        raise UsageError(f"bundle {bundle} has no step {step} (it has {', '.join(map(str, indices))})")
    return 0 if step is None else indices.index(step)


def _store_tensors(value: Any, writer: BundleWriter, name: str) -> Any:
    """Replace every tensor in a plain tree by a reference to a tensor frame named by its path."""
    import torch

    if isinstance(value, torch.Tensor):
        return writer.add_tensor(name, value)
    if isinstance(value, dict):
        return {key: _store_tensors(item, writer, f"{name}/{key}" if name else str(key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_store_tensors(item, writer, f"{name}/{i}") for i, item in enumerate(value)]
    return value
