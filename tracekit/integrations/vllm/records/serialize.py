"""vLLM objects <-> plain msgpack data, field by field, without pickle (the tags: docs/FORMAT.md,
"vLLM objects").

vLLM's scheduler and runner objects change between releases, so they are walked generically:
dataclasses by their fields, msgspec structs by `__struct_fields__` (private and default fields
included, which `msgspec.to_builtins` would drop). Reading back only ever builds types from the
allow-list the release module names: a bundle's content never decides what is imported.
"""

import array
import dataclasses
import enum
from typing import Any

import numpy as np
import torch

from tracekit.errors import BundleError, CannotRunHere, TracekitError


class SerializationError(TracekitError):
    """A vLLM object holds something tracekit cannot store faithfully."""


class FieldNotHere(CannotRunHere):
    """A recorded field the installed vLLM's class lacks, set to something that mattered: the
    vLLM that recorded it had a feature this one has not (exit 3)."""


def to_plain(value: Any, path: str = "value") -> Any:
    """Convert a vLLM object graph to msgpack-able data (tensors kept as tensors)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, array.array):  # a release's token buffer may be one: stored as vLLM's clients pass it
        return array.array.tolist(value)  # a subclass's own tolist may return something else
    if isinstance(value, enum.Enum):
        return {"$enum": type(value).__name__, "value": value.value}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted((to_plain(v, path) for v in value), key=repr)}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$tuple": [to_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (list, tuple)):  # NamedTuples (e.g. KVCacheBlockCopy) become lists
        return [to_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: to_plain(v, f"{path}.{key}") for key, v in value.items()}
        return {"$items": [[to_plain(k, path), to_plain(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if dataclasses.is_dataclass(value):
        names = [item.name for item in dataclasses.fields(value)]
        return _tagged(value, names, path)
    if hasattr(type(value), "__struct_fields__"):
        return _tagged(value, type(value).__struct_fields__, path)
    raise SerializationError(f"cannot serialise {path}: unsupported type {type(value).__qualname__}")


def _tagged(value: Any, names: list[str] | tuple[str, ...], path: str) -> dict[str, Any]:
    plain = {"$type": type(value).__name__}
    for name in names:
        plain[name] = to_plain(getattr(value, name), f"{path}.{name}")
    return plain


def to_versioned_plain(value: Any, vllm_version: str, path: str = "value") -> dict[str, Any]:
    """`to_plain` of a vLLM dataclass or struct, tagged with the vLLM version that made it."""
    return {**to_plain(value, path), "$vllm_version": vllm_version}


@dataclasses.dataclass(frozen=True)
class AllowList:
    """The only classes `from_plain` may build, by the names `to_plain` tagged them with."""

    types: dict[str, type]
    enums: dict[str, type]


def from_plain(plain: Any, allowed: AllowList) -> Any:
    """Rebuild objects written by `to_plain` with the classes `allowed` names."""
    if isinstance(plain, list):
        return [from_plain(v, allowed) for v in plain]
    if not isinstance(plain, dict):
        return plain
    if "$set" in plain:
        return {from_plain(v, allowed) for v in plain["$set"]}
    if "$tuple" in plain:
        return tuple(from_plain(v, allowed) for v in plain["$tuple"])
    if "$items" in plain:
        return {from_plain(k, allowed): from_plain(v, allowed) for k, v in plain["$items"]}
    if "$enum" in plain:
        return _lookup(allowed.enums, plain["$enum"])(plain["value"])
    if "$type" in plain:
        return _build(plain, allowed)
    return {key: from_plain(v, allowed) for key, v in plain.items()}


def _build(plain: dict[str, Any], allowed: AllowList) -> Any:
    cls = _lookup(allowed.types, plain["$type"])
    struct = hasattr(cls, "__struct_fields__")
    known = set(cls.__struct_fields__) if struct else {item.name for item in dataclasses.fields(cls)}
    _refuse_unknown_fields(cls, plain, known)
    fields = {key: from_plain(v, allowed) for key, v in plain.items() if key in known}
    if struct:
        # msgspec structs: built from their required fields alone, then every recorded field set
        # as it was (constructor validation would re-derive private fields differently).
        obj = _struct_from_required(cls, fields)
        for name, value in fields.items():
            setattr(obj, name, value)
        return obj
    return cls(**fields)


def _struct_from_required(cls: type, fields: dict[str, Any]) -> Any:
    """A msgspec struct to set the recorded fields on: from its defaults where it has a default
    for every field (`SamplingParams`); else built from the recorded public fields, which its own
    checks see (`LoRARequest`), a value they refuse being the bundle's fault."""
    names = cls.__struct_fields__
    required = names[:len(names) - len(cls.__struct_defaults__)]  # the fields with defaults come last
    if not required:
        return cls()
    missing = [name for name in required if name not in fields]
    if missing:
        raise BundleError(f"bundle content: a recorded {cls.__name__} lacks {', '.join(missing)}")
    try:
        return cls(**{name: value for name, value in fields.items() if not name.startswith("_")})
    except (TypeError, ValueError, AssertionError) as error:
        raise BundleError(f"bundle content: a recorded {cls.__name__} is refused by vLLM: {error}") from None


def _refuse_unknown_fields(cls: type, plain: dict[str, Any], known: set[str]) -> None:
    """A field recorded by another vLLM that this one's class lacks is left out where it is
    empty (None, False, 0, nothing: the feature it belongs to was off), and refused otherwise."""
    for name, value in plain.items():
        if not name.startswith("$") and name not in known and not is_empty(value):
            shown = repr(value)
            raise FieldNotHere(
                f"the bundle's {cls.__name__}.{name} is {shown[:60]}{'...' if len(shown) > 60 else ''}, "
                "a field this vLLM does not have"
            )


def is_empty(plain: Any) -> bool:
    """Whether a plain value says "nothing" (what a feature's field holds while it is off)."""
    if isinstance(plain, dict) and len(plain) == 1 and next(iter(plain)) in ("$set", "$tuple", "$items"):
        plain = next(iter(plain.values()))
    if isinstance(plain, (str, list, dict)):
        return not plain
    return plain is None or plain is False or (type(plain) is int and plain == 0)


def _lookup(table: dict[str, Any], name: Any) -> Any:
    if not isinstance(name, str) or name not in table:
        raise BundleError(f"bundle holds a vLLM type this tracekit does not rebuild: {name!r}")
    return table[name]
