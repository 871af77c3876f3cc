"""Unpacking msgpack from a file that may be hostile, with memory, depth and reference caps.

msgpack's own limits are per container; a few KiB of zstd can expand to 64 MiB of empty maps,
which Python holds as ~4 GB of dicts. So every map and array is counted as it is built and the
unpack stops at a cap, extension types are refused (nothing in a bundle selects a Python type),
and the result is walked once, without recursion, to check its nesting depth and count its
`{"$tensor": name}` references before any other code (which may recurse) touches it.
"""

import msgpack

from tracekit.format import limits


class Refused(Exception):
    """The object breaks a cap or is not plain data; the message says which."""


def unpack_bounded(payload, max_items: int):
    """msgpack.unpackb with at most `max_items` map entries plus array elements in all."""
    left = [max_items]

    def count(container):
        left[0] -= len(container) + 1
        if left[0] < 0:
            raise Refused(f"holds more than {max_items} entries")
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
    return type(value) is dict and len(value) == 1 and isinstance(value.get("$tensor"), str)


def check_plain(obj) -> set[str]:
    """Check nesting depth and the number of tensor references; return the names referenced."""
    referenced: set[str] = set()
    references = 0
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if is_tensor_ref(value):
                references += 1
                if references > limits.MAX_TENSOR_REFERENCES:
                    raise Refused(f"holds more than {limits.MAX_TENSOR_REFERENCES} tensor references")
                referenced.add(value["$tensor"])
                continue
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limits.MAX_METADATA_DEPTH:
            raise Refused(f"is nested more than {limits.MAX_METADATA_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)
    return referenced
