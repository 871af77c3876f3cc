"""A bundle is a sequence of N >= 1 steps (a single step is N = 1), replayed, reported, shrunk and
redacted through one path: only the code whose job is the sequence itself — its shape in the
bundle, the later steps' derived request states, recording it — asks whether a step has later
ones (`window is None`); everything else reads the sequence through `Step` (`later`,
`held_requests`, `runner_calls`, `with_later`) or the replay's result (`several`, `steps`)."""

import re
from pathlib import Path

import tracekit

SEQUENCE_CODE = {
    "format/schema.py",  # the steps' shape in a bundle
    "integrations/vllm/records/window_records.py",  # the later steps' request states, derived
}
BRANCH = re.compile(r"\bwindow is (not )?None\b")


def test_only_the_sequence_code_asks_whether_a_step_has_later_ones():
    root = Path(tracekit.__file__).parent
    found = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
             if str(path.relative_to(root)) not in SEQUENCE_CODE
             for number, line in enumerate(path.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not found, f"`window is None` branches outside the sequence code: {found}"


def test_the_replay_has_one_result_type_and_one_report():
    root = Path(tracekit.__file__).parent
    assert not list(root.rglob("window*.py")) or {str(p.relative_to(root)) for p in root.rglob("window*.py")} <= {
        "integrations/vllm/records/window_records.py"}
    assert not re.search(r"class \w*Window\w*Result", "".join(p.read_text() for p in root.rglob("*.py")))
