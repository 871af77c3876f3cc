"""Speculative decoding's items and the recorded facts they read, on a hand-made step of three
requests — a prefill chunk, a decode with three drafts, a decode without — laid out as vLLM lays
a verification forward out: a drafted request's rows are its last sampled token, then its drafts.
(The end-to-end tests run them on real engines; these pin what each item compares.)"""

import pytest
import torch

from tracekit.format.schema import (
    DrafterPass,
    GraphDispatch,
    KVSnapshot,
    RequestState,
    SchedulerOutputRecord,
    SpecDecodeRecord,
    Step,
    StepOutputs,
)
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.records import spec_decode
from tracekit.replay.checks import check_step, first_divergence
from tracekit.replay.verdict import VerdictName, decide
from tracekit.share.summary import _step_summary

PROMPTS = {"chunk": list(range(10, 20)), "drafted": [5, 6, 7], "plain": [8, 9]}
DRAFTS = [41, 42, 43]


def drafted_step(sampled_drafted=(41, 77)) -> Step:
    """`drafted` (prompt 3, outputs [30, 31]) verifies 3 drafts; its sampled ids accept the first
    (41) and end with 77. `chunk` prefills 4 prompt tokens, `plain` decodes one token."""
    requests = [
        RequestState("chunk", PROMPTS["chunk"], [], [[0]], num_computed_tokens=2, num_scheduled_tokens=4),
        RequestState("drafted", PROMPTS["drafted"], [30, 31], [[1]], num_computed_tokens=4, num_scheduled_tokens=4,
                     draft_token_ids=list(DRAFTS)),
        RequestState("plain", PROMPTS["plain"], [50], [[2]], num_computed_tokens=2, num_scheduled_tokens=1),
    ]
    input_ids = torch.tensor([12, 13, 14, 15, 31, *DRAFTS, 50])
    positions = torch.tensor([2, 3, 4, 5, 4, 5, 6, 7, 2])
    # logits rows: chunk (1), drafted (3 drafts + 1), plain (1)
    logits = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    drafter = [
        DrafterPass(input_ids=torch.arange(9), positions=positions.clone(), hidden_states_in=torch.ones(9, 4),
                    hidden_states=torch.full((9, 4), 2.0)),
        DrafterPass(input_ids=torch.tensor([1, 2, 3]), positions=torch.tensor([6, 6, 3]),
                    hidden_states_in=torch.ones(3, 4), hidden_states=torch.ones(3, 4)),
    ]
    return Step(
        index=3, trigger="steps 3", scheduler_output=SchedulerOutputRecord(scheduled_spec_decode_tokens={"drafted": list(DRAFTS)}),
        batch_order=["chunk", "drafted", "plain"], requests=requests, input_ids=input_ids, positions=positions,
        kv=KVSnapshot(mode="read"), graph=GraphDispatch(compilation_mode="NONE", cudagraph_mode="NONE", num_tokens=9),
        outputs=StepOutputs(hidden_states=torch.zeros(9, 4), logits=logits,
                            sampled_token_ids=[[], list(sampled_drafted), [60]]),
        spec_decode=SpecDecodeRecord(method="eagle", num_speculative_tokens=3, drafter_calls=drafter,
                                     proposals=torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])),
    )


def observed_as_recorded(step: Step, **changes) -> ObservedStep:
    observed = ObservedStep(
        batch_order=list(step.batch_order), input_ids=step.input_ids.clone(), positions=step.positions.clone(),
        hidden_states=step.outputs.hidden_states, logits=step.outputs.logits,
        sampled_token_ids=[list(ids) for ids in step.outputs.sampled_token_ids],
        proposals=step.spec_decode.proposals.clone(),
        drafter_calls=[DrafterPass(**{name: getattr(one, name).clone() for name in
                                ("input_ids", "positions", "hidden_states_in", "hidden_states")})
                 for one in step.spec_decode.drafter_calls],
    )
    for name, value in changes.items():
        setattr(observed, name, value)
    return observed


