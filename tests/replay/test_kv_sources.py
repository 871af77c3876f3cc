"""Where the KV a parted window step read came from (issue 32), from the steps' block ids and
checks alone: a request whose rows part where every KV it reads was written bit-exact parts in
that step itself; one that reads KV a parted step wrote is pointed there. Blocks here hold 4 slots.

    step 0 (first)  A prefills tokens 0-7 (blocks 10, 11); B decodes at 5 (blocks 13, 14, put back)
    step 1          A prefills 8-11 (block 12, from its first slot)          A's rows part
    step 2          A decodes at 12 (block 15, from its first slot); A finished after it
    step 3          C prefills 0-3 in block 15, which A's step 2 wrote
    step 4          C decodes at 4; D decodes at 4 on block 12 found cached (put back)   C, D part
"""

from tracekit.format.schema import (
    GraphDispatch,
    KVGroupSnapshot,
    KVLayout,
    KVSnapshot,
    RequestState,
    SchedulerOutputRecord,
    Step,
)
from tracekit.replay.checks import KV_DIGEST_ITEM, CheckedItem
from tracekit.replay.kv_sources import describe, kv_sources, parted_rows
from tracekit.replay.result import ReplayResult, SequenceFacts

BLOCK = 4


def _request(req_id: str, blocks: list[int], computed: int, scheduled: int) -> RequestState:
    return RequestState(req_id=req_id, prompt_token_ids=list(range(12)), output_token_ids=[], block_ids=[blocks],
                        num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def _step(index: int, *requests: RequestState, put_back: tuple[int, ...] = ()) -> Step:
    layout = KVLayout(shape=[2, 32, BLOCK, 1, 8], dtype="float32", block_dim=1, num_blocks=32, block_size=BLOCK)
    group = KVGroupSnapshot(["layers.0"], layout, [], [], list(put_back))
    return Step(index=index, trigger="window", scheduler_output=SchedulerOutputRecord(), batch_order=[r.req_id for r in requests],
                requests=list(requests), input_ids=None, positions=None, kv=KVSnapshot("read", [group]),
                graph=GraphDispatch("NONE", "NONE"))


def _result(index: int, moved: dict[str, float] | None = None, named: bool = True) -> ReplayResult:
    details = {"requests_moved": moved} if moved is not None and named else {}
    hidden = CheckedItem("hidden_states", moved is None, moved is None, details, "float32")
    return ReplayResult(bundle="w.zst", step_index=index, trigger="window", reference_mode="eager",
                        checks=[CheckedItem("input_ids", True, True, {}), hidden])


STEPS = [
    _step(0, _request("A", [10, 11, 12], 0, 8), _request("B", [13, 14], 5, 1), put_back=(13, 14)),
    _step(1, _request("A", [10, 11, 12], 8, 4), _request("B", [13, 14], 6, 1)),
    _step(2, _request("A", [10, 11, 12, 15], 12, 1), _request("B", [13, 14], 7, 1)),
    _step(3, _request("C", [15], 0, 4), _request("B", [13, 14, 16], 8, 1)),
    _step(4, _request("C", [15, 17], 4, 1), _request("D", [12, 18], 4, 1), put_back=(12,)),
]


def test_a_request_whose_kv_was_written_bit_exact_parts_in_its_own_forward():
    results = [_result(0), _result(1, {"A": 0.5}), _result(2), _result(3), _result(4)]
    found = kv_sources(STEPS, results)
    assert set(found) == {1}  # the only step that parted
    assert found[1]["A"].to_plain() == {"written_at": [0], "parted_at": []}
    assert "parts in step 1 itself" in describe(1, "A", found[1]["A"])


def test_a_request_that_reads_what_a_parted_step_wrote_is_pointed_there():
    results = [_result(0), _result(1, {"A": 0.5}), _result(2, {"A": 0.25}), _result(3), _result(4)]
    found = kv_sources(STEPS, results)
    assert found[2]["A"].to_plain() == {"written_at": [0, 1], "parted_at": [1]}
    assert "step(s) 1 wrote where the writing request parted" in describe(2, "A", found[2]["A"])
    assert "B" not in found[2]  # its rows did not part


def test_a_block_written_again_from_its_first_slot_and_one_put_back_forget_earlier_writers():
    # A's step 2 (parted) wrote block 15 before C took it; D's block 12, which A's parted step 1
    # wrote, is put back from the bundle at step 4
    results = [_result(0), _result(1, {"A": 0.5}), _result(2, {"A": 0.25}), _result(3), _result(4, {"C": 1.0, "D": 1.0})]
    found = kv_sources(STEPS, results)
    assert found[4]["C"].to_plain() == {"written_at": [3], "parted_at": []}
    assert found[4]["D"].to_plain() == {"written_at": [], "parted_at": []}
    assert "reads only KV the replay put back from the bundle" in describe(4, "D", found[4]["D"])


def test_a_step_that_parts_without_naming_its_requests_counts_for_all_of_them():
    unnamed = _result(1, {"A": 0.5}, named=False)
    assert parted_rows(unnamed) is None
    results = [_result(0), unnamed, _result(2, {"B": 0.25}), _result(3), _result(4)]
    found = kv_sources(STEPS, results)
    assert set(found[1]) == {"A", "B"}
    # B decodes in block 14, which step 1 wrote for B: every request of step 1 may have parted
    assert found[2]["B"].to_plain() == {"written_at": [0, 1], "parted_at": [1]}


def test_logits_alone_parting_write_no_other_kv_and_a_window_record_names_the_sources():
    logits_only = ReplayResult(bundle="w.zst", step_index=1, trigger="window", reference_mode="eager",
                               checks=[CheckedItem("hidden_states", True, True, {}, "float32"),
                                       CheckedItem("logits", False, False, {}, "float32")])
    results = [_result(0), logits_only, _result(2, {"A": 0.25}), _result(3), _result(4)]
    found = kv_sources(STEPS, results)
    assert parted_rows(logits_only) == set() and 1 not in found
    assert found[2]["A"].to_plain() == {"written_at": [0, 1], "parted_at": []}
    window = ReplayResult.of_steps(results, SequenceFacts(requested=5, recorded=[0, 1, 2, 3, 4], rebuilt=[0], kv_sources=found))
    records = window.step_records()
    assert records[2]["window"]["kv_sources"] == {"A": {"written_at": [0, 1], "parted_at": []}}
    assert "kv_sources" not in records[0]["window"]


def _with_digest(result: ReplayResult, moved: dict[str, str]) -> ReplayResult:
    """`result` with a later step's digest of its KV writes, parted for the requests of `moved`."""
    details = {"requests_moved": moved, "layers_moved": 1} if moved else {}
    digest = CheckedItem(KV_DIGEST_ITEM, not moved, not moved, details, digest_only=True)
    result.checks.insert(1, digest)
    return result


def test_a_later_steps_digest_of_its_kv_writes_says_which_requests_wrote_other_kv():
    # step 1: A's rows part after its last attention (its KV digest equal); step 2: B's hidden
    # states equal but its KV writes part. A reading step 1's writes parts in itself; B in step 3
    # reads what step 2 wrote where it parted.
    results = [_result(0), _with_digest(_result(1, {"A": 0.5}), {}), _with_digest(_result(2, {"A": 0.25}), {"B": "layers.0"}),
               _with_digest(_result(3, {"B": 0.5}), {}), _result(4)]
    found = kv_sources(STEPS, results)
    assert found[2]["A"].to_plain() == {"written_at": [0, 1], "parted_at": []}
    assert found[2]["B"].to_plain() == {"written_at": [0, 1], "parted_at": []}  # its digest parted: a reader too
    assert found[3]["B"].to_plain() == {"written_at": [0, 1, 2], "parted_at": [2]}
    assert parted_rows(results[2]) == {"A", "B"}


def test_steps_after_the_last_that_ran_are_not_read():
    results = [_result(0), _result(1, {"A": 0.5})]
    assert set(kv_sources(STEPS, results)) == {1}


def test_the_window_report_says_it_per_parted_request_and_caps_the_lines():
    import io

    from tracekit.cli.replay_report import KV_SOURCE_LINES, print_report

    results = [_result(0), _result(1, {"A": 0.5}), _result(2, {"A": 0.25}), _result(3), _result(4)]
    window = ReplayResult.of_steps(results, SequenceFacts(requested=5, recorded=[0, 1, 2, 3, 4], rebuilt=[0],
                                                          kv_sources=kv_sources(STEPS, results)))
    stream = io.StringIO()
    print_report(window, stream)
    text = " ".join(stream.getvalue().split())
    assert "step 1: request A reads KV written by step(s) 0, bit-exact there, and KV the replay put back" in text
    assert "step 2: request A reads KV that step(s) 1 wrote where the writing request parted" in text
    many = {index: {f"R{n}": found for n in range(KV_SOURCE_LINES)} for index, found in
            ((index, sources["A"]) for index, sources in window.sequence.kv_sources.items())}
    stream = io.StringIO()
    print_report(ReplayResult.of_steps(results, SequenceFacts(requested=5, recorded=[0, 1, 2, 3, 4], rebuilt=[0],
                                                              kv_sources=many)), stream)
    assert f"... {KV_SOURCE_LINES} more (--json)" in stream.getvalue()


def test_the_report_names_each_request_that_wrote_other_kv_and_the_layer():
    import io

    from tracekit.cli.replay_report import KV_WRITER_LINES, print_report

    moved = {f"R{n}": "model.layers.1.self_attn.attn" for n in range(KV_WRITER_LINES + 2)}
    results = [_result(0), _with_digest(_result(1), moved), _result(2)]
    stream = io.StringIO()
    print_report(ReplayResult.of_steps(results, SequenceFacts(requested=3, recorded=[0, 1, 2], rebuilt=[0])), stream)
    text = " ".join(stream.getvalue().split())
    assert "request R0 wrote other KV than recorded, from layer model.layers.1.self_attn.attn on" in text
    assert "... 2 more requests (--json)" in text and "step 1/kv_written" in text
