"""Issue 12, without an engine: cutting a recorded step down (`reduce_step`, the ddmin and
bisection searches) and redacting it keep every record of the step consistent; `tracekit shrink`
with a `command:` property (which needs no engine) finds the smallest batch, deterministically,
and refuses a property that does not hold. The sample bundle is a real mixed step: four decodes
(one with penalties) beside a 60-token prefill chunk."""

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, GrammarRecord, SchedulerOutputRecord
from tracekit.integrations.vllm.records.step_records import history_readers
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written
from tracekit.share.redact import NEUTRAL_TOKEN_ID, redact_steps
from tracekit.share.reduce_step import reduce_step, scheduled_tokens
from tracekit.share.shrink_trials import ddmin, shortest_length

SAMPLE = Path(__file__).parents[2] / "traces" / "tiny-llama-mixed-step.zst"
TRACEKIT = Path(sys.executable).parent / "tracekit"


@pytest.fixture(scope="module")
def sample():
    with open_bundle(SAMPLE) as reader:
        return BundleContent.from_plain(reader.resolve(reader.metadata, to="torch"))


def tokens_of(request):
    return request.prompt_token_ids + request.output_token_ids


def test_reduced_step_keeps_each_requests_inputs_and_only_the_kv_blocks_it_reads(sample):
    step = sample.steps[0]
    prefill = next(r for r in step.requests if r.is_prefill)
    decode = step.requests[-1] if not step.requests[-1].is_prefill else step.requests[0]
    keep = {decode.req_id: 1, prefill.req_id: 7}
    reduced = reduce_step(step, keep)

    assert reduced.batch_order == [req_id for req_id in step.batch_order if req_id in keep]
    expected_ids, expected_positions = [], []
    for req_id in reduced.batch_order:
        request = next(r for r in step.requests if r.req_id == req_id)
        start = request.num_computed_tokens
        expected_ids += tokens_of(request)[start : start + keep[req_id]]
        expected_positions += list(range(start, start + keep[req_id]))
    assert reduced.input_ids.tolist() == expected_ids
    assert reduced.positions.tolist() == expected_positions
    assert reduced.graph.num_tokens == reduced.graph.num_tokens_padded == sum(keep.values())
    assert reduced.outputs is None and reduced.error is None

    (group,), (original,) = reduced.kv.groups, step.kv.groups
    read, written = blocks_read_and_written(reduced.requests, 0, group.layout.block_size)
    assert group.read_block_ids == group.saved_block_ids == read and group.written_block_ids == written
    assert set(read) < set(original.saved_block_ids)
    for layer, tensor in group.before.items():
        for row, block in enumerate(group.saved_block_ids):
            assert torch.equal(tensor[row], original.before[layer][original.saved_block_ids.index(block)])
    assert group.after == {}

    record = reduced.scheduler_output
    assert record.num_scheduled_tokens == keep and record.total_num_scheduled_tokens == sum(keep.values())
    cached = record.scheduled_cached_reqs
    assert cached.req_ids == reduced.batch_order
    assert all(len(getattr(cached, name)) == len(keep) for name in cached.COLUMNS)


def test_reducing_to_the_whole_batch_changes_no_input(sample):
    step = sample.steps[0]
    reduced = reduce_step(step, scheduled_tokens(step))
    assert torch.equal(reduced.input_ids, step.input_ids) and torch.equal(reduced.positions, step.positions)
    assert reduced.requests == step.requests


def test_ddmin_finds_a_one_minimal_subset_and_remembers_nothing_it_need_not():
    needed = {"c", "f"}
    tried = []

    def holds(items):
        tried.append(tuple(items))
        return needed <= set(items)

    assert ddmin(list("abcdefgh"), holds) == ["c", "f"]
    assert ddmin(list("abcdefgh"), lambda items: needed <= set(items)) == ["c", "f"]  # same again
    # 1-minimal: removing either one breaks it
    assert not holds(["c"]) and not holds(["f"])


def test_shortest_length_bisects_to_the_first_length_that_holds():
    calls = []
    assert shortest_length(60, lambda n: calls.append(n) or n >= 23) == 23
    assert len(calls) <= 6  # ceil(log2(60))


