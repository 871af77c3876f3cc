"""Issue 31: what tracekit records but cannot replay yet is said once when the recorder arms, and
such a step's replay ends with a verdict and exit code of its own (`cannot_replay_yet`, 5: no
machine can replay it with this tracekit; 3 says another machine can), before any engine is built
— never `diverged`. A real recording: a request given as prompt embeddings beside a token prompt.
(Bundles that lack what their replay needs: tests/e2e/test_grammar_with_drafts.py.)"""

import pytest
from e2e_support import read_step
from features_support import record_features, replay_records

pytestmark = pytest.mark.slow

ARMED = "can be recorded but not yet replayed"


def test_prompt_embeds_are_said_at_arming_and_their_steps_refused_with_exit_5(tmp_path_factory):
    work = tmp_path_factory.mktemp("cannot-replay-yet")
    result, recorded = record_features(work, "prompt_embeds")
    assert [message for message in result["warnings"] if ARMED in message] == [
        f"tracekit: steps with prompt embeddings {ARMED} by this tracekit (their replay ends with the verdict "
        "cannot_replay_yet, exit 5)"
    ]
    embedded = {path for path in recorded.values() if "prompt_embeds" in read_step(path).features}
    assert embedded == set(recorded.values()), "the embeddings request runs in every step of this workload"
    finished, records = replay_records(work, "embeds", *embedded, "--keep-going")
    assert finished.returncode == 5, finished.explain()
    for path in embedded:
        record = records[path.name]
        assert (record["verdict"], record["exit_code"], record["engine"]) == ("cannot_replay_yet", 5, None), record
        assert "prompt embeddings" in record["error"] and ARMED in record["error"]
