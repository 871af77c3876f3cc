"""The GPU suite's changed-noise control, derived and built on the CPU from recorded GPU steps:
its step and number of variants follow the recorded logits, and each variant changes the noise
sources alone (the GPU replay is what says a variant was caught: test_gpu_replay.py)."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from gpu_support import sampling
from negative_controls import (
    MISSED,
    change_noise,
    draw_probability,
    make_negative_controls,
    repeat_probability,
    variants_needed,
)

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

TRACES = Path(__file__).resolve().parents[2] / "traces"
V1_STEPS = sorted((TRACES / "h200-vllm026").glob("*.zst"))
DRAFTED = TRACES / "h100-vllm026" / "v1-bf16-mtp-async-drafted.zst"


@pytest.mark.cpu_side
@pytest.mark.parametrize("repeat", [0.0, 1e-5, 0.01, 0.3, 0.316])
def test_variants_bring_a_miss_under_the_bound(repeat):
    needed = variants_needed(repeat)
    assert needed is not None and repeat ** needed <= MISSED
    assert needed == 1 or repeat ** (needed - 1) > MISSED  # the fewest


@pytest.mark.cpu_side
@pytest.mark.parametrize("repeat", [0.5, 0.99, 1.0])
def test_a_step_that_repeats_its_draws_is_no_control(repeat):
    assert variants_needed(repeat) is None


def _draw_probabilities(step) -> list[float]:
    """Each temperature-only request's softmax(logits / T) at its drawn id, computed directly."""
    found = []
    for row, req_id in enumerate(step.batch_order):
        params = sampling(step.request(req_id))
        if params.get("temperature") and not params.get("min_tokens") and step.outputs.sampled_token_ids[row]:
            probs = torch.softmax(step.outputs.logits[row].double() / params["temperature"], dim=-1)
            found.append(float(probs[step.outputs.sampled_token_ids[row][0]]))
    return found


@pytest.mark.cpu_side
def test_the_control_takes_the_step_least_likely_to_draw_again(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    for index, path in enumerate(V1_STEPS):
        shutil.copy(path, steps / f"step{index}.zst")
    # the seeded request (temperature 0.8, nothing else) in each step; the unseeded one sets
    # min_tokens, and greedy rows draw nothing anew: neither counts
    expected = {path.name: math.prod(_draw_probabilities(load_step(path, None)[1])) for path in V1_STEPS}
    for path in V1_STEPS:
        assert repeat_probability(load_step(path, None)[1]) == pytest.approx(expected[path.name])
    controls = make_negative_controls(steps, tmp_path / "controls")
    noise = sorted(name for name in controls.paths if name.startswith("changed_noise_"))
    assert noise == [f"changed_noise_{k}" for k in range(variants_needed(min(expected.values())))]
    assert not controls.noise_missing


@pytest.mark.cpu_side
def test_top_k_keeps_ties_at_the_kth_logit():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0])
    kept = torch.softmax(torch.tensor([3.0, 2.0, 2.0]), dim=-1)
    assert draw_probability(logits, {"temperature": 1.0, "top_k": 2}, 1) == pytest.approx(float(kept[1]))
    assert draw_probability(logits, {"temperature": 1.0, "top_k": 2}, 3) == 0.0
    assert draw_probability(logits, {"temperature": 2.0}, 3) == pytest.approx(float(torch.softmax(logits / 2, -1)[3]))


@pytest.mark.cpu_side
def test_a_drafted_step_is_not_a_noise_control():
    assert repeat_probability(load_step(DRAFTED, None)[1]) is None


def _seed_of(state: torch.Tensor) -> int:
    return int.from_bytes(bytes(state[:8].tolist()), "little")  # a CUDA generator's state starts with its seed


@pytest.mark.cpu_side
@pytest.mark.parametrize("variant", [0, 7])
def test_a_variant_changes_each_noise_source_and_nothing_else(variant, tmp_path):
    changed = load_step(rewrite_bundle(DRAFTED, tmp_path / "changed.zst", change_noise(variant)), None)[1]
    recorded = load_step(DRAFTED, None)[1]
    seeded = 0
    for before, after in zip(recorded.requests, changed.requests):
        state = before.runner_state.get("generator_state")
        if state is None:
            assert "generator_state" not in after.runner_state
            continue
        seeded += 1
        assert _seed_of(state) == before.sampling_params.seed
        new_state = after.runner_state["generator_state"]
        assert _seed_of(new_state) == before.sampling_params.seed ^ (1 << variant)
        assert torch.equal(new_state[8:], state[8:])  # the Philox offset is kept
    assert seeded == 2
    assert _seed_of(changed.rng["cuda"]) == _seed_of(recorded.rng["cuda"]) ^ (1 << variant)
    assert torch.equal(changed.rng["cuda"][8:], recorded.rng["cuda"][8:])
    assert torch.equal(changed.rng["cpu"], recorded.rng["cpu"])
    assert torch.equal(changed.outputs.logits, recorded.outputs.logits)


@pytest.mark.cpu_side
def test_a_v2_variant_flips_every_requests_seed(tmp_path):
    recorded_path = TRACES / "h200-vllm034-greedy" / "mixed.zst"
    changed = load_step(rewrite_bundle(recorded_path, tmp_path / "changed.zst", change_noise(3)), None)[1]
    recorded = load_step(recorded_path, None)[1]
    assert [r.runner_state["seed"] ^ 8 for r in recorded.requests] == [r.runner_state["seed"] for r in changed.requests]
    assert _seed_of(changed.rng["cuda"]) == _seed_of(recorded.rng["cuda"]) ^ 8
