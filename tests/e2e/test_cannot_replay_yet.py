"""Issue 31: what tracekit records but cannot replay yet is said once when the recorder arms, and
such a step's replay ends with a verdict and exit code of its own (`cannot_replay_yet`, 5: no
machine can replay it with this tracekit; 3 says another machine can), before any engine is built
— never `diverged`.

Real recordings: prompt embeddings (a request given as embeddings beside a token prompt), and
ngram speculative decoding over a regex request, whose grammar mask holds one row per draft
position. A bundle from before the grammar mask was kept is refused the same way."""

import pytest
from e2e_support import read_step
from features_support import record_features, replay_records

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow

ARMED = "can be recorded but not yet replayed"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cannot-replay-yet")


@pytest.fixture(scope="module")
def prompt_embeds(work):
    return record_features(work, "prompt_embeds")


@pytest.fixture(scope="module")
def drafts(work):
    return record_features(work, "grammar_drafts")


def assert_not_replayable_yet(records, paths, words):
    for path in paths:
        record = records[path.name]
        assert (record["verdict"], record["exit_code"], record["engine"]) == ("cannot_replay_yet", 5, None), record
        assert words in record["error"] and ARMED in record["error"]


def test_prompt_embeds_are_said_at_arming_and_their_steps_refused_with_exit_5(prompt_embeds, tmp_path):
    result, recorded = prompt_embeds
    assert [message for message in result["warnings"] if ARMED in message] == [
        f"tracekit: steps with prompt embeddings {ARMED} by this tracekit (their replay ends with the verdict "
        "cannot_replay_yet, exit 5)"
    ]
    embedded = {path for path in recorded.values() if "prompt_embeds" in read_step(path).features}
    assert embedded == set(recorded.values()), "the embeddings request runs in every step of this workload"
    finished, records = replay_records(tmp_path, "embeds", *embedded, "--keep-going")
    assert finished.returncode == 5, finished.explain()
    assert_not_replayable_yet(records, embedded, "prompt embeddings")


def test_drafted_grammar_steps_have_a_mask_row_per_draft_position_and_are_refused(drafts, tmp_path):
    result, recorded = drafts
    assert any("speculative decoding" in message and ARMED in message for message in result["warnings"])
    drafted = {}
    for path in recorded.values():
        step = read_step(path)
        scheduled = step.scheduler_output.get("scheduled_spec_decode_tokens") or {}
        if step.grammar is not None and scheduled:
            drafted[path] = step
            assert step.grammar.rows_per_request == [1 + len(scheduled.get(req_id, ())) for req_id in step.grammar.request_ids]
            assert step.features["speculative_decoding"] == list(scheduled)
    assert any(max(step.grammar.rows_per_request) > 1 for step in drafted.values()), "no drafted grammar step"
    finished, records = replay_records(tmp_path, "drafts", *drafted, "--keep-going")
    assert finished.returncode == 5, finished.explain()
    assert_not_replayable_yet(records, drafted, "speculative decoding")


def test_a_step_failing_in_sampling_keeps_the_grammar_mask_it_was_given(drafts):
    """Armed for failures only, the recorder copies a step's mask only once the step is kept."""
    result, _ = drafts
    (path,) = result["failed_written"]
    step = read_step(path)
    assert (step.error["phase"], step.error["message"]) == ("sampling", "injected failure in sampling")
    scheduled = step.scheduler_output.get("scheduled_spec_decode_tokens") or {}
    assert step.grammar is not None and step.grammar.rows_per_request == [
        1 + len(scheduled.get(req_id, ())) for req_id in step.grammar.request_ids]


def test_a_structured_step_recorded_without_its_grammar_mask_is_refused_not_diverged(drafts, tmp_path):
    """A bundle of tracekit before issue 31 held no mask: replayed without it, sampling would not
    be the recorded one."""
    _, recorded = drafts
    path = next(path for path in recorded.values() if read_step(path).grammar is not None
                and not read_step(path).scheduler_output.get("scheduled_spec_decode_tokens"))

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
    assert all(record["engine"] is None for record in records.values())
