"""A Python caller's replay options: a `ReplayOptions`, its fields as keywords, or both, and
neither is dropped (every argument a user gives is honoured)."""

import pytest

from tracekit.replay.options import ReplayOptions, options_from


def test_keywords_beside_an_options_object_change_its_fields():
    given = ReplayOptions(strict=True, iters=5)
    options = options_from(given, {"tolerance": 0.01, "iters": 7})
    assert (options.strict, options.iters, options.tolerance) == (True, 7, 0.01)
    assert given.iters == 5  # the caller's object is left as it was


def test_keywords_alone_make_the_options_and_an_unknown_one_is_refused():
    assert options_from(None, {"strict": True}) == ReplayOptions(strict=True)
    with pytest.raises(TypeError, match="itres"):
        options_from(ReplayOptions(), {"itres": 3})
    with pytest.raises(TypeError, match="itres"):
        options_from(None, {"itres": 3})
