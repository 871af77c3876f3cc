"""Issue 20: `--on exception,nonfinite` left on costs a mark per step, not a copy; the step that
fails is copied from what it left in the live engine, and replays with the right verdict.
(The injected faults of each phase: `test_record_triggers_and_errors.py`, a real vLLM bug:
`test_record_crash_in_sampling.py`, a real CUDA error: `tests/gpu/test_gpu_always_on.py`.)"""

import json

import pytest
import torch
from e2e_support import engine_script, tracekit

from tracekit.format.content import load_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def always_on(tmp_path_factory, runner_kind):
    work = tmp_path_factory.mktemp(f"always-on-{runner_kind}")
    return engine_script("always_on", work / "result.json", work, runner=runner_kind)


def test_armed_and_quiet_it_writes_nothing_and_changes_no_token(always_on):
    assert always_on["quiet_outputs"] == always_on["unarmed"] == always_on["reference_outputs"]
    assert always_on["quiet_written"] == [] and always_on["quiet_failures"] == []


def test_a_nan_from_the_kv_read_is_caught_and_its_bundle_holds_that_kv(always_on):
    """The step's outputs went NaN because a block it read was; the bundle, copied at the end of
    the step rather than before it, holds that block as the forward read it, and everything else
    as the usual pre-forward copy of the same step does."""
    assert always_on["kv_nan_failures"] == []
    (path,) = always_on["kv_nan_written"]
    _, step = load_step(path, None)
    _, reference = load_step(always_on["reference"], None)
    assert step.index == reference.index == always_on["step"] and step.trigger == "nonfinite"
    assert step.outputs.finite is False and step.kv.taken == "after_step" and step.kv.mode == "read"
    assert always_on["kv_nan_block_is_nan"]
    assert [without_blocks(r) for r in step.requests] == [without_blocks(r) for r in reference.requests]
    assert torch.equal(step.input_ids, reference.input_ids) and torch.equal(step.positions, reference.positions)
    assert step.rng.keys() == reference.rng.keys()
    # block ids differ from run to run: each block of the step against the same request's block
    # of the reference run
    same_block = {mine: theirs for request, other in zip(step.requests, reference.requests)
                  for mine, theirs in zip(request.block_ids[0], other.block_ids[0])}
    (group,), (expected,) = step.kv.groups, reference.kv.groups
    assert sorted(same_block[block] for block in group.saved_block_ids) == expected.saved_block_ids
    untouched = [block for block in group.saved_block_ids
                 if block not in group.written_block_ids and block != always_on["poisoned_block"]]
    assert untouched, "the step read no block it did not write"
    dim = group.layout.block_dim
    for layer, tensor in group.before.items():
        for block in untouched:
            mine = tensor.select(dim, group.saved_block_ids.index(block))
            theirs = expected.before[layer].select(dim, expected.saved_block_ids.index(same_block[block]))
            assert torch.equal(mine, theirs), (layer, block)


def test_the_nan_step_replays_bit_exact(always_on):
    result = always_on["kv_nan_replay"]
    assert result["verdict"] == "bit_exact", result
    assert result["kv"] == "restored"


def test_a_recompute_bundle_rebuilds_the_kv_by_prefilling_and_says_so(always_on):
    (path,) = always_on["recompute_written"]
    _, step = load_step(path, None)
    assert step.kv.mode == "recompute" and all(not group.before and not group.saved_block_ids for group in step.kv.groups)
    result = always_on["recompute_replay"]
    assert result["kv"] == "recomputed" and "KV recomputed, not restored" in result["verdict_reason"], result
    assert any("KV recomputed, not restored" in note for note in result["notes"])
    # on the recording's own CPU, the prefill writes the same KV the steps did
    assert result["verdict"] == "bit_exact", result


def test_a_lost_device_context_leaves_a_bundle_from_host_memory(always_on, tmp_path):
    """A failure that poisons the device context leaves nothing on the device to read: the step
    is kept without KV or inputs, and its replay prefills the recorded tokens instead."""
    assert always_on["lost_raised"] == f"RuntimeError: {always_on['lost_context']}"
    assert always_on["lost_failures"] == []
    (path,) = always_on["lost_written"]
    _, step = load_step(path, None)
    _, reference = load_step(always_on["reference"], None)
    assert step.trigger == "exception" and step.error["message"] == always_on["lost_context"]
    assert step.kv.mode == "recompute" and step.input_ids is None and step.outputs is None
    assert [without_blocks(r) for r in step.requests] == [without_blocks(r) for r in reference.requests]
    out = tmp_path / "replay.json"
    finished = tracekit("replay", path, "--no-timing", "--json", out, runner=step_runner(path))
    record = json.loads(out.read_text())
    # the fault was injected in the recording process only: the replayed step does not raise
    assert finished.returncode == 1 and record["verdict"] == "error_not_reproduced", finished.explain()
    assert record["kv"] == "recomputed" and "KV recomputed, not restored" in record["verdict_reason"]


def without_blocks(request):
    """A request's recorded state but its id and block ids (another run's request of the same
    prompt has another id, and other blocks), its token limit (the NaN run stops at the poisoned
    step), and the seed V2 drew for it if it had none."""
    plain = request.to_plain()
    plain.pop("block_ids"), plain.pop("req_id")
    (plain.get("sampling_params") or {}).pop("max_tokens", None)
    plain["runner_state"] = {key: value.tolist() if isinstance(value, torch.Tensor) else value
                             for key, value in plain["runner_state"].items()}
    if (plain.get("sampling_params") or {}).get("seed") is None:
        plain["runner_state"].pop("seed", None)  # V2 draws one for an unseeded request, each run its own
    return plain


def step_runner(path):
    from tracekit.format import open_bundle
    from tracekit.format.schema import BundleContent

    with open_bundle(path) as reader:
        return BundleContent.from_plain(reader.metadata).engine.runner
