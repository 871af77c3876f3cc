"""Issue 51, nothing lost: no command writes over an existing bundle, a file that exists, or its
own input unless `--force` says so, and every input is left byte for byte as it was.

Every command that writes a file is tried, each output option of it, against three targets: the
command's own input, another existing bundle, and an existing plain file (refused without
`--force`, written with it). Refusals come before any engine starts, so the engine commands are
cheap here; where one is let through with `--force`, it is given a bundle recorded on a GPU,
which it refuses (exit 3) before building an engine, after claiming its outputs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2] / "traces"
SAMPLE = TRACES / "tiny-llama-mixed-step.zst"
ON_A_GPU = TRACES / "h100-vllm026" / "v1-bf16-mtp-async-drafted.zst"  # refused here before any engine
TRACEKIT = str(Path(sys.executable).with_name("tracekit"))

# (command, output option) -> its arguments for a bundle and an output path. `{other}` is a second
# output some commands need beside the one tried.
WRITERS = {
    ("inspect", "--json"): lambda bundle, out: ["inspect", bundle, "--json", out],
    ("diff", "--json"): lambda bundle, out: ["diff", bundle, bundle, "--json", out],
    ("export", "-o"): lambda bundle, out: ["export", bundle, "-o", out],
    ("redact", "-o"): lambda bundle, out: ["redact", bundle, "-o", out],
    ("shrink", "-o"): lambda bundle, out: ["shrink", bundle, "-o", out, "--until", "command:true"],
    ("shrink", "--json"): lambda bundle, out: ["shrink", bundle, "-o", "{other}", "--until", "command:true",
                                               "--json", out],
    ("replay", "--json"): lambda bundle, out: ["replay", bundle, "--no-timing", "--json", out],
    ("replay", "--plot"): lambda bundle, out: ["replay", bundle, "--plot", out],
    ("replay", "--save-layers"): lambda bundle, out: ["replay", bundle, "--no-timing", "--save-layers", out],
    ("invariance", "--json"): lambda bundle, out: ["invariance", bundle, "--json", out],
    ("record", "-o"): lambda bundle, out: ["record", "-o", out],
}
# Those whose work needs an engine: let through with --force, they are given a GPU bundle.
NEEDS_AN_ENGINE = {"replay", "invariance", "record"}


def _run(arguments: list[str], folder: Path) -> subprocess.CompletedProcess:
    arguments = [str(argument).replace("{other}", str(folder / "other.zst")) for argument in arguments]
    return subprocess.run([TRACEKIT, *arguments], capture_output=True, text=True, timeout=300, cwd=folder,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _plot_suffixed(writer: tuple[str, str], path: Path) -> Path:
    """--plot names a .png (a .zst would be refused for its type, before the check tried here)."""
    return path.with_suffix(".png") if writer == ("replay", "--plot") else path


@pytest.fixture
def folder(tmp_path):
    shutil.copy(SAMPLE, tmp_path / "step.zst")
    shutil.copy(SAMPLE, tmp_path / "kept.zst")
    return tmp_path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


@pytest.mark.parametrize("writer", sorted(WRITERS), ids=" ".join)
def test_an_output_that_is_the_input_or_an_existing_bundle_is_refused(folder, writer):
    arguments = WRITERS[writer]
    before = _snapshot(folder)
    for target, words in ((folder / "step.zst", "exists (a tracekit bundle)"),
                          (folder / "kept.zst", "exists (a tracekit bundle)")):
        if writer[0] != "record" and target.name == "step.zst":
            words = "this command's own input"
        if writer == ("replay", "--plot"):  # a plot is a .png: the bundle is renamed so, and is still one
            target = folder / "kept.png"
            shutil.copy(SAMPLE, target)
            before[target.name] = target.read_bytes()
            words = "exists (a tracekit bundle)"
        finished = _run(arguments(folder / "step.zst", target), folder)
        assert finished.returncode == 2, finished.stderr
        assert f"{writer[1]} {target}" in finished.stderr and words in finished.stderr, finished.stderr
        assert "--force" in finished.stderr
    assert _snapshot(folder) == before  # every input and existing file byte for byte as it was


@pytest.mark.parametrize("writer", sorted(WRITERS), ids=" ".join)
def test_an_existing_file_is_written_over_only_with_force(folder, writer):
    arguments = WRITERS[writer]
    existing = _plot_suffixed(writer, folder / "existing.out")
    existing.write_text("keep me\n")
    refused = _run(arguments(folder / "step.zst", existing), folder)
    assert refused.returncode == 2 and "exists (a file)" in refused.stderr, refused.stderr
    assert existing.read_text() == "keep me\n"
    if writer[0] in NEEDS_AN_ENGINE and writer not in {("replay", "--json"), ("invariance", "--json")}:
        return  # let through, these would build an engine (record) or write only after one ran
    bundle = ON_A_GPU if writer[0] in NEEDS_AN_ENGINE else folder / "step.zst"
    before = bundle.read_bytes()
    forced = _run([*arguments(bundle, existing), "--force"], folder)
    assert "exists" not in forced.stderr, forced.stderr
    assert forced.returncode == (3 if writer[0] in NEEDS_AN_ENGINE else 0), forced.stderr
    assert existing.read_bytes() != b"keep me\n"  # written over: the command's output now
    assert bundle.read_bytes() == before


def test_record_with_force_goes_on_to_its_next_check(folder):
    """--force lets `record` past an existing output: here to the check of --window, still before
    any engine (recording itself is the end-to-end tests')."""
    finished = _run(["record", "-o", folder / "kept.zst", "--window", "0", "--force"], folder)
    assert finished.returncode == 2 and "bad --window 0" in finished.stderr, finished.stderr


def test_record_refuses_a_template_whose_bundles_exist(folder):
    shutil.copy(SAMPLE, folder / "step7.zst")
    finished = _run(["record", "-o", folder / "step{step}.zst", "--steps", "7"], folder)
    assert finished.returncode == 2, finished.stderr
    assert f"{folder / 'step7.zst'} exists (a tracekit bundle)" in finished.stderr


def test_replay_json_given_a_bundle_then_a_file_that_is_not_one_leaves_the_bundle_intact(folder):
    """The bar: the user meant to replay copy.zst; --json took it for its file."""
    (folder / "notabundle.zst").write_text("not a bundle\n")
    before = (folder / "step.zst").read_bytes()
    finished = _run(["replay", "--json", "step.zst", "notabundle.zst"], folder)
    assert finished.returncode == 2
    assert "--json step.zst exists (a tracekit bundle)" in finished.stderr, finished.stderr
    assert (folder / "step.zst").read_bytes() == before


def test_two_outputs_naming_one_file_are_refused(folder):
    finished = _run(["replay", "step.zst", "--json", "out.json", "--save-layers", "out.json"], folder)
    assert finished.returncode == 2 and "--json and --save-layers both name out.json" in finished.stderr


def test_forced_json_is_written_whole_and_strict(folder):
    (folder / "result.json").write_text("old\n")
    finished = _run(["replay", str(ON_A_GPU), "--no-timing", "--json", "result.json", "--force"], folder)
    assert finished.returncode == 3, finished.stderr
    [record] = [json.loads(line) for line in (folder / "result.json").read_text().splitlines()]
    assert record["verdict"] == "cannot_run_here"
    assert not [path for path in folder.iterdir() if path.name.startswith(".")]  # no partial left
