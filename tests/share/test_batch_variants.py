"""Issue 19, without an engine: the batches `tracekit invariance` runs a recorded step in stay
consistent records (input ids, positions, KV blocks read, scheduler output), the token
thresholds its filler variants cross come from the engine's tables and 256-token boundaries,
and the command refuses bad input with exit 2 before any engine starts. The sample is a real
mixed step: four decodes beside a 60-token prefill chunk (8 tokens already computed)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.errors import UsageError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written
from tracekit.share import batch_variants
from tracekit.share.invariance import VARIANT_KINDS, build_variants, sampling_reproducible, token_thresholds

SAMPLE = Path(__file__).parents[2] / "traces" / "tiny-llama-mixed-step.zst"
TRACEKIT = Path(sys.executable).parent / "tracekit"


@pytest.fixture(scope="module")
def step():
    with open_bundle(SAMPLE) as reader:
        return BundleContent.from_plain(reader.resolve(reader.metadata, to="torch")).steps[0]


def rows_of(step):
    """req_id -> (input ids, positions) of its scheduled tokens, from the step's tensors."""
    rows, offset = {}, 0
    for req_id in step.batch_order:
        count = step.request(req_id).num_scheduled_tokens
        rows[req_id] = (step.input_ids[offset: offset + count].tolist(), step.positions[offset: offset + count].tolist())
        offset += count
    return rows


def assert_consistent(variant):
    scheduled = {req_id: variant.request(req_id).num_scheduled_tokens for req_id in variant.batch_order}
    assert variant.scheduler_output.num_scheduled_tokens == scheduled
    assert variant.scheduler_output.total_num_scheduled_tokens == sum(scheduled.values()) == variant.num_real_rows
    assert len(variant.input_ids) == len(variant.positions) == variant.num_real_rows
    assert variant.outputs is None
    (group,) = variant.kv.groups
    read, written = blocks_read_and_written(variant.requests, 0, group.layout.block_size)
    assert (group.read_block_ids, group.written_block_ids) == (read, written)


def test_a_reordered_batch_moves_each_requests_own_inputs_with_it(step):
    order = step.batch_order[::-1]
    variant = batch_variants.reordered(step, order)
    assert variant.batch_order == order
    assert rows_of(variant) == rows_of(step)
    assert variant.kv.groups[0].saved_block_ids == step.kv.groups[0].saved_block_ids
    assert_consistent(variant)
    with pytest.raises(UsageError):
        batch_variants.reordered(step, order[1:])


def test_a_drafted_request_takes_its_drafts_into_another_batch(step):
    """Speculative decoding: a decode that verifies drafts feeds its last sampled token and then
    its drafts, at the positions after it; the scheduler output schedules them."""
    first = step.batch_order[0]
    old = step.request(first)
    drafted = dataclasses.replace(old, draft_token_ids=[7, 9], num_scheduled_tokens=3, extras=dict(old.extras))
    requests = [drafted if request.req_id == first else request for request in step.requests]
    with_drafts = dataclasses.replace(step, requests=requests, scheduler_output=dataclasses.replace(
        step.scheduler_output, scheduled_spec_decode_tokens={first: [7, 9]}))
    variant = batch_variants.reordered(with_drafts, step.batch_order[::-1])
    ids, positions = rows_of(variant)[first]
    assert ids == [old.output_token_ids[-1], 7, 9]
    assert positions == [old.num_computed_tokens + offset for offset in range(3)]
    assert variant.scheduler_output.scheduled_spec_decode_tokens == {first: [7, 9]}
    assert_consistent(variant)

def test_fillers_are_greedy_prefills_in_blocks_no_request_owns(step):
    variant = batch_variants.with_fillers(step, extra_tokens=100, max_requests=8, max_model_len=64)
    fillers = [request for request in variant.requests if batch_variants.is_filler(request.req_id)]
    assert [len(f.prompt_token_ids) for f in fillers] == [63, 37]  # each at most max_model_len - 1
    assert variant.num_real_rows == step.num_real_rows + 100
    assert variant.batch_order[: len(step.batch_order)] == step.batch_order
    owned = {block for request in step.requests for block in request.block_ids[0]}
    filler_blocks = [block for f in fillers for block in f.block_ids[0]]
    assert len(filler_blocks) == len(set(filler_blocks)) == 2 + 2 and not owned & set(filler_blocks)
    assert 0 not in filler_blocks  # vLLM's null block
    for filler in fillers:
        assert filler.num_computed_tokens == 0 and filler.num_scheduled_tokens == len(filler.prompt_token_ids)
        assert sampling_reproducible(filler) == "greedy" and filler.sampling_params.repetition_penalty == 1.0
    assert {req_id: rows for req_id, rows in rows_of(variant).items() if req_id in step.batch_order} == rows_of(step)
    assert not set(variant.kv.groups[0].saved_block_ids) & set(filler_blocks)
    assert_consistent(variant)
    with pytest.raises(UsageError, match="at most 6 request"):
        batch_variants.with_fillers(step, extra_tokens=100, max_requests=6, max_model_len=64)


