"""Under async scheduling V1 learns a decode's last sampled token only after the next step was
prepared: its request state holds -1, its forward reads the real id from the device. The
recorder, and the replay of a bundle recorded before it did, take the id from the input ids
the forward read. (traces/h200-vllm026/ holds such bundles from an H200.)"""

from pathlib import Path

import torch

from tracekit.format.content import load_step
from tracekit.integrations.vllm.runners.v1_runner import PLACEHOLDER_TOKEN, fill_placeholders

ASYNC_DECODE = Path(__file__).resolve().parents[2] / "traces" / "h200-vllm026" / "v1-bf16-decode-fullgraph-async.zst"


def test_the_h200_bundle_holds_placeholders_and_the_ids_the_forward_read():
    _, step = load_step(ASYNC_DECODE, None)
    assert all(request.output_token_ids[-1] == PLACEHOLDER_TOKEN for request in step.requests)
    fill_placeholders([step.request(req_id) for req_id in step.batch_order], step.input_ids)
    real = step.input_ids[: step.num_real_rows].tolist()
    assert [step.request(req_id).output_token_ids[-1] for req_id in step.batch_order] == real
    assert PLACEHOLDER_TOKEN not in real


def test_only_placeholders_at_the_computed_positions_are_filled():
    from tracekit.format.schema import RequestState

    decode = RequestState("a", [1, 2, 3], [9, PLACEHOLDER_TOKEN], [[0]], num_computed_tokens=4, num_scheduled_tokens=1)
    chunk = RequestState("b", [5, 6, 7, 8], [], [[1]], num_computed_tokens=1, num_scheduled_tokens=2)
    fill_placeholders([decode, chunk], torch.tensor([42, 6, 7, 0]))
    assert decode.output_token_ids == [9, 42] and chunk.prompt_token_ids == [5, 6, 7, 8]


MIXED_ASYNC = ASYNC_DECODE.with_name("v1-bf16-mixed-nograph-async.zst")


def test_a_recompute_replay_needs_every_token_before_the_step():
    from tracekit.integrations.vllm.engines.step_driver import unknown_tokens_to_recompute

    _, step = load_step(MIXED_ASYNC, None)
    decodes = [request for request in step.requests if request.output_token_ids[-1:] == [PLACEHOLDER_TOKEN]]
    assert decodes  # each holds its first sampled id, and a placeholder for the one the step reads
    # The placeholder is the step's input, which the bundle's input ids hold: nothing is missing.
    assert unknown_tokens_to_recompute(step) == 0
    # Kept from host memory alone (no input ids), the step's own token is missing too.
    step.input_ids = None
    assert unknown_tokens_to_recompute(step) == len(decodes)
    # V1 under async scheduling, no penalties in the batch: every sampled id stays a placeholder.
    for request in decodes:
        request.output_token_ids[0] = PLACEHOLDER_TOKEN
    assert unknown_tokens_to_recompute(step) == 2 * len(decodes)


def test_a_recompute_bundle_without_its_token_ids_is_refused_before_any_engine(tmp_path):
    import pytest

    from tracekit.errors import BundleError
    from tracekit.format.content import write_steps
    from tracekit.format.schema import KVMode
    from tracekit.replay.replayer import replay

    content, step = load_step(MIXED_ASYNC, None)
    step.kv.mode = KVMode.RECOMPUTE.value
    for request in step.requests:
        if request.output_token_ids:
            request.output_token_ids[0] = PLACEHOLDER_TOKEN
    bundle = write_steps(tmp_path / "recompute.zst", content.environment, content.engine, [step])
    # Refused as bad input (exit 2) on a machine that could not build its engine either (vLLM 0.26).
    with pytest.raises(BundleError, match=r"token ids before step \d+ are not in the bundle.*--kv read"):
        replay(bundle)


FIXTURES = sorted(ASYNC_DECODE.parent.glob("*.zst"))


def test_every_h200_fixture_reads_the_ids_its_request_states_hold():
    """The input ids a replay builds (each request's tokens at its scheduled positions, the
    runner's placeholders left to it) are the ids the recorded forward read: V1 under async
    scheduling, decode and mixed steps, graphs and none."""
    for path in FIXTURES:
        _, step = load_step(path, None)
        assert step.input_ids_disagreement() is None, path.name


