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
    if stream.isatty():
        return Console(file=stream, highlight=False, soft_wrap=True)
    return Console(file=stream, highlight=False, soft_wrap=True, width=UNWRAPPED_WIDTH, color_system=None)


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
