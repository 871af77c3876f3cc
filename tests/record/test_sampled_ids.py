"""The recorder's own copy of each request's sampled ids (V1 under async scheduling keeps -1s)."""

from tracekit.format.schema import RequestState
from tracekit.record.sampled_ids import SampledIds


def _request(req_id: str, outputs: list[int]) -> RequestState:
    return RequestState(req_id=req_id, prompt_token_ids=[1, 2, 3], output_token_ids=outputs, block_ids=[[0]],
                        num_computed_tokens=3 + len(outputs), num_scheduled_tokens=1)


def test_placeholders_are_filled_in_order_for_requests_seen_from_their_start():
    ledger = SampledIds()
    ledger.started(["a", "b"])
    ledger.received(["a", "b"], [[11], []])  # b's first step was a partial prefill: nothing sampled
    ledger.received(["b", "a"], [[21], [12]])  # the batch order moved
    late, a, b = _request("late", [-1, -1]), _request("a", [-1, -1, -1]), _request("b", [-1])
    replaced = ledger.fill([late, a, b])
    # a's third id is the one this step's forward reads: not received yet, left to the input ids
    assert (a.output_token_ids, b.output_token_ids, late.output_token_ids) == ([11, 12, -1], [21], [-1, -1])
    assert replaced == 3


def test_real_ids_are_kept_and_finished_requests_forgotten():
    ledger = SampledIds()
    ledger.started(["a", "b"])
    ledger.received(["a", "b"], [[5, 6], [7]])  # speculative decoding: two accepted at once
    a = _request("a", [5, -1])
    assert ledger.fill([a]) == 1 and a.output_token_ids == [5, 6]
    ledger.keep_only({"b": object()})
    assert ledger.fill([_request("b", [-1])]) == 1
    assert ledger.fill([_request("a", [-1])]) == 0
