"""Issue 32: the commands that read a bundle show or refuse a window of steps without an engine:
`inspect` lists its later steps, `redact` refuses it (its later steps' scheduler outputs carry
prompts it does not rewrite yet), and a window whose steps do not follow from one another is
refused by `replay` in one line (exit 2) before anything is built."""

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
    code, out, _ = _run("inspect", "--json", bundle)
    assert code == 0
    window = json.loads(out)["steps"][0]["window"]
    assert window["steps"] == [1, 2, 3] and window["requested"] == 3 and window["held_requests"] == ["held-0"]
    assert [later["index"] for later in window["later"]] == [2, 3]
    assert window["outputs_read_after_the_next_step"] is False
    code, out, _ = _run("inspect", bundle)
    words = " ".join(out.split())  # the table may wrap lines
    assert code == 0 and "window: steps 1..3 (3 of 3 asked for), 1 request(s) held outside the first batch" in words


def test_redact_refuses_a_window(tmp_path):
    bundle = write_content(tmp_path / "window.zst", window_content(2))
    code, _, stderr = _run("redact", bundle, "-o", tmp_path / "out.zst")
    assert code == 2 and "holds a window of steps, which redact does not rewrite yet" in stderr
    assert not (tmp_path / "out.zst").exists()


def test_replay_refuses_a_window_whose_step_schedules_a_request_it_does_not_hold(tmp_path):
    content = window_content(3)
    cached = content.steps[0].window.steps[1].scheduler_output["scheduled_cached_reqs"]
    cached["req_ids"] = ["nobody", *cached["req_ids"][1:]]
    bundle = write_content(tmp_path / "window.zst", content)
    finished = subprocess.run([str(Path(sys.executable).with_name("tracekit")), "replay", "--no-timing", str(bundle)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == ("tracekit: error: bundle content: step 3 of the window schedules request 'nobody', "
                               "which the window does not hold by then\n")
