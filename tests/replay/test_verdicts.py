"""Verdicts on real numbers from two machines: `traces/tiny-llama-mixed-step.zst` (AVX512) and
`traces/avx2-mixed-step-eager.zst` (AVX2) hold the same step of the same workload with the same
settings, so the AVX2 recording's outputs are exactly what a replay of the AVX512 bundle
produces on an AVX2 machine. No engine runs here: the checks compare recorded tensors."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tracekit.environment import environment_differences
from tracekit.errors import EXIT_NOT_REPRODUCED, EXIT_OK
from tracekit.format.content import load_step
from tracekit.integrations.seam import ObservedStep
from tracekit.numerics import PLATFORM_BOUNDS
from tracekit.replay import verdict as verdicts
from tracekit.replay.checks import CheckedItem, check_step

TRACES = Path(__file__).resolve().parents[2] / "traces"


@pytest.fixture(scope="module")
def avx512():
    return load_step(TRACES / "tiny-llama-mixed-step.zst", None)


@pytest.fixture(scope="module")
def avx2():
    return load_step(TRACES / "avx2-mixed-step-eager.zst", None)


def observed_like(step, batch_order, **changes) -> ObservedStep:
    """What a replay observes when it produces `step`'s recorded numbers. Request ids are random
    per engine, so the batch order is given in the reference's ids."""
    observed = ObservedStep(
        batch_order=list(batch_order),
        input_ids=step.input_ids,
        positions=step.positions,
        hidden_states=step.outputs.hidden_states,
        logits=step.outputs.logits,
        sampled_token_ids=[list(ids) for ids in step.outputs.sampled_token_ids],
        kv_after=[dict(group.after) for group in step.kv.groups],
    )
    return dataclasses.replace(observed, **changes)


def numeric_fields(recorded, here) -> list[str]:
    return [name for name, _, _, numeric in environment_differences(recorded, here) if numeric]


def test_the_two_machines_recorded_the_same_step_with_other_rounding(avx512, avx2):
    (_, reference), (_, other) = avx512, avx2
    assert [r.prompt_token_ids for r in reference.requests] == [r.prompt_token_ids for r in other.requests]
    assert torch.equal(reference.input_ids, other.input_ids)
    assert reference.outputs.sampled_token_ids == other.outputs.sampled_token_ids
    assert not torch.equal(reference.outputs.hidden_states, other.outputs.hidden_states)


def test_the_isa_is_the_numerics_relevant_field_the_two_recordings_differ_in(avx512, avx2):
    """Their env vars differ too: VLLM_LOGGING_LEVEL changes no number; fields the bundles predate
    (attention backend, thread count) are unknown, not different."""
    (content, _), (other, _) = avx512, avx2
    differences = {name: numeric for name, _, _, numeric in environment_differences(content.environment, other.environment)}
    assert [name for name, numeric in differences.items() if numeric and not name.startswith("env ")] == ["cpu_isa"]
    assert differences["env VLLM_LOGGING_LEVEL"] is False
    assert "attention_backend" not in differences and "num_threads" not in differences


def test_variables_a_bundle_did_not_look_at_are_unknown_not_different(avx512):
    """A bundle from before Inductor's and Triton's variables were recorded (no env_prefixes) says
    nothing about them: vLLM's own TRITON_/TORCHINDUCTOR_ settings here are no difference. Once
    both sides looked at them, a changed one is."""
    import dataclasses

    from tracekit.environment import RELEVANT_ENV_PREFIXES

    (content, _) = avx512
    old = dataclasses.replace(content.environment, env_prefixes=None)
    vllm_sets = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TRITON_CACHE_AUTOTUNING": "1"}
    here = dataclasses.replace(old, env_vars={**old.env_vars, **vllm_sets}, env_prefixes=list(RELEVANT_ENV_PREFIXES))
    assert environment_differences(old, here) == []
    new = dataclasses.replace(here, env_vars={**here.env_vars, "TORCHINDUCTOR_COMPILE_THREADS": "8"})
    assert [(name, numeric) for name, _, _, numeric in environment_differences(new, here)] == [
        ("env TORCHINDUCTOR_COMPILE_THREADS", True)]


