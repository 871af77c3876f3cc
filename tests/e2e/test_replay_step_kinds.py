"""Issue 4: every kind of engine step a live engine produces replays bit-exact in a fresh
process — inputs, KV written, hidden states, logits and sampled ids — and the replaying engine
still serves afterwards.

Bundles are picked by what their metadata says the step was, so a workload that stops producing
a kind of step fails here instead of passing vacuously."""

import pytest
from e2e_support import BUILTIN_STEP_KINDS, assert_replayed_bit_exact, of_kind

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", BUILTIN_STEP_KINDS)
def test_builtin_workload_step_replays_bit_exact_eager(kind, builtin_bundles, eager_replays):
    assert_replayed_bit_exact(eager_replays, of_kind(builtin_bundles, kind))


@pytest.mark.parametrize("kind", BUILTIN_STEP_KINDS)
def test_builtin_workload_step_replays_bit_exact_compiled(kind, compiled_bundles, compiled_replays):
    replayed = {index: path for index, path in of_kind(compiled_bundles, kind).items() if str(path) in compiled_replays["replays"]}
    assert_replayed_bit_exact(compiled_replays, replayed)


def test_prefill_starting_from_a_prefix_cache_hit_replays_bit_exact(prefix_cache_bundles, eager_replays):
    hits = of_kind(prefix_cache_bundles, "prefix_cache_hit")
    assert_replayed_bit_exact(eager_replays, hits)


def test_step_recomputing_a_request_resumed_after_preemption_replays_bit_exact(preemption_bundles, preemption_replays):
    resumed = of_kind(preemption_bundles, "resumed_after_preemption")
    before = {min(resumed) - 1: preemption_bundles[min(resumed) - 1]}
    assert_replayed_bit_exact(preemption_replays, {**before, **resumed})


def test_engine_serves_the_same_tokens_after_replays(eager_replays, preemption_replays, compiled_replays):
    for replays in (eager_replays, preemption_replays, compiled_replays):
        assert len(replays["serve_before"]) == 8
        assert replays["serve_after"] == replays["serve_before"]
