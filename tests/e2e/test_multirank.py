"""Issue 10: a tensor-parallel (TP=2) engine of the embedded model, one worker process per rank.
Its steps are recorded every rank, through the vLLM plugin and through the Python API (vLLM's
collective_rpc), then replayed on all ranks at once in a fresh process: bit-exact on every rank,
and with one rank's KV perturbed, that rank named. Four engines in all (two recordings, two
replays), each in its own process."""

import json
import shutil

import pytest
import torch
from e2e_support import engine_script, read_content, tracekit

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
RECORDED_STEPS = (0, 1)  # record_tensor_parallel.py records steps 0:2
DECODE_STEP = 1  # the three prompts' first decode, reading the KV their prefill wrote


def _record(tmp_path_factory, how):
    out = tmp_path_factory.mktemp(f"tp2-{how}")
    result = engine_script("record_tensor_parallel", out / "result.json", out, how)
    assert not result["failures"], result
    return out, result


@pytest.fixture(scope="module")
def plugin_recording(tmp_path_factory):
    return _record(tmp_path_factory, "plugin")


@pytest.fixture(scope="module")
def api_recording(tmp_path_factory):
    return _record(tmp_path_factory, "api")


def expected_names():
    return {f"step{step}.rank{rank}.zst" for step in RECORDED_STEPS for rank in range(WORLD_SIZE)}


def test_an_unreachable_runner_is_refused_with_the_plugin_variable_that_works(api_recording):
    """The refusal names the variable the plugin reads (it once said TRACEKIT_RECORD=...)."""
    _, result = api_recording
    refusal = result["find_runner_refusal"]
    assert refusal and "cannot reach the model runner" in refusal and "TRACEKIT_RECORD_OUTPUT=" in refusal, refusal


def test_the_plugin_records_every_rank_without_overwrites(plugin_recording):
    out, result = plugin_recording
    assert set(result["files"]) == expected_names()
    set_ids = set()
    for step in RECORDED_STEPS:
        for rank in range(WORLD_SIZE):
            content = read_content(out / f"step{step}.rank{rank}.zst")
            parallel = content.parallel
            assert (parallel.rank, parallel.tp_rank, parallel.world_size) == (rank, rank, WORLD_SIZE)
            assert parallel.tensor_parallel_size == WORLD_SIZE and content.steps[0].index == step
            set_ids.add(parallel.set_id)
    assert len(set_ids) == 1 and None not in set_ids  # one session, shared by both ranks
    shown = json.loads(tracekit("inspect", out / "step1.rank1.zst", "--json").stdout)["rank_set"]
    assert shown["complete"] and shown["missing"] == []


def test_the_api_records_every_rank_through_collective_rpc(api_recording, plugin_recording):
    out, result = api_recording
    assert {p.split("/")[-1] for p in result["written"]} == set(result["files"]) == expected_names()
    # The same workload on the same engine: both ways record the same step, bit for bit.
    assert result["tokens"] == plugin_recording[1]["tokens"]
    for rank in range(WORLD_SIZE):
        _, by_api = load_step(out / f"step{DECODE_STEP}.rank{rank}.zst", None)
        _, by_plugin = load_step(plugin_recording[0] / f"step{DECODE_STEP}.rank{rank}.zst", None)
        assert torch.equal(by_api.outputs.hidden_states, by_plugin.outputs.hidden_states)
        assert by_api.outputs.sampled_token_ids == by_plugin.outputs.sampled_token_ids


def test_a_tp2_step_replays_bit_exact_on_every_rank(plugin_recording, tmp_path):
    out, _ = plugin_recording
    report = tmp_path / "replay.json"
    finished = tracekit("replay", out / f"step{DECODE_STEP}.rank1.zst", "--iters", "2", "--samples", "2",
                        "--json", report)
    assert finished.returncode == 0, finished.explain()
    result = json.loads(report.read_text())
    assert result["world_size"] == WORLD_SIZE and result["bit_exact"]
    for rank in result["ranks"]:
        assert rank["bit_exact"] and {"hidden_states", "logits", "sampled_token_ids"} <= {
            check["item"] for check in rank["checks"]}
        assert rank["modes"][rank["reference_mode"]]["latency_us"]["count"] == 2 * 2  # iters x samples timed forwards
    assert result["step_latency_us"]["count"] == 2 * 2
    assert f"verdict bit_exact: REPRODUCED on all {WORLD_SIZE} ranks (bit-exact" in finished.stdout


def test_one_ranks_perturbed_kv_is_named_with_its_rank(api_recording, tmp_path):
    """Rank 1's copy of the KV head (replicated: the model has one KV head for two ranks) is
    perturbed in layer 0. Rank 1's layer-0 KV written diverges first; rank 0's layer-0 KV still
    matches, but its layer 1 does not: rank 1's attention reached it through the all-reduce."""
    out, _ = api_recording
    shutil.copy(out / f"step{DECODE_STEP}.rank0.zst", tmp_path)
    first_layer, second_layer = read_content(out / f"step{DECODE_STEP}.rank1.zst").steps[0].kv.groups[0].layer_names

    def perturb(metadata, tensors):
        tensors[f"steps/0/kv/groups/0/before/{first_layer}"][0] += 0.5

    rewrite_bundle(out / f"step{DECODE_STEP}.rank1.zst", tmp_path / f"step{DECODE_STEP}.rank1.zst", perturb)
    report = tmp_path / "replay.json"
    finished = tracekit("replay", tmp_path / f"step{DECODE_STEP}.rank0.zst", "--no-timing", "--json", report)
    assert finished.returncode == 1, finished.explain()
    result = json.loads(report.read_text())
    assert result["first_divergence"] == f"rank 1: kv_written/{first_layer}"
    rank0 = {check["item"]: check for check in result["ranks"][0]["checks"]}
    assert rank0[f"kv_written/{first_layer}"]["bit_exact"] and not rank0[f"kv_written/{second_layer}"]["bit_exact"]
    assert f"first divergence at rank 1: kv_written/{first_layer}" in finished.stdout


def test_a_recorded_set_missing_a_rank_is_refused_before_any_engine(api_recording, tmp_path):
    out, _ = api_recording
    alone = shutil.copy(out / f"step{DECODE_STEP}.rank0.zst", tmp_path)
    finished = tracekit("replay", alone)
    assert finished.returncode == 2, finished.explain()
    assert "rank 1 (expected at" in finished.stderr and finished.seconds < 60
