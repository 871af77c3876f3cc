"""Issue 8: with async scheduling (on by default on GPUs) a step's sampled ids exist only when
the engine reads its async output, possibly after the next step started; the recorder must take
them from there, for the right step. Driven on the real V2 runner, whose `sample_tokens`
returns its async output type on every platform."""

import pytest
from e2e_support import engine_script

from tracekit.format.content import load_step

pytestmark = pytest.mark.slow


def test_sampled_ids_of_async_outputs_read_late_go_to_their_own_step(tmp_path):
    result = engine_script("async_outputs", tmp_path / "result.json", tmp_path, runner="v2")
    assert result["output_types"] == ["AsyncOutput", "AsyncOutput"]
    assert not result["failures"]
    assert len(result["written"]) == 2, "one bundle per driven step"
    assert len(result["read"][0]) == 2 and len(result["read"][1]) == 1
    for path, read in zip(sorted(result["written"]), result["read"]):
        _, step = load_step(path, None)
        assert step.outputs.sampled_token_ids == read
    renamed = load_step(sorted(result["written"])[1], None)[1]
    assert all(request.req_id.endswith("-again") for request in renamed.requests)
