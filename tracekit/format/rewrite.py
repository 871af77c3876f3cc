"""Rewriting a bundle into a new one with edits, for the tests and tools that forge edited
bundles (negative controls, rank sets, refusals). `edit(metadata, tensors)` may change the
metadata and replace, add or drop tensors (names to loaded tensors); references to dropped
tensors are refused.
"""

from pathlib import Path
from typing import Any, Callable

from tracekit.errors import BundleError
from tracekit.format.reader import open_bundle
from tracekit.format.untrusted import Refused, check_plain
from tracekit.format.writer import BundleWriter


def rewrite_bundle(
    source: str | Path,
    target: str | Path,
    edit: Callable[[Any, dict[str, Any]], None],
) -> Path:
    with open_bundle(source) as reader:
        metadata = reader.metadata
        tensors = {info.name: reader.read_tensor(info.name) for info in reader.tensor_infos()}
    edit(metadata, tensors)
    try:
        referenced = check_plain(metadata)
    except Refused as problem:
        raise BundleError(f"edited metadata cannot be stored: it {problem} (readers refuse that)") from None
    dangling = referenced - tensors.keys()
    if dangling:
        raise BundleError(f"edited metadata refers to tensors it no longer has: {sorted(dangling)[:3]}")
    with BundleWriter(target) as writer:
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)
        writer.set_metadata(metadata)
    return Path(target)