def test_avx2_numbers_against_the_avx512_recording_are_a_platform_difference(avx512, avx2):
    (content, reference), (other_content, other) = avx512, avx2
    items = check_step(observed_like(other, reference.batch_order), reference)
    assert not any(item.bit_exact for item in items if item.float_dtype)  # every float item differs
    verdict = verdicts.decide(items, numeric_fields(content.environment, other_content.environment))
    assert verdict.name == verdicts.VerdictName.PLATFORM_DIFFERENCE, verdict
    assert verdict.exit_code() == EXIT_OK and verdict.exit_code(strict=True) == EXIT_NOT_REPRODUCED


def test_the_same_numbers_on_the_recording_platform_are_a_divergence(avx512, avx2):
    (_, reference), (_, other) = avx512, avx2
    verdict = verdicts.decide(check_step(observed_like(other, reference.batch_order), reference), [])
    assert verdict.name == verdicts.VerdictName.DIVERGED and verdict.exit_code() == EXIT_NOT_REPRODUCED


def test_identical_numbers_are_bit_exact_and_a_tolerance_admits_the_isa_drift(avx512, avx2):
    (_, reference), (_, other) = avx512, avx2
    same = verdicts.decide(check_step(observed_like(reference, reference.batch_order), reference), ["cpu_isa"])
    assert same.name == verdicts.VerdictName.BIT_EXACT and same.exit_code(strict=True) == EXIT_OK
    # The AVX2 drift is ~4e-7 relative RMS (docs/VERDICTS.md): 1e-6 admits it, 1e-8 does not.
    loose = check_step(observed_like(other, reference.batch_order), reference, tolerance=1e-6)
    assert verdicts.decide(loose, [], tolerance=1e-6).name == verdicts.VerdictName.WITHIN_TOLERANCE
    tight = check_step(observed_like(other, reference.batch_order), reference, tolerance=1e-8)
    assert verdicts.decide(tight, [], tolerance=1e-8).name == verdicts.VerdictName.DIVERGED


def test_a_real_bug_on_another_platform_is_still_a_divergence(avx512, avx2):
    """One token's hidden state lost (a masking bug): far beyond what the ISA explains."""
    (_, reference), (_, other) = avx512, avx2
    broken = other.outputs.hidden_states.clone()
    broken[3] = 0
    items = check_step(observed_like(other, reference.batch_order, hidden_states=broken), reference)
    verdict = verdicts.decide(items, ["cpu_isa"])
    assert verdict.name == verdicts.VerdictName.DIVERGED and verdict.beyond_bound == ["hidden_states"], verdict


def test_a_discrete_difference_is_a_divergence_whatever_the_platform(avx512, avx2):
    (_, reference), (_, other) = avx512, avx2
    swapped = list(reversed(reference.batch_order))
    verdict = verdicts.decide(check_step(observed_like(other, swapped), reference), ["cpu_isa"])
    assert verdict.name == verdicts.VerdictName.DIVERGED and verdict.beyond_bound[0] == "batch_order"


