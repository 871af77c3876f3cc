"""Text from a bundle, made inert for a terminal.

A bundle may come from anyone, and its strings (tensor names, request ids, error messages,
paths) reach rich consoles: rich markup in them would be interpreted, and ANSI escape
sequences, other control characters and bidi overrides would drive the terminal. Every string
from a bundle goes through `inert` before it is printed.
"""

import unicodedata

# Lists and maps deeper than this are shown as "...": str() of a value nested ~1000 deep
# raises RecursionError, and no one reads past a few levels.
MAX_SHOWN_DEPTH = 8


def inert(value) -> str:
    """`value` as text in which control and format characters (categories C*, and separators
    other than the space) are shown as `\\uXXXX` and rich markup is escaped. Lists, tuples
    and maps are shown as str() shows them, without recursion, down to `MAX_SHOWN_DEPTH`."""
    from rich.markup import escape  # here: `inspect --json` never loads rich

    text = value if isinstance(value, str) else _shown(value)
    if not text.isprintable():
        text = "".join(
            char if char == " " or unicodedata.category(char)[0] not in "CZ" else f"\\u{ord(char):04x}" for char in text
        )
    return escape(text)


class _Text(str):
    """A piece of punctuation that `_shown` emits as it is."""


def _shown(value) -> str:
    """str(value), with containers walked on an explicit stack and cut at MAX_SHOWN_DEPTH."""
    if not isinstance(value, (list, tuple, dict)):
        return str(value)
    out: list[str] = []
    pending: list = [(value, 0)]  # popped from the end: pushed in reverse order
    while pending:
        item = pending.pop()
        if isinstance(item, _Text):
            out.append(item)
            continue
        value, depth = item
        if not isinstance(value, (list, tuple, dict)):
            out.append(repr(value))
        elif depth >= MAX_SHOWN_DEPTH:
            out.append("...")
        else:
            opening, closing = ("{", "}") if isinstance(value, dict) else ("(", ")") if isinstance(value, tuple) else ("[", "]")
            parts: list = []
            for number, element in enumerate(value.items() if isinstance(value, dict) else value):
                if number:
                    parts.append(_Text(", "))
                if isinstance(value, dict):
                    parts += [(element[0], depth + 1), _Text(": "), (element[1], depth + 1)]
                else:
                    parts.append((element, depth + 1))
            if isinstance(value, tuple) and len(value) == 1:
                parts.append(_Text(","))
            out.append(opening)
            pending.append(_Text(closing))
            pending.extend(reversed(parts))
    return "".join(out)