def _decode_whose_state_says_another_token(tmp_path: Path) -> Path:
    """The H200 async decode step with one request's newest token — the one its forward reads —
    held as a real id other than the one read: what a replay of a recording made when the
    request states missed the async outputs would build (it read other ids than the engine)."""
    from tracekit.format.rewrite import rewrite_bundle

    def edit(metadata, tensors):
        request = metadata["steps"][0]["requests"][0]
        read = int(tensors["steps/0/input_ids"][0])
        request["output_token_ids"][-1] = (read + 420) % 512

    return rewrite_bundle(ASYNC_DECODE, tmp_path / "disagrees.zst", edit)


def test_a_bundle_whose_states_disagree_with_its_input_ids_is_refused_before_any_engine(tmp_path):
    import subprocess
    import sys

    bundle = _decode_whose_state_says_another_token(tmp_path)
    _, step = load_step(bundle, None)
    assert "where the recorded forward read" in step.input_ids_disagreement()
    done = subprocess.run([sys.executable, "-m", "tracekit", "replay", str(bundle), "--no-timing"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])  # bad input, not "cannot run here" (3)
    message = done.stderr.strip().splitlines()[-1]
    assert "holds token" in message and "position 18" in message and "Traceback" not in done.stderr


MTP_DRAFTED = ASYNC_DECODE.parents[1] / "h100-vllm026" / "v1-bf16-mtp-async-drafted.zst"


def _runner_window(request) -> list[int]:
    """The input ids V1's runner puts in a request's scheduled rows: its tokens from its computed
    count on, its drafts written after its prompt and outputs (`update_req_spec_token_ids`)."""
    tokens = [*request.prompt_token_ids, *request.output_token_ids, *request.draft_token_ids]
    window = tokens[request.num_computed_tokens: request.num_computed_tokens + request.num_scheduled_tokens]
    return window + [0] * (request.num_scheduled_tokens - len(window))  # past its tokens: zeros


def test_a_drafted_decode_whose_accepted_drafts_are_not_on_the_host_yet_gets_its_inputs_in_place():
    """V1 with MTP drafting under async scheduling (H100, vLLM 0.26, step 10): a request whose
    previous step accepted its drafts holds them on the host only once the engine reads that
    step's output; as recorded its tokens end three before its forward's first position, and its
    replay verified zeros for drafts. Padded to that position and filled from the input ids, every
    request's tokens put the step's inputs in the rows its forward read."""
    from tracekit.format.schema import token_runs
    from tracekit.integrations.vllm.runners.v1_runner import hold_tokens_up_to_the_inputs

    _, step = load_step(MTP_DRAFTED, None)
    requests = [step.request(req_id) for req_id in step.batch_order]
    runs = [step.input_ids[run.start: run.stop].tolist() for run in token_runs(requests)]
    assert [_runner_window(request) for request in requests] != runs  # as recorded: one request's rows early
    hold_tokens_up_to_the_inputs(requests, step.positions)
    fill_placeholders(requests, step.input_ids)
    assert [_runner_window(request) for request in requests] == runs
    assert all(len(r.prompt_token_ids) + len(r.output_token_ids) == r.num_computed_tokens + 1 for r in requests)


def test_a_position_from_a_stranger_pads_no_more_than_the_step_has_rows():
    from tracekit.format.schema import RequestState
    from tracekit.integrations.vllm.runners.v1_runner import hold_tokens_up_to_the_inputs

    decode = RequestState("a", [1, 2, 3], [9], [[0]], num_computed_tokens=4, num_scheduled_tokens=1)
    hold_tokens_up_to_the_inputs([decode], torch.tensor([10**12]))
    assert decode.output_token_ids == [9]
    hold_tokens_up_to_the_inputs([decode], torch.tensor([5]))  # two tokens short, one row: not padded
    assert decode.output_token_ids == [9]
    hold_tokens_up_to_the_inputs([decode], torch.tensor([4]))
    assert decode.output_token_ids == [9, PLACEHOLDER_TOKEN]