def test_redacted_step_keeps_what_the_forward_and_sampling_read_and_nothing_else(sample):
    step = sample.steps[0]
    redacted, record = redact_steps(step, sample)
    assert redacted.batch_order == [f"req-{i}" for i in range(len(step.batch_order))]
    for old, new in zip(step.requests, redacted.requests):
        assert len(new.prompt_token_ids) == len(old.prompt_token_ids)
        assert len(new.output_token_ids) == len(old.output_token_ids)
        before, after = tokens_of(old), tokens_of(new)
        start, end = old.num_computed_tokens, old.num_computed_tokens + old.num_scheduled_tokens
        assert after[start:end] == before[start:end]  # the scheduled tokens: the forward's input ids
        params = old.sampling_params
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            assert after == before and record.history_kept[new.req_id]
        else:
            assert set(after[:start] + after[end:]) <= {NEUTRAL_TOKEN_ID}
            assert record.token_ids_blanked[new.req_id] == len(before) - (end - start)
    assert any(record.history_kept.values()), "the sample has a request with penalties"
    plain = msgpack.packb(redacted.scheduler_output.to_plain() | {"trigger": redacted.trigger}, default=str)
    assert not any(old.encode() in plain for old in step.batch_order)
    assert redacted.scheduler_output.num_scheduled_tokens == {
        new.req_id: new.num_scheduled_tokens for new in redacted.requests
    }


def with_sampling(step, index, **changes):
    requests = list(step.requests)
    requests[index] = dataclasses.replace(
        requests[index], sampling_params=dataclasses.replace(requests[index].sampling_params, **changes))
    return dataclasses.replace(step, requests=requests)


def test_redaction_blanks_unread_sampling_fields_and_keeps_the_token_prompt_logprobs_score(sample):
    step = sample.steps[0]
    index = next(i for i, r in enumerate(step.requests) if r.is_prefill)
    prefill = step.requests[index]
    changed = with_sampling(step, index, stop=["secret stop"], extra_args={"user": "alice"}, prompt_logprobs=2)
    redacted, record = redact_steps(changed, sample)
    new = redacted.requests[index]
    assert new.sampling_params.stop == [] and new.sampling_params.extra_args is None
    assert sorted(record.sampling_fields_removed[new.req_id]) == ["extra_args", "stop"]
    end = prefill.num_computed_tokens + prefill.num_scheduled_tokens
    assert new.prompt_token_ids[end] == prefill.prompt_token_ids[end] != NEUTRAL_TOKEN_ID
    assert set(new.prompt_token_ids[end + 1 :]) == {NEUTRAL_TOKEN_ID}


def test_bad_words_keep_a_requests_history_but_not_their_text(sample):
    step = sample.steps[0]
    changed = with_sampling(step, 0, bad_words=["secret"], _bad_words_token_ids=[[77]])
    redacted, record = redact_steps(changed, sample)
    new = redacted.requests[0]
    assert tokens_of(new) == tokens_of(step.requests[0]) and "bad_words" in record.history_kept[new.req_id]
    assert new.sampling_params.bad_words == [] and new.sampling_params._bad_words_token_ids == [[77]]


def test_watermarking_at_a_temperature_keeps_a_requests_history(sample):
    """vLLM's watermark sampler (0.30 on) keys a request's draw at a temperature by its last output
    tokens: such a request keeps its history; greedy, or with watermarking off (False, or None
    unresolved), it is not watermarked and its unread ids are blanked."""
    step = sample.steps[0]
    plain = [i for i, request in enumerate(step.requests) if not history_readers(request.sampling_params)]
    hot = next(i for i in plain if step.requests[i].sampling_params.temperature > 0)
    greedy = next(i for i in plain if step.requests[i].sampling_params.temperature == 0)
    for index in (hot, greedy):
        step = with_sampling(step, index, extras={**step.requests[index].sampling_params.extras, "watermarking": True})
    redacted, record = redact_steps(step, sample)
    hot_new, greedy_new = redacted.requests[hot], redacted.requests[greedy]
    assert tokens_of(hot_new) == tokens_of(step.requests[hot]) and record.history_kept[hot_new.req_id] == ["watermarking"]
    assert greedy_new.req_id not in record.history_kept and record.token_ids_blanked[greedy_new.req_id] > 0
    params = step.requests[hot].sampling_params
    for off in (False, None):
        assert history_readers(dataclasses.replace(params, extras={**params.extras, "watermarking": off})) == []


