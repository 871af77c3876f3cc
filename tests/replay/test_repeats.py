"""Issue 49 item 3: a step that does not reproduce is replayed again from the same restored state,
and replays that disagree among themselves make it `nondeterministic` (exit 6), naming the first
item where they do and what they gave alike before it; replays that agree leave it `diverged`.
On the real recorded mixed step of traces/ (no engine: the checks compare tensors), and the heap
perturbation the repeats run under, on this process's own C library."""

import ctypes
from pathlib import Path

import pytest

from tracekit.errors import EXIT_NONDETERMINISTIC, EXIT_NOT_REPRODUCED
from tracekit.format.content import load_step
from tracekit.replay import verdict as verdicts
from tracekit.replay.checks import check_step, replayed_digest
from tracekit.replay.repeats import HERE, Repeats, Run, heap_perturbed, repeat_here
from tracekit.replay.verdict_names import worst_exit_code

TRACES = Path(__file__).resolve().parents[2] / "traces"


@pytest.fixture(scope="module")
def recorded():
    from test_verdicts import observed_like

    _, step = load_step(TRACES / "tiny-llama-mixed-step.zst", None)
    return step, lambda **changes: observed_like(step, step.batch_order, **changes)


def _drawn_otherwise(step, row: int, by: int) -> list[list[int]]:
    drawn = [list(ids) for ids in step.outputs.sampled_token_ids]
    drawn[row] = [drawn[row][0] + by]
    return drawn


def test_replays_that_disagree_at_the_sampled_ids_make_the_step_nondeterministic(recorded):
    """The replay and one repeat draw another token each in row 1, the other repeat the recorded
    one, from bit-identical logits: the engine does not repeat itself at `sampled_token_ids`."""
    step, observed = recorded
    first = check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step)
    again = iter([check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step),
                  check_step(observed(), step)])
    repeats = repeat_here(first, lambda: next(again), 2)
    verdict = verdicts.decide(first, [], repeats=repeats)
    assert verdict.name == verdicts.VerdictName.NONDETERMINISTIC and verdict.exit_code() == EXIT_NONDETERMINISTIC
    disagreement = repeats.disagreement()
    assert disagreement.item == "sampled_token_ids" and disagreement.results == 2
    assert {"input_ids", "hidden_states", "logits"} <= set(disagreement.alike_before)
    assert "first at sampled_token_ids (2 different results)" in verdict.reason and "3 this process" in verdict.reason
    assert verdict.reason.index("logits") < verdict.reason.index("before it")


def test_replays_that_agree_leave_the_step_diverged_and_say_so(recorded):
    step, observed = recorded
    first = check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step)
    repeats = repeat_here(first, lambda: check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step), 2)
    here_only = verdicts.decide(first, [], repeats=repeats)  # as a suite replays it: on its engine only
    assert here_only.name == verdicts.VerdictName.DIVERGED
    assert here_only.reason.endswith("(replay the bundle alone to repeat it in a fresh process too)")
    repeats.failures.append("a fresh process: exit 3: no weights here")
    verdict = verdicts.decide(first, [], repeats=repeats)
    assert verdict.name == verdicts.VerdictName.DIVERGED and verdict.exit_code() == EXIT_NOT_REPRODUCED
    assert "replayed 3 times from the same restored state (3 this process): every replay gave the same" in verdict.reason
    assert verdict.reason.endswith("not replayed again in a fresh process: exit 3: no weights here")


def test_a_repeat_that_raises_disagrees_with_replays_that_ran_through(recorded):
    step, observed = recorded
    first = check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step)

    def raises():
        raise RuntimeError("device-side assert")

    repeats = repeat_here(first, raises, 1)
    assert repeats.runs[1].raised == "RuntimeError: device-side assert"
    assert repeats.disagreement().item == repeats.runs[0].items[0][0]
    assert verdicts.decide(first, [], repeats=repeats).name == verdicts.VerdictName.NONDETERMINISTIC


def test_only_a_divergence_becomes_nondeterministic(recorded):
    """A step within the platform's bounds stays `platform_difference` whatever its repeats gave."""
    step, observed = recorded
    moved = step.outputs.hidden_states.clone()
    moved[0, 0] = moved[0, 0] * (1 + 1e-7)
    first = check_step(observed(hidden_states=moved), step)
    repeats = Repeats([Run.of(HERE, first), Run.of(HERE, check_step(observed(), step))])
    assert repeats.disagreement().item == "hidden_states"
    verdict = verdicts.decide(first, ["cpu_isa"], repeats=repeats)
    assert verdict.name == verdicts.VerdictName.PLATFORM_DIFFERENCE, verdict


def test_runs_survive_the_fresh_process_round_trip(recorded):
    step, observed = recorded
    run = Run.of(HERE, check_step(observed(sampled_token_ids=_drawn_otherwise(step, 1, 1)), step))
    assert Run.from_plain(run.to_plain()) == run and run.first_divergence == "sampled_token_ids"


def test_the_digest_of_what_a_replay_produced_tells_every_bit(recorded):
    step, _ = recorded
    hidden = step.outputs.hidden_states
    flipped = hidden.clone()
    flipped.view(-1)[7] = flipped.view(-1)[7].nextafter(flipped.view(-1)[7] + 1)
    assert replayed_digest(hidden) == replayed_digest(hidden.clone())
    assert replayed_digest(hidden) != replayed_digest(flipped)
    assert replayed_digest(hidden) != replayed_digest(hidden.double())  # the dtype is part of it
    assert replayed_digest({"a": [1, 2]}) != replayed_digest({"a": [2, 1]}) and replayed_digest(None) is None


def test_the_heap_perturbation_fills_the_memory_a_new_cpu_tensor_gets_and_is_off_after():
    """torch takes a CPU tensor's memory from glibc (`posix_memalign`): under the perturbation an
    uninitialised tensor holds the byte's complement (small `malloc`s served from glibc's
    per-thread cache are not perturbed; tensors are not served from it)."""
    import torch

    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc: the repeats run without heap perturbation")
    seen = []
    for byte in (0x55, 0xAA):
        with heap_perturbed(byte):
            seen.append([set(torch.empty(size, dtype=torch.uint8).tolist()) for size in (16, 1000, 100_000)])
    assert seen == [[{0xAA}] * 3, [{0x55}] * 3]
    after = [torch.empty(1000, dtype=torch.uint8) for _ in range(4)]
    assert any(set(tensor.tolist()) != {0x55} for tensor in after)  # off again: leftovers, not the fill


def test_a_suite_holding_a_nondeterministic_step_exits_6_unless_one_diverged():
    assert worst_exit_code([0, 4, 6, 2]) == EXIT_NONDETERMINISTIC
    assert worst_exit_code([6, 1, 0]) == EXIT_NOT_REPRODUCED