def by_name(items):
    return {item.name: item for item in items}


def test_a_replay_as_recorded_checks_every_speculative_item_in_forward_order():
    step = drafted_step()
    items = check_step(observed_as_recorded(step), step)
    names = [item.name for item in items]
    assert names.index("batch_order") < names.index("spec_decode/drafts") < names.index("input_ids")
    assert names.index("logits") < names.index("spec_decode/accepted") < names.index("sampled_token_ids")
    assert names.index("sampled_token_ids") < names.index("drafter/0/input_ids") < names.index("spec_decode/proposals")
    assert decide(items, []).name == VerdictName.BIT_EXACT


def test_a_verified_draft_that_differs_is_named_with_its_request():
    step = drafted_step()
    input_ids = step.input_ids.clone()
    input_ids[6] = 99  # the drafted request's second draft
    items = check_step(observed_as_recorded(step, input_ids=input_ids), step)
    assert first_divergence(items).name == "spec_decode/drafts"
    assert by_name(items)["spec_decode/drafts"].details["requests_moved"] == {
        "drafted": {"recorded": DRAFTS, "replayed": [41, 99, 43]}}


def test_accepting_another_number_of_drafts_parts_before_the_sampled_ids():
    step = drafted_step()
    items = check_step(observed_as_recorded(step, sampled_token_ids=[[], [41, 42, 5], [60]]), step)
    assert first_divergence(items).name == "spec_decode/accepted"
    assert by_name(items)["spec_decode/accepted"].details["requests_moved"] == {
        "drafted": {"recorded": 1, "replayed": 2}}
    # the same number accepted, another token drawn after them: only the sampled ids part
    items = check_step(observed_as_recorded(step, sampled_token_ids=[[], [41, 5], [60]]), step)
    assert by_name(items)["spec_decode/accepted"].bit_exact
    assert first_divergence(items).name == "sampled_token_ids"


def test_the_drafters_rows_of_rejected_drafts_do_not_decide():
    """The drafter's first call reads the target's rows; of the drafted request only its last
    sampled token and the one accepted draft (rows 4, 5) are the step's: rows 6, 7 are slots of
    rejected drafts, whatever the drafter's buffers held."""
    step = drafted_step()
    assert step.drafter_rows(0) == [0, 1, 2, 3, 4, 5, 8]
    assert step.drafter_rows(1) == [0, 1, 2]
    observed = observed_as_recorded(step)
    observed.drafter_calls[0].input_ids[7] = 500  # a rejected draft's slot
    observed.drafter_calls[0].hidden_states[6:8] += 1.0
    items = by_name(check_step(observed, step))
    assert items["drafter/0/input_ids"].bit_exact and items["drafter/0/hidden_states"].bit_exact
    padding = items["drafter/0/input_ids/padding"]
    assert not padding.bit_exact and not padding.decides and padding.details["rows"] == [6, 7]
    observed.drafter_calls[0].hidden_states[5] += 1.0  # the accepted draft's row decides
    items = check_step(observed, step)
    assert first_divergence(items).name == "drafter/0/hidden_states"


def test_a_drafter_batch_of_accepted_tokens_only_decides_on_all_its_rows():
    step = drafted_step()
    step.spec_decode.padded_drafter_batch = False  # `disable_padded_drafter_batch`: rows 0..6 are all real
    assert step.drafter_rows(0) == [0, 1, 2, 3, 4, 5, 6]


def test_proposals_that_differ_name_their_requests():
    step = drafted_step()
    proposals = step.spec_decode.proposals.clone()
    proposals[2, 1] = 0
    items = check_step(observed_as_recorded(step, proposals=proposals), step)
    item = by_name(items)["spec_decode/proposals"]
    assert first_divergence(items) is item and item.details["requests_moved"] == ["plain"]
    step.spec_decode.method = "suffix"  # proposals from state kept across requests: shown, not decisive
    items = check_step(observed_as_recorded(step, proposals=proposals), step)
    assert first_divergence(items) is None and not by_name(items)["spec_decode/proposals"].decides