def test_redact_command_writes_a_bundle_inspect_marks_redacted(tmp_path):
    out = tmp_path / "shareable.zst"
    finished = subprocess.run([TRACEKIT, "redact", SAMPLE, "-o", out], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    shown = subprocess.run([TRACEKIT, "inspect", out], capture_output=True, text=True)
    assert "REDACTED" in shown.stdout and "kept every token id of req-3" in shown.stdout
    with open_bundle(out) as reader:
        env = reader.metadata["environment"]["env_vars"]
    assert "VLLM_LOGGING_LEVEL" not in env and "VLLM_SSM_CONV_STATE_LAYOUT" in env


def _batch_names_a_request_without_state(metadata, tensors):
    metadata["steps"][0]["batch_order"][0] = "nobody"


def _finished_ids_hold_no_list(metadata, tensors):
    metadata["steps"][0]["scheduler_output"]["finished_req_ids"] = {"$set": None}


def _new_requests_are_a_number(metadata, tensors):
    metadata["steps"][0]["scheduler_output"]["scheduled_new_reqs"] = 7


def _a_chunk_of_two_billion_tokens(metadata, tensors):
    metadata["steps"][0]["requests"][0]["num_scheduled_tokens"] = 2_000_000_000


@pytest.mark.parametrize("edit, code, complaint", [
    (_batch_names_a_request_without_state, 2, "request states and batch order name different requests"),
    (_finished_ids_hold_no_list, 2, "scheduler_output.finished_req_ids should be a list, not nil"),
    (_new_requests_are_a_number, 2, "scheduler_output.scheduled_new_reqs should be a list, not an int (7)"),
    (_a_chunk_of_two_billion_tokens, 0, None),
])
def test_redact_takes_hostile_steps_in_one_line_or_in_stride(edit, code, complaint, tmp_path):
    """Found by fuzzing `redact` (2026-12-05): a batch naming a request with no state raised
    KeyError, a recorded id set holding no list or a scheduler output record of other types
    TypeError (both now refused when the bundle is read, naming the field), and a huge scheduled
    count built a set of every position it names."""
    from tracekit.format.rewrite import rewrite_bundle

    edited = rewrite_bundle(SAMPLE, tmp_path / "edited.zst", edit)
    out = tmp_path / "out.zst"
    finished = subprocess.run([TRACEKIT, "redact", edited, "-o", out], capture_output=True, text=True, timeout=60)
    assert finished.returncode == code, finished.stderr
    if complaint:
        (line,) = finished.stderr.splitlines()
        assert line.startswith("tracekit: error: ") and complaint in line
        assert not out.exists()

def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def long_chunk_reaches(position, folder):
    """A command property: the bundle still holds the long prompt's chunk up to `position`."""
    script = folder / "reaches.py"
    script.write_text(
        "import sys\nfrom tracekit.format import open_bundle\n"
        "step = open_bundle(sys.argv[1]).metadata['steps'][0]\n"
        f"sys.exit(0 if any(len(r['prompt_token_ids']) > 100 and r['num_computed_tokens'] + "
        f"r['num_scheduled_tokens'] > {position} for r in step['requests']) else 1)\n"
    )
    return f"command:{sys.executable} {script}"


def test_shrink_with_a_command_property_finds_the_smallest_batch_twice_the_same(sample, tmp_path):
    position = 30
    outputs = [tmp_path / "small1.zst", tmp_path / "small2.zst"]
    for out in outputs:
        finished = subprocess.run(
            [TRACEKIT, "shrink", SAMPLE, "-o", out, "--until", long_chunk_reaches(position, tmp_path)],
            capture_output=True, text=True,
        )
        assert finished.returncode == 0, finished.stderr
    assert sha256(outputs[0]) == sha256(outputs[1])
    with open_bundle(outputs[0]) as reader:
        content = BundleContent.from_plain(reader.metadata)
    (request,) = content.steps[0].requests
    # the chunk must reach position `position`: it ends just after it
    assert request.num_computed_tokens + request.num_scheduled_tokens == position + 1
    (derivation,) = content.derivations
    assert derivation["kind"] == "shrink" and derivation["from"]["sha256"] == sha256(SAMPLE)
    # every request of the sample but the long one drops out
    assert (derivation["requests_before"], derivation["requests_after"]) == (len(sample.steps[0].requests), 1)
    assert "shrunk to" in finished.stdout and "replay" in finished.stderr


@pytest.mark.parametrize("until, complaint", [
    ("raises", "needs a bundle whose recorded forward raised"),
    ("command:false", "does not hold"),
    ("sometimes", "unknown --until"),
    ("diverges", "a cut single step holds no recorded outputs to part from"),
])
def test_shrink_refuses_a_property_that_does_not_hold_and_writes_nothing(until, complaint, tmp_path):
    out = tmp_path / "small.zst"
    finished = subprocess.run([TRACEKIT, "shrink", SAMPLE, "-o", out, "--until", until], capture_output=True, text=True)
    assert finished.returncode == 2, finished.stderr
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("tracekit: error:")]
    assert complaint in line
    assert list(tmp_path.iterdir()) == []


