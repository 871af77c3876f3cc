"""A request to arm a running server is checked before anything is armed: every setting, and the
folder it names, which must be a new one under the folder the operator named at start."""

import os

import pytest

from tracekit.errors import UsageError
from tracekit.record.live import ServerControl
from tracekit.record.settings import bundle_folder, check_settings
from tracekit.record.triggers import CLI_NAMES


def test_a_request_to_arm_is_read_with_defaults():
    settings = check_settings({"when": "request==cmpl-1 and first_chunk", "on": "exception, nonfinite",
                               "output": "incident-42/a"})
    assert (settings.when, settings.on, settings.kv, settings.max_bundles, settings.window) == (
        "request==cmpl-1 and first_chunk", ("exception", "nonfinite"), "read", 16, 1)
    assert check_settings({"steps": "3"}).output.startswith("live-")


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"steps": "3", "colour": "red"}, "unknown setting 'colour'"),
        ({}, "nothing to record: give steps, when or on"),
        ({"when": "foo"}, "bad when 'foo': unknown name"),
        ({"steps": "3", "kv": "all"}, "bad kv 'all'"),
        ({"steps": "3", "max_bundles": 0}, "bad max_bundles 0"),
        ({"steps": "3", "max_bundles": "4"}, "bad max_bundles '4': give a whole number"),
        ({"on": "exception", "window": 4}, "window starts at a step trigger"),
        ({"steps": "3", "output": "../elsewhere"}, "bad output '../elsewhere'"),
        ({"steps": "3", "output": "/tmp/elsewhere"}, "bad output '/tmp/elsewhere'"),
        ({"steps": "3", "output": "a/../../b"}, "no '..'"),
        ({"steps": "3", "output": "step{step}"}, "bad output"),
        ({"steps": 3}, "bad steps 3: give it as text"),
    ],
)
def test_a_bad_setting_is_refused_in_one_line_naming_it(body, reason):
    with pytest.raises(UsageError, match=reason.replace("(", r"\(")) as refused:
        check_settings(body)
    assert "\n" not in str(refused.value)


def test_the_cli_checks_with_its_own_flag_names():
    with pytest.raises(UsageError, match="bad --max-bundles 0"):
        check_settings({"steps": "3", "max_bundles": 0}, CLI_NAMES)
    with pytest.raises(UsageError, match="bad -o '/abs'"):
        check_settings({"steps": "3", "output": "/abs"}, CLI_NAMES)


def test_bundles_go_only_to_a_new_folder_under_the_served_one(tmp_path):
    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir(), outside.mkdir()
    assert bundle_folder(served, "incident-42/one") == served / "incident-42" / "one"
    assert (served / "incident-42" / "one").is_dir()
    (served / "out").symlink_to(outside)
    with pytest.raises(UsageError, match="outside the server's bundle folder"):
        bundle_folder(served, "out/x")
    assert not (outside / "x").exists()
    (served / "inside").mkdir()
    (served / "link").symlink_to(served / "inside")
    assert bundle_folder(served, "link/x") == served / "inside" / "x"  # a link that stays inside is followed
    (served / "used").mkdir()
    (served / "used" / "step0.zst").write_bytes(b"kept")
    with pytest.raises(UsageError, match="already exists and is not an empty folder"):
        bundle_folder(served, "used")
    (served / "file").write_text("x")
    with pytest.raises(UsageError, match="not an empty folder"):
        bundle_folder(served, "file")
    assert (served / "used" / "step0.zst").read_bytes() == b"kept"


def test_an_arming_refused_on_one_rank_is_undone_on_the_others(tmp_path):
    control = ServerControl(tmp_path)
    sent = control.request("arm", {"steps": "3", "output": "x"}, "POST /v1/tracekit/arm")
    assert sent["settings"]["output"] == "x" and (tmp_path / "x").is_dir()
    status, reply, then = control.answer("arm", sent, [{"armed": True}, {"armed": False, "refused": "no adapter"}])
    assert (status, reply["error"], then) == (400, "no adapter", "disarm")
    status, reply, then = control.answer("arm", sent, [{"armed": True}, {"armed": True}])
    assert (status, then) == (200, None) and reply["output"] == os.path.realpath(tmp_path / "x")
