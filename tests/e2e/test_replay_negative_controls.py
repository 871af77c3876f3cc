"""Issue 4: replays that must NOT reproduce, and must say where. Each bundle is a real recording
edited with `rewrite_bundle` in one way; `tracekit replay` must exit 1 and name the first item
that diverges in forward order — so a bit-exact verdict elsewhere means something. A bundle
whose weights are nowhere to be found must exit 3 before any engine starts."""

import json

import pytest
import torch
from e2e_support import error_lines, only_on_runner, read_step, tracekit

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow


def replay_json(bundle, tmp_path, *extra, runner):
    out = tmp_path / "replay.json"
    finished = tracekit("replay", bundle, "--json", out, *extra, runner=runner)
    return finished, (json.loads(out.read_text()) if out.exists() else None)


def checks_by_item(result):
    return {check["item"]: check for check in result["checks"]}


def test_perturbed_kv_block_is_found_where_the_forward_first_reads_it(builtin_bundles, tmp_path, runner_kind):
    """A block only READ by the step is perturbed in layer 0: the layer-0 KV the step writes
    comes from its own tokens and still matches; layer 1's (which attends over layer 0) does not."""
    for path in builtin_bundles.values():
        group = read_step(path).kv.groups[0]
        read_only = sorted(set(group.read_block_ids) - set(group.written_block_ids))
        if read_only:
            break
    else:
        pytest.fail("no step reads a block it does not write")
    first_layer, second_layer = group.layer_names
    row = group.saved_block_ids.index(read_only[0])

    def perturb(metadata, tensors):
        tensors[f"steps/0/kv/groups/0/before/{first_layer}"][row] += 0.5
        # recorded by someone who never set the runner variable (tracekit's replay sets it)
        metadata["environment"]["env_vars"].pop("VLLM_USE_V2_MODEL_RUNNER", None)

    edited = rewrite_bundle(path, tmp_path / "perturbed.zst", perturb)
    finished, result = replay_json(edited, tmp_path, runner=runner_kind)
    assert finished.returncode == 1, finished.explain()
    assert not any("VLLM_USE_V2_MODEL_RUNNER" in d["field"] for d in result["environment_differences"]), \
        "tracekit's own setting of the runner kind is not a platform difference"
    assert "on the recording's own platform" in result["verdict_reason"], result["verdict_reason"]
    assert "every replay gave the same" in result["verdict_reason"]  # replayed again: a divergence, not noise
    checks = checks_by_item(result)
    assert checks[f"kv_written/{first_layer}"]["bit_exact"]
    assert result["first_divergence"] == f"kv_written/{second_layer}"
    assert not checks["hidden_states"]["bit_exact"]
    assert "NOT REPRODUCED" in finished.stdout and f"kv_written/{second_layer}" in finished.stdout


def least_likely_draw(bundles, drawn_by):
    """The bundle where a request `drawn_by` picks drew its least likely token (by the recorded
    logits): there the randomness decided the token, not the peak of the distribution."""
    candidates = []
    for path in bundles.values():
        _, step = load_step(path, None)
        for row, request in enumerate(step.requests):
            params, drawn = request.sampling_params, step.outputs.sampled_token_ids[row]
            if drawn_by(request) and params.temperature > 0 and drawn:
                probabilities = torch.softmax(step.outputs.logits[row] / params.temperature, dim=-1)
                candidates.append((float(probabilities[drawn[0]]), str(path)))
    assert candidates, "no such request sampled in this workload"
    return min(candidates)[1]


def assert_only_the_sampled_ids_diverge(edited, tmp_path, runner_kind):
    finished, result = replay_json(edited, tmp_path, runner=runner_kind)
    assert finished.returncode == 1, finished.explain()
    assert result["first_divergence"] == "sampled_token_ids"
    checks = checks_by_item(result)
    assert checks["hidden_states"]["bit_exact"] and checks["logits"]["bit_exact"]


@only_on_runner("v1")
def test_dropped_generator_state_changes_only_the_sampled_ids(builtin_bundles, tmp_path, runner_kind):
    """V1: without its generator state a seeded request samples from a freshly seeded generator."""
    path = least_likely_draw(builtin_bundles, lambda request: request.sampling_params.seed is not None)

    def drop_generator(metadata, tensors):
        for position, request in enumerate(metadata["steps"][0]["requests"]):
            if request["runner_state"].get("generator_state") is not None:
                del request["runner_state"]["generator_state"]
                del tensors[f"steps/0/requests/{position}/runner_state/generator_state"]

    assert_only_the_sampled_ids_diverge(rewrite_bundle(path, tmp_path / "no_generator.zst", drop_generator), tmp_path, runner_kind)


@only_on_runner("v2")
def test_changed_seeds_change_only_the_sampled_ids(builtin_bundles, tmp_path, runner_kind):
    """V2 samples each request from its seed (its own, or one the worker drew from NumPy's global
    RNG when the request arrived): with other seeds, a draw the noise decided comes out otherwise.

    Dropping the seeds instead is no control here: the replaying worker re-seeds NumPy's RNG from
    the engine seed and, adding the step's requests in their arrival order, draws the same seeds."""
    path = least_likely_draw(builtin_bundles, lambda request: True)
    _, step = load_step(path, None)
    assert any(
        drawn and drawn[0] != int(logits.argmax())
        for drawn, logits in zip(step.outputs.sampled_token_ids, step.outputs.logits)
    ), "every sampled draw of the workload was its argmax: no seed decided a token"

    def change_seeds(metadata, tensors):
        for request in metadata["steps"][0]["requests"]:
            request["runner_state"]["seed"] ^= 1

    assert_only_the_sampled_ids_diverge(rewrite_bundle(path, tmp_path / "other_seeds.zst", change_seeds), tmp_path, runner_kind)


def test_bundle_whose_weights_are_missing_exits_3_with_a_clear_message(builtin_bundles, tmp_path, runner_kind):
    missing = tmp_path / "no-such-model"

    def move_weights(metadata, tensors):
        engine = metadata["engine"]
        engine["model"]["path"] = str(missing)
        engine["model"]["weights_fingerprint"] = "blake2b-128:" + "0" * 32
        engine["engine_args"]["model"] = engine["engine_args"]["tokenizer"] = str(missing)

    edited = rewrite_bundle(next(iter(builtin_bundles.values())), tmp_path / "moved.zst", move_weights)
    finished = tracekit("replay", edited, runner=runner_kind)
    assert finished.returncode == 3, finished.explain()
    (line,) = error_lines(finished.stderr)
    assert line.startswith("tracekit: error:") and "weights are not at" in line and str(missing) in line
    assert "--model" in line  # says what to do about it