def test_a_cut_keeps_the_grammar_rows_and_features_of_the_requests_left(sample):
    """Two decodes sample under a grammar (rows in the scheduler's order, the second with a draft
    row); cut to one of them and the prefill chunk, only that request's rows stay."""
    step = dataclasses.replace(sample.steps[0])
    first, second = step.batch_order[1], step.batch_order[3]
    prefill = next(r.req_id for r in step.requests if r.is_prefill)
    bitmask = torch.arange(3 * 16, dtype=torch.int32).view(3, 16)
    step.grammar = GrammarRecord([second, first], [2, 1], bitmask, num_acceptable_drafts=[1, 0])
    step.features = {"structured_outputs": [first, second], "lora": [prefill]}
    reduced = reduce_step(step, {first: 1, prefill: 5})
    assert (reduced.grammar.request_ids, reduced.grammar.rows_per_request) == ([first], [1])
    assert torch.equal(reduced.grammar.bitmask, bitmask[2:3]) and reduced.grammar.num_acceptable_drafts == [0]
    assert reduced.features == {"structured_outputs": [first], "lora": [prefill]}
    assert reduce_step(step, {prefill: 5}).grammar is None  # a chunk cut short samples nothing


def test_a_drafted_request_cut_shorter_keeps_the_drafts_among_its_tokens(sample):
    """A decode verifying drafts [7, 9] schedules its last sampled token and then them; cut to
    two tokens it verifies [7], to one none: its drafts, the scheduler output's and its grammar
    rows (one, and one per draft) follow."""
    from tracekit.share import batch_variants

    step = sample.steps[0]
    req_id = step.batch_order[0]
    old = step.request(req_id)
    drafted = dataclasses.replace(old, draft_token_ids=[7, 9], num_scheduled_tokens=3, extras=dict(old.extras))
    step = batch_variants.reordered(dataclasses.replace(
        step, requests=[drafted if r.req_id == req_id else r for r in step.requests],
        scheduler_output=dataclasses.replace(step.scheduler_output, scheduled_spec_decode_tokens={req_id: [7, 9]},
                                             num_invalid_spec_tokens={req_id: 2})), step.batch_order)
    step.grammar = GrammarRecord([req_id], [3], torch.arange(3 * 16, dtype=torch.int32).view(3, 16),
                                 num_acceptable_drafts=[2])
    for count, drafts in ((3, [7, 9]), (2, [7]), (1, [])):
        reduced = reduce_step(step, {req_id: count})
        assert reduced.request(req_id).draft_token_ids == drafts
        assert reduced.scheduler_output.scheduled_spec_decode_tokens == ({req_id: drafts} if drafts else {})
        assert reduced.scheduler_output.num_invalid_spec_tokens == {req_id: len(drafts)}
        assert reduced.grammar.rows_per_request == [1 + len(drafts)]
        assert torch.equal(reduced.grammar.bitmask, step.grammar.bitmask[:1 + len(drafts)])
        assert reduced.grammar.num_acceptable_drafts == [len(drafts)]
        assert reduced.input_ids.tolist() == [old.output_token_ids[-1], 7, 9][:count]

