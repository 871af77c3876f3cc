"""Issue 32: the commands that read a bundle show or refuse a window of steps without an engine:
`inspect` lists its later steps, `redact` rewrites it as one, and a window whose steps do not
follow from one another is refused by `redact` and `replay` in one line (exit 2) before anything
is built or written."""

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "format"))
from window_forge import window_content  # noqa: E402

from tracekit.cli import main  # noqa: E402
from tracekit.format.content import write_content  # noqa: E402


def _run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args], terminal_width=200)
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


def test_inspect_lists_the_window(tmp_path):
    bundle = write_content(tmp_path / "window.zst", window_content(3))
    code, out, _ = _run("inspect", bundle, "--json")
    assert code == 0
    window = json.loads(out)["steps"][0]["window"]
    assert window["steps"] == [1, 2, 3] and window["requested"] == 3 and window["held_requests"] == ["held-0"]
    assert [later["index"] for later in window["later"]] == [2, 3]
    assert window["outputs_read_after_the_next_step"] is False
    code, out, _ = _run("inspect", bundle)
    words = " ".join(out.split())  # the table may wrap lines
    assert code == 0 and "window: steps 1..3 (3 of 3 asked for), 1 request(s) held outside the first batch" in words


def _tracekit(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("tracekit")), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_redact_rewrites_a_window_as_one(tmp_path):
    """Every request renamed alike in every step of the window; a request the runner held but no
    step scheduled keeps no token id; each scheduled one the ids its steps compute."""
    from tracekit.format import open_bundle
    from tracekit.format.content import load_step

    source = window_content(3)
    bundle = write_content(tmp_path / "window.zst", source)
    finished = _tracekit("redact", bundle, "-o", tmp_path / "out.zst")
    assert finished.returncode == 0, finished.stderr
    _, redacted = load_step(tmp_path / "out.zst")
    first = source.steps[0]
    names = [f"req-{number}" for number in range(len(first.batch_order))]
    assert redacted.batch_order == names
    assert [carried.batch_order for carried in redacted.window.steps] == [names, names]
    assert all(sorted(carried.runner_states) == sorted(names) for carried in redacted.window.steps)
    (held,) = redacted.window.held_requests
    assert held.req_id == f"req-{len(names)}" and held.prompt_token_ids + held.output_token_ids == [0, 0, 0, 0]
    for old, new in zip((first.request(req_id) for req_id in first.batch_order), map(redacted.request, names)):
        start, end = old.num_computed_tokens, old.num_computed_tokens + old.num_scheduled_tokens
        if new.req_id in redacted_history_kept(tmp_path / "out.zst"):
            continue
        tokens = old.prompt_token_ids + old.output_token_ids
        assert new.prompt_token_ids + new.output_token_ids == [
            token if start <= position < end else 0 for position, token in enumerate(tokens)], new.req_id
    with open_bundle(tmp_path / "out.zst") as reader:
        text = repr(reader.metadata)
    assert not [req_id for req_id in [*first.batch_order, "held-0"] if req_id in text]


def redacted_history_kept(bundle) -> dict:
    from tracekit.format import open_bundle

    with open_bundle(bundle) as reader:
        (record,) = reader.metadata["derivations"][-1]["steps"]
    return record["history_kept"]


def test_redact_refuses_a_window_whose_steps_do_not_follow_and_writes_nothing(tmp_path):
    content = window_content(3)
    cached = content.steps[0].window.steps[1].scheduler_output.scheduled_cached_reqs
    cached.req_ids = ["nobody", *cached.req_ids[1:]]
    bundle = write_content(tmp_path / "window.zst", content)
    finished = _tracekit("redact", bundle, "-o", tmp_path / "out.zst")
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == ("tracekit: error: bundle content: step 3 of the window schedules request 'nobody', "
                               "which the window does not hold by then\n")
    assert not (tmp_path / "out.zst").exists()


def test_replay_refuses_a_window_whose_step_schedules_a_request_it_does_not_hold(tmp_path):
    content = window_content(3)
    cached = content.steps[0].window.steps[1].scheduler_output.scheduled_cached_reqs
    cached.req_ids = ["nobody", *cached.req_ids[1:]]
    bundle = write_content(tmp_path / "window.zst", content)
    finished = subprocess.run([str(Path(sys.executable).with_name("tracekit")), "replay", "--no-timing", str(bundle)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == ("tracekit: error: bundle content: step 3 of the window schedules request 'nobody', "
                               "which the window does not hold by then\n")
