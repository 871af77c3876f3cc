"""Every command that writes a file refuses a missing (or non-folder) output folder up front,
through one check (`tracekit.outputs.require_parent`), with one wording."""

from pathlib import Path

import pytest

from tracekit.errors import UsageError
from tracekit.outputs import require_parent

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


def writers():
    """(name, write(target)) for each place that writes an output the user named."""
    from tracekit.record.persist import OutputTemplate
    from tracekit.share.redact import redact
    from tracekit.share.shrink import shrink

    return [
        ("outputs", require_parent),
        ("shrink", lambda target: shrink(SAMPLE, target, "command:true")),
        ("redact", lambda target: redact(SAMPLE, target)),
        ("record", lambda target: OutputTemplate(target)),
    ]


@pytest.mark.parametrize("name", ["outputs", "shrink", "redact", "record"])
def test_a_missing_output_folder_is_refused_before_any_work(tmp_path, name):
    write = dict(writers())[name]
    with pytest.raises(UsageError, match=f"cannot write .*absent/out.zst: folder {tmp_path}/absent does not exist$"):
        write(tmp_path / "absent" / "out.zst")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=f"cannot write .*file/out.zst: folder {tmp_path}/file is not a folder$"):
        write(tmp_path / "file" / "out.zst")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]  # nothing written


def test_the_folder_is_judged_as_the_system_will_open_the_path(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    monkeypatch.chdir(tmp_path / "real")
    require_parent("out.zst")
    require_parent(Path("..") / "real" / "out.zst")
    # no lexical shortcut: opening absent/../out.zst fails, so the check must too
    with pytest.raises(UsageError, match="cannot write absent/../out.zst: folder absent/.. does not exist$"):
        require_parent(Path("absent") / ".." / "out.zst")
