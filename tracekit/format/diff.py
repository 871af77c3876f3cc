"""Comparing two bundles tensor by tensor: the same step recorded on two machines, two vLLM
versions, or eager against graph mode, shows where the numbers part.

Tensors are paired by name, compared with `tracekit.format.compare` (no torch), and reported in
the order the first bundle stores them, forward order: so the first tensor that differs is where
the two runs part. The rest of the metadata is compared field by field.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracekit.format.compare import compare_bytes
from tracekit.format.reader import open_bundle
from tracekit.format.untrusted import is_tensor_ref


@dataclass
class BundleDiff:
    tensors: list[dict[str, Any]] = field(default_factory=list)  # per shared tensor
    only_in_first: list[str] = field(default_factory=list)
    only_in_second: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)  # {"field", "first", "second"}

    @property
    def first_difference(self) -> dict[str, Any] | None:
        """The first tensor, in the first bundle's stored order, that is not bit-identical."""
        return next((tensor for tensor in self.tensors if not tensor["bit_exact"]), None)

    @property
    def identical_tensors(self) -> bool:
        return not self.only_in_first and not self.only_in_second and all(t["bit_exact"] for t in self.tensors)

    def to_plain(self) -> dict[str, Any]:
        return {"identical_tensors": self.identical_tensors, "first_difference": self.first_difference, **asdict(self)}


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict) and not is_tensor_ref(value):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def _flat_metadata(metadata: Any) -> dict[str, Any]:
    """{dotted path: value} of a bundle's metadata, each recorded step by its position
    (`steps.0.kv.mode`); whatever a stranger's bundle holds (metadata that is no map, steps that
    are no list) is one value at its place."""
    if isinstance(metadata, dict) and isinstance(metadata.get("steps"), list):
        metadata = dict(metadata)
        metadata["steps"] = dict(enumerate(metadata.pop("steps")))  # by position, after the other fields
    return _flatten(metadata, "", {})


# Per-recording facts that always differ and say nothing about the numbers.
_VOLATILE = ("created_at", "steps.0.timing")


def diff_bundles(first: str | Path, second: str | Path) -> BundleDiff:
    result = BundleDiff()
    with open_bundle(first) as a, open_bundle(second) as b:
        names_a = [info.name for info in a.tensor_infos()]
        names_b = {info.name for info in b.tensor_infos()}
        for name in names_a:
            if name not in names_b:
                result.only_in_first.append(name)
                continue
            info_a, info_b = a.tensor_info(name), b.tensor_info(name)
            comparison = compare_bytes(a.read_tensor(name, to="bytes"), info_a.dtype, info_a.shape,
                                       b.read_tensor(name, to="bytes"), info_b.dtype, info_b.shape)
            result.tensors.append({"name": name, **comparison})
        result.only_in_second = sorted(names_b - set(names_a))
        flat_a, flat_b = _flat_metadata(a.metadata), _flat_metadata(b.metadata)
    for key in sorted(set(flat_a) | set(flat_b)):
        if key.startswith(_VOLATILE) or flat_a.get(key) == flat_b.get(key):
            continue
        result.metadata.append({"field": key, "first": flat_a.get(key), "second": flat_b.get(key)})
    return result