def test_redaction_renames_the_grammar_and_feature_requests(sample):
    step = dataclasses.replace(sample.steps[0])
    first = step.batch_order[2]
    step.grammar = GrammarRecord([first], [1], torch.zeros(1, 16, dtype=torch.int32))
    step.features = {"structured_outputs": [first]}
    redacted, _ = redact_steps(step, sample)
    assert redacted.grammar.request_ids == ["req-2"] and redacted.features == {"structured_outputs": ["req-2"]}


def test_a_later_window_step_cut_keeps_its_kept_requests_proposals_and_no_kv_digest(sample):
    """Shrinking a window by requests: the drafter's proposals (token ids) of the kept requests
    stay, row for row; the digest of the step's KV writes goes (floats: they depend on the batch)."""
    from tracekit.format.schema import CarriedStep, KVWritten
    from tracekit.share.reduce_step import as_carried

    step = sample.steps[0]
    kept = step.batch_order[1:3]
    cut = reduce_step(step, {req_id: step.request(req_id).num_scheduled_tokens for req_id in kept})
    proposals = torch.arange(len(step.batch_order) * 2).view(-1, 2)
    recorded = CarriedStep(index=step.index, scheduler_output=SchedulerOutputRecord(), batch_order=list(step.batch_order),
                           proposals=proposals,
                           kv_written=[KVWritten(["layers.0"], torch.zeros(1, len(step.batch_order), dtype=torch.int64))])
    carried = as_carried(cut, recorded, set(kept))
    assert carried.batch_order == kept and carried.kv_written == []
    assert carried.proposals.tolist() == proposals[1:3].tolist()


def _forged_window(folder, length=3):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "format"))
    from window_forge import window_content

    from tracekit.format.content import write_content

    return write_content(folder / "window.zst", window_content(length))


def test_shrink_cuts_a_window_by_requests_for_a_command_property(sample, tmp_path):
    """A `command:` property on a window (no engine): every step keeps only the request the
    command needs, the steps all kept (no replay tells which it needs)."""
    window = _forged_window(tmp_path)
    (long_id,) = [r.req_id for r in sample.steps[0].requests if len(r.prompt_token_ids) > 100]
    script = tmp_path / "every_step_runs.py"
    script.write_text(
        "import sys\nfrom tracekit.format import open_bundle\n"
        "step = open_bundle(sys.argv[1]).metadata['steps'][0]\n"
        "orders = [step['batch_order'], *[later['batch_order'] for later in step['window']['steps']]]\n"
        f"sys.exit(0 if all({long_id!r} in order for order in orders) else 1)\n"
    )
    out = tmp_path / "small.zst"
    finished = subprocess.run([TRACEKIT, "shrink", window, "-o", out, "--until", f"command:{sys.executable} {script}"],
                              capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    with open_bundle(out) as reader:
        content = BundleContent.from_plain(reader.metadata)
    first = content.steps[0]
    assert first.window_indices == [first.index, first.index + 1, first.index + 2]
    assert [first.batch_order, *[later.batch_order for later in first.later]] == [[long_id]] * 3
    derivation = content.derivations[-1]
    assert (derivation["requests_before"], derivation["requests_after"]) == (len(sample.steps[0].requests), 1)


def test_shrink_refuses_modes_differ_on_a_window_before_any_engine(tmp_path):
    window = _forged_window(tmp_path)
    out = tmp_path / "small.zst"
    finished = subprocess.run([TRACEKIT, "shrink", window, "-o", out, "--until", "modes-differ"],
                              capture_output=True, text=True)
    assert finished.returncode == 2, finished.stderr
    (line,) = [line for line in finished.stderr.splitlines() if line.startswith("tracekit: error:")]
    assert "record the step alone (no --window)" in line
    assert not out.exists()
