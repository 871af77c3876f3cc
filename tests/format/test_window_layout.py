"""Issue 32: a window of steps in one bundle. The first step is a whole step as ever and the window
hangs off it (`Step.window`), so the bundle's `steps` still holds one step and a reader that does
not know `window` keeps it as an unknown field and reads the first step alone; the window's
tensors are named by their place; a window whose steps or calls do not fit together is refused
with its place, before any engine."""

import pytest
from window_forge import SAMPLE, window_content

from tracekit.errors import BundleError
from tracekit.format import open_bundle
from tracekit.format.content import load_step, write_content
from tracekit.format.schema import BundleContent, NewRequestRecord, Step


def test_a_window_round_trips_with_its_tensors_named_by_their_place(tmp_path):
    bundle = write_content(tmp_path / "window.zst", window_content())
    with open_bundle(bundle) as reader:
        names = {info.name for info in reader.tensor_infos()}
        assert len(reader.metadata["steps"]) == 1
    assert {"steps/0/window/steps/1/outputs/logits", "steps/0/window/steps/0/input_ids"} <= names
    _, first = load_step(bundle)
    window = first.window
    assert [carried.index for carried in window.steps] == [first.index + 1, first.index + 2]
    assert first.window_indices == [first.index, first.index + 1, first.index + 2]
    assert window.steps[1].outputs.logits.shape == first.outputs.logits.shape  # loaded, not a reference
    assert window.held_requests[0].req_id == "held-0" and window.calls[3] == {"call": "execute", "step": first.index + 1}


def test_the_window_lives_under_the_first_step_alone(tmp_path):
    """What a reader that does not know `window` sees: one whole step and an unknown field of it."""
    bundle = write_content(tmp_path / "window.zst", window_content())
    with open_bundle(bundle) as reader:
        plain = reader.metadata
    step_plain = plain["steps"][0]
    without = {key: value for key, value in step_plain.items() if key != "window"}
    single = Step.from_plain(without)
    assert single.window is None and single.batch_order == load_step(SAMPLE)[1].batch_order
    assert set(plain) == set(load_step(SAMPLE)[0].to_plain())  # nothing new at the top level


def _refused(tmp_path, edit, where: str) -> None:
    content = window_content()
    edit(content.steps[0])
    bundle = write_content(tmp_path / "bad.zst", content)
    with pytest.raises(BundleError, match=where):
        load_step(bundle)


def test_steps_that_do_not_follow_each_other_are_refused(tmp_path):
    def skip(first):
        first.window.steps[1].index += 1

    _refused(tmp_path, skip, r"window.steps\[1\].index .* does not follow step")


def test_a_window_that_does_not_start_after_its_first_step_is_refused(tmp_path):
    def shift(first):
        for carried in first.window.steps:
            carried.index += 5

    _refused(tmp_path, shift, r"window.steps\[0\].index .* does not follow step")


def test_a_call_of_a_step_outside_the_window_is_refused(tmp_path):
    def outside(first):
        first.window.calls.append({"call": "execute", "step": first.index + 9})

    _refused(tmp_path, outside, r"window.calls\[9\] names step .*, not one of the window's steps")


def test_an_unknown_call_is_refused(tmp_path):
    def unknown(first):
        first.window.calls[0]["call"] = "propose"

    _refused(tmp_path, unknown, r"calls\[0\].call 'propose' is none of execute, sample, output")


def test_a_held_request_in_blocks_the_cache_lacks_is_refused(tmp_path):
    def beyond(first):
        first.window.held_requests[0].block_ids = [[1 << 20]]

    _refused(tmp_path, beyond, r"window.held_requests\[0\].block_ids holds block 1048576, beyond the")


def _finished_holds_a_map(output):
    output["finished_req_ids"] = {"$set": [{"not": "an id"}]}


def _cached_id_is_a_number(output):
    output["scheduled_cached_reqs"]["req_ids"][0] = 7


def _new_prompt_holds_text(output):
    output["scheduled_new_reqs"] = [{"req_id": "new-0", "prompt_token_ids": [1, "two"], "num_computed_tokens": 0}]


def _new_sampling_params_are_a_list(output):
    output["scheduled_new_reqs"] = [{"req_id": "new-0", "prompt_token_ids": [1, 2], "sampling_params": ["seed"]}]


