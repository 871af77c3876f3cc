"""Unpacking msgpack from a file that may be hostile, with memory, depth and reference caps.

msgpack's own limits are per container, and a few KiB of zstd can expand to ~4 GB of Python
dicts: so maps and arrays are counted as they are built, extension types refused, and the
result walked once without recursion before any code that recurses touches it.
"""

import msgpack

from tracekit.format import limits


class Refused(Exception):
    """The object (metadata, the index) breaks a cap or is malformed; the message says which."""


def unpack_bounded(payload, max_items: int, max_containers: int):
    """msgpack.unpackb with at most `max_items` map entries plus array elements, and at most
    `max_containers` maps and arrays, in all (tensor references: `check_plain`)."""
    left = [max_items, max_containers]

    def count(container):
        left[0] -= len(container)
        left[1] -= 1
        if left[0] < 0:
            raise Refused(f"holds more than {max_items} entries")
        if left[1] < 0:
            raise Refused(f"holds more than {max_containers} maps and arrays")
        return container

    def refuse_extension(code, data):
        raise Refused(f"holds a msgpack extension type ({code})")

    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=False, object_hook=count, list_hook=count, ext_hook=refuse_extension,
            max_map_len=max_items, max_array_len=max_items, timestamp=0,
        )
    except Refused:
        raise
    except MemoryError:
        raise Refused("does not fit in memory") from None
    except (ValueError, TypeError, msgpack.UnpackException) as error:  # StackError: nested > 1024 deep
        raise Refused(f"is not readable msgpack ({error})") from None


def is_tensor_ref(value) -> bool:
    """Whether `value` is a tensor reference, `{"$tensor": <name, a str>}`: the one definition
    (any other map holding "$tensor" is plain data)."""
    return type(value) is dict and len(value) == 1 and isinstance(value.get("$tensor"), str)


KIND_NAMES = {str: "a str", int: "an int", float: "a float", bool: "a bool", bytes: "a bin", list: "a list",
              dict: "a map", type(None): "nil"}
PLAIN_TYPES = tuple(KIND_NAMES)  # what msgpack unpacks to


def kind_of(value) -> str:
    """What msgpack type `value` came from, for a message."""
    return KIND_NAMES.get(type(value), type(value).__name__)


def check_plain(obj) -> set[str]:
    """Check nesting depth, the numbers of maps/arrays and their entries, and the number of
    tensor references against the metadata caps; return the names referenced. Walks one
    nesting level at a time (no recursion; ~0.1 s per million entries). The writer runs it
    too, so that it never writes metadata a reader refuses."""
    referenced: set[str] = set()
    references = containers = entries = 0
    level, depth = [obj], 0
    while level:
        children = []
        for value in level:
            if value.__class__ is dict:
                containers += 1
                entries += len(value)
                if is_tensor_ref(value):
                    references += 1
                    referenced.add(value["$tensor"])
                    continue
                children.extend([child for child in value.values() if child.__class__ is dict or child.__class__ is list])
            elif value.__class__ is list:
                containers += 1
                entries += len(value)
                children.extend([child for child in value if child.__class__ is dict or child.__class__ is list])
        if references > limits.MAX_TENSOR_REFERENCES:
            raise Refused(f"holds more than {limits.MAX_TENSOR_REFERENCES} tensor references")
        if containers > limits.MAX_METADATA_CONTAINERS:
            raise Refused(f"holds more than {limits.MAX_METADATA_CONTAINERS} maps and arrays")
        if entries > limits.MAX_METADATA_ITEMS:
            raise Refused(f"holds more than {limits.MAX_METADATA_ITEMS} entries")
        if children:
            depth += 1
            if depth >= limits.MAX_METADATA_DEPTH:
                raise Refused(f"is nested more than {limits.MAX_METADATA_DEPTH} deep")
        level = children
    return referenced