def test_differing_sampled_ids_say_whether_the_recorded_logits_were_a_near_tie(avx512, avx2):
    """Greedy row 0's replayed logits swap its top two: a margin the logits moved by (a near tie).
    Greedy row 3 samples another token with logits as recorded on AVX2: its margin dwarfs ~1e-5
    moves. Row 1 samples at temperature 0.8: no margin decides a random draw."""
    (_, reference), (_, other) = avx512, avx2
    temperatures = [request.sampling_params.temperature for request in reference.requests]
    assert temperatures[0] == temperatures[3] == 0.0 and temperatures[1] > 0
    logits = other.outputs.logits.clone()
    top2 = torch.topk(reference.outputs.logits[0], 2).indices
    logits[0, top2[0]], logits[0, top2[1]] = reference.outputs.logits[0, top2[1]], reference.outputs.logits[0, top2[0]]
    sampled = [list(ids) for ids in other.outputs.sampled_token_ids]
    sampled[0] = [int(top2[1])]
    sampled[1] = [sampled[1][0] + 1]
    sampled[3] = [sampled[3][0] + 1]
    items = check_step(observed_like(other, reference.batch_order, logits=logits, sampled_token_ids=sampled), reference)
    rows = {row["row"]: row for row in next(i for i in items if i.name == "sampled_token_ids").details["differing_rows"]}
    assert set(rows) == {0, 1, 3}
    margin = float(torch.topk(reference.outputs.logits[0].double(), 2).values.diff().abs())
    assert rows[0]["top2_margin"] == pytest.approx(margin) and rows[0]["near_tie"] is True
    assert rows[3]["near_tie"] is False and rows[3]["top2_margin"] > 100 * rows[3]["logits_max_abs_here"]
    assert rows[1]["sampling"] == "random (temperature 0.8)" and "near_tie" not in rows[1]
    verdict = verdicts.decide(items, ["cpu_isa"])
    assert verdict.name == verdicts.VerdictName.DIVERGED
    assert ": a near tie" in verdict.reason and ": not a near tie" in verdict.reason
    assert "random (temperature 0.8) sampling" in verdict.reason


def test_recorded_failures_are_reproduced_or_not():
    raised = CheckedItem("error", True, True, {"raised": "RuntimeError: boom"})
    silent = CheckedItem("error", False, False, {"raised": None})
    assert verdicts.decide([raised], ["cpu_isa"], error_step=True).name == verdicts.VerdictName.ERROR_REPRODUCED
    not_reproduced = verdicts.decide([silent], [], error_step=True)
    assert not_reproduced.name == verdicts.VerdictName.ERROR_NOT_REPRODUCED and not_reproduced.exit_code() == EXIT_NOT_REPRODUCED


def test_the_fp32_bound_leaves_a_wide_margin_over_the_measured_isa_drift(avx512, avx2):
    """The bound is calibrated with margin (docs/VERDICTS.md): the drift measured between the two
    machines must sit at least 10x inside it, or the bound is too tight to be useful."""
    (_, reference), (_, other) = avx512, avx2
    bound = PLATFORM_BOUNDS["float32"]
    for item in check_step(observed_like(other, reference.batch_order), reference):
        if item.float_dtype == "float32":
            assert 10 * item.details["relative_rms"] <= bound.relative_rms, item
            assert 10 * item.details["max_abs_vs_rms"] <= bound.max_abs_vs_rms, item


# Under another vLLM release than the recording's (a replay across releases).
ACROSS = ("0.32.0", "0.29.0")


def test_float_rounding_alone_under_another_release_is_a_release_difference(avx512, avx2):
    """The AVX2 numbers stand for what another release's kernels compute: every discrete item
    equal, every float item within the calibrated bound. Without per-layer outputs the reason
    says how to get the first diverging layer; exit 0 (1 with --strict), as for a platform."""
    (content, reference), (other_content, other) = avx512, avx2
    items = check_step(observed_like(other, reference.batch_order), reference)
    numeric = ["vllm_version", *numeric_fields(content.environment, other_content.environment)]
    verdict = verdicts.decide(items, numeric, releases=ACROSS)
    assert verdict.name == verdicts.VerdictName.RELEASE_DIFFERENCE, verdict
    assert "between vLLM 0.32.0 (recorded) and 0.29.0" in verdict.reason and "--layers" in verdict.reason
    assert verdict.exit_code() == EXIT_OK and verdict.exit_code(strict=True) == EXIT_NOT_REPRODUCED


def test_a_release_difference_names_the_first_diverging_layer(avx512, avx2):
    from tracekit.replay.checks import check_layers

    (_, reference), (_, other) = avx512, avx2
    recorded = {"model.embed_tokens": reference.input_ids.float(), "model.layers.0": reference.outputs.hidden_states,
                "model.layers.1": reference.outputs.hidden_states}
    here = {**recorded, "model.layers.0": other.outputs.hidden_states, "model.layers.1": other.outputs.hidden_states}
    items = check_step(observed_like(other, reference.batch_order), reference) + check_layers(here, recorded)
    verdict = verdicts.decide(items, ["vllm_version"], releases=ACROSS)
    assert verdict.name == verdicts.VerdictName.RELEASE_DIFFERENCE
    assert verdict.reason.endswith("first diverging layer model.layers.0"), verdict.reason