def _count_is_a_tensor(output):
    import torch

    output["scheduled_cached_reqs"]["num_computed_tokens"][0] = torch.zeros(64, 64)


def _columns_differ(output):
    output["scheduled_cached_reqs"]["num_output_tokens"].pop()


@pytest.mark.parametrize("edit, where", [
    (_finished_holds_a_map, r"finished_req_ids\[0\] should be a str, not a map$"),
    (_count_is_a_tensor, r"scheduled_cached_reqs.num_computed_tokens\[0\] should be an int, not Tensor$"),
    (_cached_id_is_a_number, r"scheduled_cached_reqs.req_ids\[0\] should be a str, not an int \(7\)$"),
    (_new_prompt_holds_text, r"scheduled_new_reqs\[0\].prompt_token_ids\[1\] should be an int, not a str \('two'\)$"),
    (_new_sampling_params_are_a_list, r"scheduled_new_reqs\[0\].sampling_params should be a map or nil, not a list$"),
    (_columns_differ, r"scheduled_cached_reqs.num_output_tokens should hold one entry per request of req_ids \(5\), "
                      "not 4$"),
])
def test_a_later_steps_scheduler_output_holding_the_wrong_types_is_refused_with_its_place(edit, where):
    """A later step's scheduler output is typed once, when the bundle is read: a value of another
    type is refused there in one line naming its place (fuzzed bundles with a map among the
    finished ids, or a count that is a tensor, crashed the request states' derivation before)."""
    plain = window_content().to_plain()
    edit(plain["steps"][0]["window"]["steps"][0]["scheduler_output"])
    with pytest.raises(BundleError, match=r"^bundle content: bundle.steps\[0\].window.steps\[0\].scheduler_output." + where):
        BundleContent.from_plain(plain)


def test_a_new_request_without_a_block_list_per_kv_group_is_refused_with_its_place():
    from tracekit.integrations.vllm.records.window_records import window_steps

    content = window_content()
    first = content.steps[0]
    output = first.window.steps[0].scheduler_output
    output.scheduled_new_reqs = [NewRequestRecord("new-0", prompt_token_ids=[1, 2])]
    output.num_scheduled_tokens["new-0"] = 2
    first.window.steps[0].batch_order.append("new-0")
    with pytest.raises(BundleError, match=f"^bundle content: step {first.index + 1} of the window: request 'new-0' "
                                          "holds blocks for 0 KV cache group"):
        window_steps(first, False, content.engine.num_kv_blocks)


def test_a_drafted_later_step_counts_the_tokens_its_forward_read():
    """Under async scheduling with drafts, a later step's scheduler output counts every draft of
    the step before as accepted; the runner corrects the count on the device before the forward.
    The request a `replay --from` rebuilds there takes the position its forward read, and its own
    drafts, not those of the window's first step (an EAGLE window replayed from step 6 on an H200
    verified the first step's drafts before this); a position that would add more tokens than the
    step has rows, from a bundle nobody can vouch for, is not taken."""
    from tracekit.format.schema import SpecDecodeRecord
    from tracekit.integrations.vllm.records.window_records import window_steps

    def derived(first_position: int, drafting: bool) -> tuple[int, list[int]]:
        content = window_content()
        first = content.steps[0]
        first.spec_decode = SpecDecodeRecord(method="eagle", num_speculative_tokens=2) if drafting else None
        first.request("1-be2609dd").draft_token_ids = [5, 6]  # verified in the first step alone
        carried = first.window.steps[0]
        row = carried.batch_order.index("1-be2609dd")  # a decode, its one input at row `row`
        carried.scheduler_output.scheduled_cached_reqs.num_computed_tokens[row] = 17  # 15 + 2 drafts
        carried.positions[row] = first_position
        request = window_steps(first, False, content.engine.num_kv_blocks)[1].step.request("1-be2609dd")
        assert request.draft_token_ids == []  # the later step schedules no drafts
        return request.num_computed_tokens, request.output_token_ids

    assert derived(15, drafting=True) == (15, [derived(15, drafting=False)[1][0]])
    assert derived(15, drafting=False)[0] == 17
    assert derived(10**12, drafting=True)[0] == 17
