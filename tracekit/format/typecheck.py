"""Plain data from a bundle checked against the content schema's type annotations, in one walk
(`convert`) before any code uses a value: a bundle's metadata is whatever its writer put there.
"""

import dataclasses
import functools
import types
import typing
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

from tracekit.errors import BundleError
from tracekit.format.untrusted import KIND_NAMES, PLAIN_TYPES, is_tensor_ref, kind_of

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class Tensor:
    """Annotation of a tensor field: a `{"$tensor": name}` reference in the file; a loaded tensor
    (torch or numpy) once resolved, or while recording."""


@dataclasses.dataclass(frozen=True)
class Range:
    """`Annotated[int, Range(low, high)]`: the values, both bounds included, an int field takes."""

    low: int
    high: int


def convert(value: Any, annotation: Any, where: str) -> Any:
    """`value` checked against `annotation` (records in it built from their maps); a
    `BundleError` naming `where` if it does not fit."""
    if annotation is Any:
        return value
    origin = get_origin(annotation)
    if origin is Annotated:
        return _in_range(convert(value, annotation.__origin__, where), annotation.__metadata__, where)
    if origin is Union or origin is types.UnionType:
        return _union(value, get_args(annotation), annotation, where)
    if origin is list:
        if type(value) is not list:
            raise wrong_type(where, annotation, value)
        return _list(value, get_args(annotation)[0], where)
    if origin is dict:
        return _map(value, get_args(annotation)[1], annotation, where)
    if typing.is_typeddict(annotation):
        return _typed_map(value, annotation, where)
    if dataclasses.is_dataclass(annotation):
        return annotation.from_plain(value, where)
    if annotation is Tensor:
        if is_tensor_ref(value) or not isinstance(value, PLAIN_TYPES):  # else: a loaded tensor
            return value
        raise wrong_type(where, annotation, value)
    if annotation in (int, float, str, bool):
        if not (type(value) is annotation or annotation is float and type(value) is int):  # a bool is no int
            raise wrong_type(where, annotation, value)
        if type(value) is int:
            _in_range(value, (Range(INT64_MIN, INT64_MAX),), where)
        return value
    raise TypeError(f"the content schema annotates {where} with {annotation!r}, which {__name__} does not check")


def _in_range(value: Any, rules: tuple, where: str) -> Any:
    for rule in rules:
        if not isinstance(rule, Range):
            raise TypeError(f"the content schema annotates {where} with {rule!r}, which {__name__} does not check")
        if not rule.low <= value <= rule.high:
            raise BundleError(f"bundle content: {where} should be from {rule.low} to {rule.high}, not {value}")
    return value


def _union(value: Any, members: tuple, annotation: Any, where: str) -> Any:
    if value is None and type(None) in members:
        return None
    for member in members:
        if member is type(None):
            continue
        try:
            return convert(value, member, where)
        except BundleError as error:
            if getattr(error, "wrong_type_at", None) != where:
                raise  # the value has this member's type and a part of it does not fit: that says more
    raise wrong_type(where, annotation, value)


def _list(value: list, item: Any, where: str) -> list:
    scalar = _scalar_type(item)
    if scalar is not None and set(map(type, value)) <= {scalar}:  # token ids: millions, checked in C
        if scalar is str or not value:
            return value
        low, high = _bounds(item)
        if low <= min(value) and max(value) <= high:
            return value
    converted = [convert(entry, item, f"{where}[{number}]") for number, entry in enumerate(value)]
    return value if scalar is not None else converted


def _scalar_type(annotation: Any) -> type | None:
    """int or str for an (annotated) int or str element type, whose lists are checked at once."""
    if get_origin(annotation) is Annotated:
        annotation = annotation.__origin__
    return annotation if annotation in (int, str) else None


def _bounds(annotation: Any) -> tuple[int, int]:
    low, high = INT64_MIN, INT64_MAX
    for rule in getattr(annotation, "__metadata__", ()):
        if isinstance(rule, Range):
            low, high = max(low, rule.low), min(high, rule.high)
    return low, high


def _map(value: Any, item: Any, annotation: Any, where: str) -> dict:
    _require_map(value, annotation, where)
    if item is Any:
        return value
    converted = {key: convert(entry, item, f"{where}[{_shown(key)}]") for key, entry in value.items()}
    return value if _scalar_type(item) is not None or item is Tensor else converted


def _typed_map(value: Any, annotation: Any, where: str) -> dict:
    """A map with typed known keys (`TypedDict`); other keys are kept as they are."""
    _require_map(value, annotation, where)
    converted = dict(value)
    for key, hint in _hints(annotation).items():
        if key in value:
            converted[key] = convert(value[key], hint, f"{where}.{key}")
        elif key in annotation.__required_keys__:
            raise BundleError(f"bundle content: {where} lacks required field(s) {key}")
    return converted


def _require_map(value: Any, annotation: Any, where: str) -> None:
    if type(value) is not dict:
        raise wrong_type(where, annotation, value)
    for key in value:
        if type(key) is not str:
            raise BundleError(f"bundle content: {where} should have str keys, not {kind_of(key)} ({_shown(key)})")


@functools.cache
def _hints(annotation: Any) -> dict[str, Any]:
    return get_type_hints(annotation, include_extras=True)


# The metadata of a record's fields that are not in the file (its `extras`, what it was read with).
NOT_IN_FILE = {"in_file": False}


def in_file(item: dataclasses.Field) -> bool:
    return item.metadata.get("in_file", True)


def record_fields(record: type) -> dict[str, Any]:
    """{field name: annotation} of a schema record (a dataclass), those not in the file left out."""
    hints = _hints(record)
    return {item.name: hints[item.name] for item in dataclasses.fields(record) if in_file(item)}


def wrong_type(where: str, annotation: Any, value: Any) -> BundleError:
    """The error for a value at `where` of another type than `annotation` asks for (it carries
    `where` as `wrong_type_at`: a union tries its next member then)."""
    error = BundleError(f"bundle content: {where} should be {describe(annotation)}, not {found(value)}")
    error.wrong_type_at = where
    return error


def found(value: Any) -> str:
    """A value as a one-line message names what was found instead: its kind, and a scalar's value
    cut short (never a tensor's or a container's contents)."""
    text = kind_of(value)
    return text + f" ({_shown(value)})" if isinstance(value, (int, float, str, bool)) else text


def describe(annotation: Any) -> str:
    """What an annotation asks for, in the words of docs/FORMAT.md."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return describe(annotation.__origin__)
    if origin is Union or origin is types.UnionType:
        return " or ".join(describe(member) for member in get_args(annotation))
    if origin is list:
        return "a list"
    if origin is dict or typing.is_typeddict(annotation) or dataclasses.is_dataclass(annotation):
        return "a map"
    return {**KIND_NAMES, float: "a number", Tensor: "a tensor reference"}.get(annotation, repr(annotation))


def _shown(value: Any, limit: int = 40) -> str:
    """A value for a one-line message: repr (control characters escaped), cut to `limit`."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
