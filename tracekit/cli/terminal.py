"""Text from a bundle, made inert for a terminal.

A bundle may come from anyone, and its strings (tensor names, request ids, error messages,
paths) reach rich consoles: rich markup in them would be interpreted, and ANSI escape
sequences, other control characters and bidi overrides would drive the terminal. Every string
from a bundle goes through `inert` before it is printed.
"""

import sys
import unicodedata
from typing import TextIO

# Where output is not a terminal (a pipe, a file): lines as wide as they are, never wrapped, so
# that no name is broken and each row stays one line for grep.
UNWRAPPED_WIDTH = 100_000
# Lists and maps deeper than this are shown as "...": str() of a value nested ~1000 deep
# raises RecursionError, and no one reads past a few levels.
MAX_SHOWN_DEPTH = 8


def console_for(stream: TextIO | None = None):
    """A rich console on `stream` (default: standard output): on a terminal, as wide as it is;
    elsewhere, without colours and never wrapping a line or a table."""
    from rich.console import Console

    stream = stream or sys.stdout
    plain = {} if stream.isatty() else {"width": UNWRAPPED_WIDTH, "color_system": None}
    return Console(file=stream, highlight=False, soft_wrap=True, **plain)


def table(console, title: str | None, columns: list[str], right: tuple[str, ...] = ()):
    """A table for `console`: boxed on a terminal; plain aligned columns elsewhere. `right`: the
    columns aligned right (numbers)."""
    from rich import box
    from rich.table import Table

    plain = not console.is_terminal
    made = Table(title=title, title_justify="left", box=None if plain else box.HEAVY_HEAD, pad_edge=not plain)
    for column in columns:
        made.add_column(column, justify="right" if column in right else "left", overflow="fold")
    return made


def inert(value) -> str:
    """`value` as text in which control and format characters (categories C*, and separators
    other than the space) are shown as `\\uXXXX` and rich markup is escaped. Lists, tuples
    and maps are shown as str() shows them, down to `MAX_SHOWN_DEPTH`."""
    from rich.markup import escape  # here: `inspect --json` never loads rich

    text = value if isinstance(value, str) else _shown(value)
    if not text.isprintable():
        text = "".join(
            char if char == " " or unicodedata.category(char)[0] not in "CZ" else f"\\u{ord(char):04x}" for char in text
        )
    return escape(text)


def _shown(value, depth: int = 0) -> str:
    """str(value), with lists, tuples and maps deeper than MAX_SHOWN_DEPTH cut to "..." (so the
    recursion stays shallow however deep the value)."""
    if not isinstance(value, (list, tuple, dict)):
        return str(value) if depth == 0 else repr(value)
    if depth >= MAX_SHOWN_DEPTH:
        return "..."
    if isinstance(value, dict):
        pairs = (f"{_shown(key, depth + 1)}: {_shown(item, depth + 1)}" for key, item in value.items())
        return "{" + ", ".join(pairs) + "}"
    items = ", ".join(_shown(item, depth + 1) for item in value)
    if isinstance(value, list):
        return f"[{items}]"
    return f"({items},)" if len(value) == 1 else f"({items})"
