"""The one line a failure ends with (`tracekit.errors.one_line`): the exception's first line, or,
for an exception with no message (a bare `assert` inside vLLM), the place that raised it."""

from tracekit.errors import one_line


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 - the test's own exception
        return caught


def test_a_message_is_cut_to_its_first_line():
    assert one_line(_raised(RuntimeError("CUDA error: an illegal memory access\nadvice\nmore"))) == (
        "RuntimeError: CUDA error: an illegal memory access")


def test_a_bare_assertion_names_the_line_that_raised_it():
    def bare():
        raise AssertionError  # what a bare `assert` raises (pytest rewrites this file's own asserts)
    try:
        bare()
    except AssertionError as error:
        line = one_line(error)
    assert line.startswith("AssertionError: (no message) raised at cli/test_error_lines.py:"), line
    assert line.endswith(" in bare"), line


def test_an_exception_never_raised_says_so():
    assert one_line(AssertionError()) == "AssertionError: (no message) raised at an unknown place"
