"""The parts of a replay suite that need no engine: which files the arguments name, the names
they get, which bundles share an engine, and which exit code wins."""

import shutil
from pathlib import Path

import pytest

from tracekit.bundles import find_bundles, unique_names
from tracekit.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_RUN_HERE,
    EXIT_NOT_REPLAYABLE_YET,
    EXIT_NOT_REPRODUCED,
    EXIT_OK,
    UsageError,
)
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.replay.suite import engine_key, worst_exit_code

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


@pytest.fixture
def tree(tmp_path):
    for name in ("a/step1.zst", "a/deeper/step2.zst", "b/step1.zst", "b/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE, tmp_path / name)
    return tmp_path


def test_files_folders_and_globs_expand_in_order_each_once(tree):
    found = find_bundles([str(tree / "b/step1.zst"), str(tree / "a"), str(tree / "*/step1.zst")])
    assert found == [tree / "b/step1.zst", tree / "a/deeper/step2.zst", tree / "a/step1.zst"]


@pytest.mark.parametrize("spec, problem", [("absent.zst", "no bundle at"), ("nothing-*.zst", "no bundle matches"),
                                           ("empty", "no .zst bundle in folder")])
def test_a_spec_that_names_nothing_is_refused(tmp_path, spec, problem):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=problem):
        find_bundles([str(tmp_path / spec)])


def test_names_widen_only_where_stems_clash(tree):
    paths = [tree / "a/step1.zst", tree / "b/step1.zst", tree / "a/deeper/step2.zst"]
    assert unique_names(paths) == ["a__step1", "b__step1", "step2"]


def test_the_worst_exit_code_is_a_divergence_then_bad_input_then_not_replayable_yet_then_cannot_run_here():
    assert worst_exit_code([]) == EXIT_OK
    assert worst_exit_code([EXIT_OK, EXIT_CANNOT_RUN_HERE]) == EXIT_CANNOT_RUN_HERE
    assert worst_exit_code([EXIT_CANNOT_RUN_HERE, EXIT_NOT_REPLAYABLE_YET, EXIT_OK]) == EXIT_NOT_REPLAYABLE_YET
    assert worst_exit_code([EXIT_NOT_REPLAYABLE_YET, EXIT_BAD_INPUT, EXIT_OK]) == EXIT_BAD_INPUT
    assert worst_exit_code([EXIT_BAD_INPUT, EXIT_NOT_REPRODUCED, EXIT_CANNOT_RUN_HERE]) == EXIT_NOT_REPRODUCED


def test_one_engine_for_the_same_weights_at_another_path_not_for_other_arguments():
    with open_bundle(SAMPLE) as reader:
        content = BundleContent.from_plain(reader.metadata)
    key = engine_key(content)
    content.engine.engine_args.update(model="/elsewhere", tokenizer="/elsewhere")
    assert engine_key(content) == key  # the weights' fingerprint names the model
    content.engine.engine_args["max_num_seqs"] += 1
    assert engine_key(content) != key
    content.engine.engine_args["max_num_seqs"] -= 1
    content.engine.runner = "v2"  # another model runner is another engine
    assert engine_key(content) != key
    content.engine.runner = "v1"
    content.engine.model.weights_fingerprint = None  # a hub id: only the name tells models apart
    hub_key = engine_key(content)
    content.engine.engine_args["model"] = "/other"
    assert engine_key(content) != hub_key


def test_bundles_share_an_engine_only_where_their_kernels_agree():
    """Two recordings of one engine whose autotuning chose differently need two engines (a kernel
    is built once, under one lookup table); bundles of one recording, some of whose kernels were
    not launched yet when an early step was written, share one."""
    from types import SimpleNamespace

    from tracekit.format.schema import KernelChoice
    from tracekit.replay.suite import group_of

    def choice(digest, xblock):
        return KernelChoice(f"k{digest}", digest * 64, {"XBLOCK": xblock, "num_warps": 4, "num_stages": 1})

    def engine(choices=()):
        return SimpleNamespace(kernel_choices=list(choices))

    groups = []
    first = group_of(groups, "e", engine([choice("a", 8)]))
    later = group_of(groups, "e", engine([choice("a", 8), choice("b", 16)]))
    other = group_of(groups, "e", engine([choice("a", 32)]))
    assert first is later is not other
    assert [c.config["XBLOCK"] for c in first.choice_list()] == [8, 16]
    assert [c.config["XBLOCK"] for c in other.choice_list()] == [32]
    assert group_of(groups, "f", engine()) not in (first, other)


def test_a_suite_going_on_after_a_crash_keeps_the_names_the_whole_suite_gave(tmp_path):
    """After a replay process crashed, the suite goes on with the bundles left: each keeps the
    name it had among all of them (its records and profile files are named by it)."""
    from tracekit.replay.options import ReplayOptions
    from tracekit.replay.request import carry_out, plan

    for path in ("a/step.zst", "b/step.zst", "c/other.zst"):
        (tmp_path / path).parent.mkdir()
        (tmp_path / path).write_bytes(b"not a bundle")  # refused before any engine
    request = plan([str(tmp_path)], ReplayOptions(), keep_going=True)
    heard = []

    class Heard:
        def started(self, position, bundle, building, facts):
            pass

        def finished(self, record):
            heard.append(record["name"])

    carry_out(request.without({request.bundles[0]}), Heard())
    assert heard == [request.names[bundle] for bundle in request.bundles[1:]] == ["b__step", "other"]