def test_the_same_numbers_under_another_release_are_bit_exact(avx512):
    (_, reference) = avx512
    verdict = verdicts.decide(check_step(observed_like(reference, reference.batch_order), reference),
                              ["vllm_version"], releases=ACROSS)
    assert verdict.name == verdicts.VerdictName.BIT_EXACT


def test_under_another_release_a_bug_or_another_draw_is_still_a_divergence(avx512, avx2):
    (_, reference), (_, other) = avx512, avx2
    broken = other.outputs.hidden_states.clone()
    broken[3] = 0
    lost = verdicts.decide(check_step(observed_like(other, reference.batch_order, hidden_states=broken), reference),
                           ["vllm_version"], releases=ACROSS)
    assert lost.name == verdicts.VerdictName.DIVERGED and "release difference" in lost.reason, lost
    drawn = [list(ids) for ids in reference.outputs.sampled_token_ids]
    drawn[1] = [drawn[1][0] + 1]
    resampled = verdicts.decide(
        check_step(observed_like(reference, reference.batch_order, sampled_token_ids=drawn), reference),
        ["vllm_version"], releases=ACROSS)
    assert resampled.name == verdicts.VerdictName.DIVERGED and resampled.beyond_bound == ["sampled_token_ids"]
    assert resampled.reason.startswith("the sampled ids differ from bit-identical logits, only in rows sampled at a "
                                       "temperature, and no change of the sampler between vLLM 0.32.0 and 0.29.0 is "
                                       "known to tracekit"), resampled.reason


SPLITMIX = "vLLM 0.29.0's sampler draws with exponential noise, 0.32.0's with SplitMix64 Gumbel-max noise"


def test_another_draw_under_a_release_whose_sampler_draws_otherwise_is_a_release_difference(avx512):
    """Issue 49 item 4: a token sampled at a temperature (row 1, temperature 0.8) differs from
    bit-identical logits, and the two releases' samplers are known to draw otherwise: the release
    change is the cause the tool names, so the verdict says so (exit 0), not `diverged`."""
    (_, reference) = avx512
    drawn = [list(ids) for ids in reference.outputs.sampled_token_ids]
    drawn[1] = [drawn[1][0] + 1]
    items = check_step(observed_like(reference, reference.batch_order, sampled_token_ids=drawn), reference)
    verdict = verdicts.decide(items, ["vllm_version"], releases=ACROSS, sampler_change=SPLITMIX)
    assert verdict.name == verdicts.VerdictName.RELEASE_DIFFERENCE and verdict.exit_code() == EXIT_OK, verdict
    assert verdict.reason.endswith(SPLITMIX + " (docs/RELEASES.md)")


def test_a_known_sampler_change_explains_no_greedy_row_and_no_moved_logits(avx512):
    """A greedy row's token (row 0) depends on the logits alone, and logits that moved are the
    forward's: neither is put down to the samplers."""
    (_, reference) = avx512
    drawn = [list(ids) for ids in reference.outputs.sampled_token_ids]
    drawn[0] = [drawn[0][0] + 1]
    greedy = verdicts.decide(check_step(observed_like(reference, reference.batch_order, sampled_token_ids=drawn),
                                        reference), ["vllm_version"], releases=ACROSS, sampler_change=SPLITMIX)
    assert greedy.name == verdicts.VerdictName.DIVERGED, greedy
    drawn = [list(ids) for ids in reference.outputs.sampled_token_ids]
    drawn[1] = [drawn[1][0] + 1]
    logits = reference.outputs.logits.clone()
    logits[2, 5] += 1.0
    moved = verdicts.decide(check_step(observed_like(reference, reference.batch_order, sampled_token_ids=drawn,
                                                     logits=logits), reference),
                            ["vllm_version"], releases=ACROSS, sampler_change=SPLITMIX)
    assert moved.name == verdicts.VerdictName.DIVERGED, moved