def test_a_recomputed_prefix_is_scheduled_again_and_written_not_read(step):
    prefill = next(request for request in step.requests if request.is_prefill)
    variant = batch_variants.recomputed(step, prefill.req_id)
    again = variant.request(prefill.req_id)
    end = prefill.num_computed_tokens + prefill.num_scheduled_tokens
    assert (again.num_computed_tokens, again.num_scheduled_tokens) == (0, end)
    ids, positions = rows_of(variant)[prefill.req_id]
    assert ids == prefill.prompt_token_ids[:end] and positions == list(range(end))
    others = {req_id: rows for req_id, rows in rows_of(step).items() if req_id != prefill.req_id}
    assert {req_id: rows for req_id, rows in rows_of(variant).items() if req_id != prefill.req_id} == others
    assert set(prefill.block_ids[0]) <= set(variant.kv.groups[0].written_block_ids)
    assert_consistent(variant)


def test_filler_targets_cross_capture_sizes_compile_ranges_and_256_token_boundaries(step):
    graphed = dataclasses.replace(step, graph=dataclasses.replace(
        step.graph, capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128], compile_sizes=[96], num_tokens=64))
    thresholds = token_thresholds(graphed, compile_range_ends=[200, 1024], max_tokens=1024)
    assert thresholds["multiples_of_256"] == [256, 512, 768, 1024]
    # one token past each threshold at or above the step's 64 tokens, the four lowest
    assert thresholds["filler_targets"] == [65, 97, 129, 201]
    assert thresholds["unreachable"] == [1024]
    # no threshold reachable: the largest batch the engine runs
    assert token_thresholds(step, [], 100)["filler_targets"] == [100]
    assert token_thresholds(step, [], 64)["filler_targets"] == []


def test_variants_that_cannot_run_say_why(step):
    thresholds = token_thresholds(step, [], 64)
    variants = build_variants(step, VARIANT_KINDS, thresholds, max_requests=8, max_model_len=512, cached_prefix={})
    by_name = {variant.name: variant for variant in variants}
    assert [name for name in by_name if name.startswith("alone:")] == [f"alone:{r}" for r in step.batch_order]
    assert {"repeat", "order:reversed", "order:rotated"} <= set(by_name)
    assert by_name["fillers"].step is None and "most tokens" in by_name["fillers"].reason
    assert by_name["recomputed"].step is None and "prefix cache" in by_name["recomputed"].reason
    prefill = next(request for request in step.requests if request.is_prefill)
    (recomputed,) = build_variants(step, ("recomputed",), thresholds, 8, 512, {prefill.req_id: 8})
    assert recomputed.step is None and "more than the engine runs per step (64)" in recomputed.reason


@pytest.mark.parametrize("argv, message", [
    (["--variants", "alone,sideways", str(SAMPLE)], "sideways"),
    (["/nonexistent/step.zst"], "no bundle at"),
])
def test_bad_input_exits_2_with_one_line_before_any_engine(argv, message):
    done = subprocess.run([str(TRACEKIT), "invariance", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert message in line


def test_a_bundle_of_another_device_exits_3_with_its_json_record(tmp_path):
    gpu_bundle = SAMPLE.parent / "h200-vllm026" / "v1-fp32-mixed-nograph-async.zst"
    out = tmp_path / "report.json"
    done = subprocess.run([str(TRACEKIT), "invariance", str(gpu_bundle), "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("tracekit: error: the bundle was recorded on a cuda device")
    record = json.loads(out.read_text())
    assert (record["verdict"], record["exit_code"], record["step"]) == ("cannot_run_here", 3, 2)
