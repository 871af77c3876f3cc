"""`inert`, the escaping of bundle text for the terminal, on hostile values."""

from rich.markup import escape

from tracekit.cli.terminal import inert


def test_inert_shows_plain_values_as_str_does():
    for value in ["plain", 3, 2.5, None, True, b"\x00x", [1, "a", [None, 2.5]], {"k": [1, {"j": "v"}]}, ("t", 1), (1,), [], {}]:
        assert inert(value) == escape(str(value)), value


def test_inert_survives_values_nested_deeper_than_the_recursion_limit():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    shown = inert(deep)
    assert shown.startswith("[" * 8) and "..." in shown and len(shown) < 100
    mapping: dict = {}
    for _ in range(5000):
        mapping = {"k": mapping}
    assert inert(mapping).startswith("{'k': {'k': ")


def test_inert_escapes_control_characters_inside_containers():
    assert inert(["\x1b[2J", "[bold]x[/]"]) == escape(str(["\x1b[2J", "[bold]x[/]"]))
    assert "\x1b" not in inert({"a": "\x1b[31m"})