def test_non_finite_outputs_appearing_or_gone_under_another_release_are_told_apart(avx512):
    (_, reference) = avx512
    with_nan = reference.outputs.hidden_states.clone()
    with_nan[0, 0] = float("nan")
    appeared = verdicts.decide(
        check_step(observed_like(reference, reference.batch_order, hidden_states=with_nan), reference),
        ["vllm_version"], releases=ACROSS)
    assert appeared.name == verdicts.VerdictName.NONFINITE_APPEARED and appeared.exit_code() == EXIT_NOT_REPRODUCED
    assert "hidden_states" in appeared.reason
    nan_recorded = dataclasses.replace(reference, outputs=dataclasses.replace(reference.outputs, hidden_states=with_nan))
    gone = verdicts.decide(check_step(observed_like(reference, reference.batch_order), nan_recorded),
                           ["vllm_version"], releases=ACROSS)
    assert gone.name == verdicts.VerdictName.NONFINITE_GONE and gone.exit_code() == EXIT_NOT_REPRODUCED
    # The same NaN under the same release is a divergence as before: the finer outcomes are a
    # replay across releases'.
    assert verdicts.decide(check_step(observed_like(reference, reference.batch_order), nan_recorded),
                           []).name == verdicts.VerdictName.DIVERGED


def test_an_error_gone_or_appeared_under_another_release_is_told_apart():
    raised = CheckedItem(verdicts.ERROR_ITEM, True, True, {"raised": "RuntimeError: boom"})
    silent = CheckedItem(verdicts.ERROR_ITEM, False, False, {"raised": None})
    other = CheckedItem(verdicts.ERROR_ITEM, False, False, {"raised": "ValueError: other"})
    assert verdicts.decide([raised], ["vllm_version"], error_step=True, releases=ACROSS).name == \
        verdicts.VerdictName.ERROR_REPRODUCED
    gone = verdicts.decide([silent], ["vllm_version"], error_step=True, releases=ACROSS)
    assert gone.name == verdicts.VerdictName.ERROR_GONE and gone.exit_code() == EXIT_NOT_REPRODUCED
    assert verdicts.decide([other], ["vllm_version"], error_step=True, releases=ACROSS).name == \
        verdicts.VerdictName.ERROR_NOT_REPRODUCED
    appeared = verdicts.decide([CheckedItem(verdicts.ERROR_ITEM, False, False, {"raised": "IndexError: x", "recorded": None})],
                               ["vllm_version"], releases=ACROSS)
    assert appeared.name == verdicts.VerdictName.ERROR_APPEARED and "IndexError: x" in appeared.reason


def test_a_kv_digest_that_differs_decides_only_where_exactness_is_expected(avx512, avx2):
    """A window's later step also checks a digest of the KV it wrote (no magnitude): on the
    recording's platform it parts the step; across ISAs, or under a tolerance that admits the
    float items, the float items decide."""
    (_, reference), (_, other) = avx512, avx2
    digest = CheckedItem("kv_written", False, False, {"requests_moved": {"0": "layers.0"}}, digest_only=True)
    same_numbers = [*check_step(observed_like(reference, reference.batch_order), reference), digest]
    verdict = verdicts.decide(same_numbers, [])
    assert verdict.name == verdicts.VerdictName.DIVERGED and "kv_written" in verdict.reason, verdict
    isa_drift = [*check_step(observed_like(other, reference.batch_order), reference), digest]
    assert verdicts.decide(isa_drift, ["cpu_isa"]).name == verdicts.VerdictName.PLATFORM_DIFFERENCE
    loose = [*check_step(observed_like(other, reference.batch_order), reference, tolerance=1e-6), digest]
    assert verdicts.decide(loose, [], tolerance=1e-6).name == verdicts.VerdictName.WITHIN_TOLERANCE