def test_drafts_come_from_the_input_ids_the_forward_read():
    """Model Runner V2's scheduler sends placeholders; the drafts are in the input ids."""
    step = drafted_step()
    requests = [RequestState(r.req_id, r.prompt_token_ids, r.output_token_ids, r.block_ids, r.num_computed_tokens,
                             r.num_scheduled_tokens) for r in step.requests]
    spec_decode.add_drafts(requests, {"drafted": [-1, -1, -1]}, step.input_ids)
    assert [r.draft_token_ids for r in requests] == [[], DRAFTS, []]
    spec_decode.add_drafts(requests, {"drafted": [7, 8]}, None)  # no input ids: the scheduler's own
    assert requests[1].draft_token_ids == [7, 8]


def test_a_bundle_without_drafts_takes_them_from_its_input_ids():
    step = drafted_step()
    for request in step.requests:
        request.draft_token_ids = []
    spec_decode.fill_drafts_from_inputs(step)
    assert step.request("drafted").draft_token_ids == DRAFTS


def test_optimistic_counts_are_aligned_to_the_positions_the_forward_read():
    """Under async scheduling the runner's host count assumes every draft of the previous step was
    accepted (computed 7, outputs through 3 optimistic placeholders) until after the forward; its
    positions say 4 were computed: the request keeps the outputs before and at position 4."""
    optimistic = RequestState("drafted", [5, 6, 7], [30, 31, -1, -1, -1], [[1]], num_computed_tokens=7,
                              num_scheduled_tokens=4)
    synced = RequestState("plain", [8, 9], [50], [[2]], num_computed_tokens=2, num_scheduled_tokens=1)
    spec_decode.align_to_positions([optimistic, synced], torch.tensor([4, 5, 6, 7, 2]))
    assert (optimistic.num_computed_tokens, optimistic.output_token_ids) == (4, [30, 31])
    assert (synced.num_computed_tokens, synced.output_token_ids) == (2, [50])


def test_ngram_proposals_are_packed_with_placeholders():
    packed = spec_decode.proposals_tensor([[4, 5, 6], [], [7]], 3)
    assert packed.tolist() == [[4, 5, 6], [-1, -1, -1], [7, -1, -1]]
    assert spec_decode.proposals_tensor(torch.tensor([[1, 2], [3, 4]]), 2).tolist() == [[1, 2], [3, 4]]


def test_recorded_drafts_of_another_type_are_refused_when_the_bundle_is_read():
    """A tensor or a map where the drafts belong (a fuzzed bundle once made `bool(tensor)` raise)
    is refused in one line naming its place, before anything reads it."""
    from tracekit.errors import BundleError

    for hostile in (torch.ones(2, 3), {"drafted": torch.ones(3)}, {7: [1]}, [[1, 2]]):
        with pytest.raises(BundleError, match=r"^bundle content: SchedulerOutputRecord.scheduled_spec_decode_tokens"):
            SchedulerOutputRecord.from_plain({"scheduled_spec_decode_tokens": hostile})



def test_inspect_counts_the_accepted_drafts_by_batch_order_whatever_order_the_requests_are_stored_in():
    """The sampled ids are one row a request in batch order; the summary read them in the order
    of the stored requests, and counted the prefill chunk's empty row as the drafted request's."""
    step = drafted_step()
    step.requests = [step.request("drafted"), step.request("chunk"), step.request("plain")]
    assert step.accepted_drafts(step.outputs.sampled_token_ids) == {"drafted": 1}
    summary = _step_summary(step)["spec_decode"]
    assert (summary["drafts"], summary["accepted"]) == (3, 1)
