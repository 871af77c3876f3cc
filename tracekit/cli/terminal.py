"""Text from a bundle, made inert for a terminal.

A bundle may come from anyone, and its strings (tensor names, request ids, error messages,
paths) reach rich consoles: rich markup in them would be interpreted, and ANSI escape
sequences, other control characters and bidi overrides would drive the terminal. Every string
from a bundle goes through `inert` before it is printed.
"""

import unicodedata


def inert(value) -> str:
    """`value` as text in which control and format characters (categories C*, and separators
    other than the space) are shown as `\\uXXXX` and rich markup is escaped."""
    from rich.markup import escape  # here: `inspect --json` never loads rich

    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = "".join(
            char if char == " " or unicodedata.category(char)[0] not in "CZ" else f"\\u{ord(char):04x}" for char in text
        )
    return escape(text)
