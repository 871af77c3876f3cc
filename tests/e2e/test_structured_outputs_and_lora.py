"""Issue 31: steps with structured outputs (JSON schema, choice, regex) and LoRA adapters, recorded
from a live V1 engine and replayed bit-exact in a fresh process, the grammar mask checked row
for row; negative controls that must be caught and named.

One engine records every step of two batches: a short one on one adapter, then grammar requests
(greedy and seeded), requests on two adapters and one without, a prompt long enough to be
prefilled in chunks before it samples under its grammar. vLLM 0.32's CPU LoRA kernels give a request without an adapter the adapter of the
last slot (`lora_adapters.py`): the replay reproduces that only by putting each adapter back into
its recorded slot, which the slot-swapping control shows, and by emptying the slots the
recording had empty (an earlier replayed step may have filled them)."""

import json
import shutil

import pytest
from e2e_support import assert_replayed_bit_exact, engine_script, error_lines, read_step, tracekit
from features_support import (
    checks_by_item,
    clear_first_allowed_bit,
    drop_adapter_files,
    flip_one_allowed_token,
    grammar_kinds,
    make_adapter,
    record_features,
    replay_records,
    swap_lora_slots,
)

from tracekit.format.rewrite import rewrite_bundle
from tracekit.integrations.vllm.records.weights import adapter_fingerprint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("grammar-lora")


@pytest.fixture(scope="module")
def adapters(work):
    return {"a": make_adapter(work / "adapter-a", seed=1), "b": make_adapter(work / "adapter-b", seed=2)}


@pytest.fixture(scope="module")
def recorded(work, adapters):
    return record_features(work, "grammar_lora", adapters["a"], adapters["b"])[1]


@pytest.fixture(scope="module")
def replays(work, recorded):
    return engine_script("replay_many", work / "replays.json", *recorded.values())


def test_every_step_replays_bit_exact_its_grammar_mask_checked(recorded, replays):
    assert_replayed_bit_exact(replays, recorded)
    masked = {index: path for index, path in recorded.items() if read_step(path).grammar is not None}
    assert masked, "no step sampled under a grammar"
    for index, path in masked.items():
        checks = checks_by_item(replays["replays"][str(path)])
        assert checks["grammar_bitmask"]["bit_exact"], f"step {index}: {checks['grammar_bitmask']}"
    assert set().union(*map(grammar_kinds, masked.values())) == {"json", "grammar", "regex"}  # grammar: the choice
    # The chunked prompt's grammar request reaches the mask only once its prefill is done.
    chunked = [read_step(path) for path in recorded.values()
               if any(r.sampling_params.structured_outputs and not r.samples for r in read_step(path).requests)]
    assert chunked and all(len(step.grammar.request_ids) < len(step.features["structured_outputs"]) for step in chunked)


def test_grammar_rows_follow_the_scheduler_and_cover_each_sampled_position(recorded):
    for path in recorded.values():
        grammar = read_step(path).grammar
        if grammar is not None:
            assert grammar.rows_per_request == [1] * len(grammar.request_ids)  # no drafts in this workload
            assert grammar.num_acceptable_drafts == [0] * len(grammar.request_ids)


def test_lora_steps_keep_every_resident_adapter_with_its_slot_and_fingerprint(recorded, adapters):
    fingerprints = {name: adapter_fingerprint(folder) for name, folder in adapters.items()}
    beside = 0
    for path in recorded.values():
        step = read_step(path)
        resident = {adapter.name: adapter for adapter in step.lora_adapters}
        used = {request.lora_adapter for request in step.requests} - {None}
        assert used <= set(resident) and len({adapter.slot for adapter in resident.values()}) == len(resident)
        for name, adapter in resident.items():
            assert adapter.fingerprint == fingerprints[name] and adapter.rank == 8
            assert set(adapter.files) == {"adapter_config.json", "adapter_model.safetensors"}
        beside += {"a", "b", None} <= {request.lora_adapter for request in step.requests}
    assert beside, "no step ran requests on both adapters beside one without"


def test_negative_controls_are_caught_and_named(recorded, adapters, work, tmp_path):
    """One replay engine for three edits of real recordings: the two adapters' slots swapped (only
    the request without an adapter moves: it reads the last slot), the adapters' files dropped
    from the bundle, found elsewhere through --lora (bit-exact), and last a flipped mask bit (the
    grammar item names the row and token, and nothing before it differs)."""
    masked = next(path for path in recorded.values() if read_step(path).grammar is not None
                  and len(read_step(path).lora_adapters) == 1 and None in {r.lora_adapter for r in read_step(path).requests})
    beside = next(path for path in recorded.values()
                  if {"a", "b", None} <= {request.lora_adapter for request in read_step(path).requests})
    flipped = rewrite_bundle(masked, tmp_path / "flipped.zst", flip_one_allowed_token)
    swapped = rewrite_bundle(beside, tmp_path / "swapped.zst", swap_lora_slots)
    unkept = rewrite_bundle(beside, tmp_path / "unkept.zst", drop_adapter_files)
    elsewhere = {name: shutil.copytree(folder, tmp_path / f"elsewhere-{name}") for name, folder in adapters.items()}
    # The masked step (one adapter resident, a request without one reading the empty slot) after
    # two with both: the slot it had empty must not keep the adapter the steps before left there.
    finished, records = replay_records(tmp_path, "controls", swapped, unkept, flipped, "--no-timing", "--keep-going",
                                       *[f"--lora={name}={folder}" for name, folder in elsewhere.items()])
    assert finished.returncode == 1, finished.explain()

    grammar = checks_by_item(records["flipped.zst"])["grammar_bitmask"]
    assert records["flipped.zst"]["first_divergence"] == "grammar_bitmask"
    (row,) = grammar["differing_mask_rows"]
    step = read_step(flipped)
    assert row["req_id"] == step.grammar.request_ids[0] and row["position"] == 0
    assert row["tokens_only_recorded"] == [step.extras["test_flipped_token"]]
    assert row["allowed_only_recorded"] == 1 and row["allowed_only_here"] == 0

    swapped_checks = checks_by_item(records["swapped.zst"])
    without_adapter = [request.req_id for request in read_step(beside).requests if request.lora_adapter is None]
    assert set(swapped_checks["hidden_states"]["requests_moved"]) == set(without_adapter)

    assert records["unkept.zst"]["verdict"] == "bit_exact", records["unkept.zst"]


def test_adapter_not_kept_and_not_found_or_not_the_recorded_one_exits_3_before_any_engine(recorded, adapters,
                                                                                          tmp_path):
    path = next(iter(recorded.values()))
    unkept = rewrite_bundle(path, tmp_path / "unkept.zst", drop_adapter_files)

    def moved(metadata, tensors):
        drop_adapter_files(metadata, tensors)
        for adapter in metadata["steps"][0]["lora_adapters"]:
            adapter["path"] = str(tmp_path / "gone" / adapter["name"])

    gone = rewrite_bundle(path, tmp_path / "gone.zst", moved)
    finished, records = replay_records(tmp_path, "gone", gone, "--no-timing")
    assert finished.returncode == 3, finished.explain()
    (line,) = error_lines(finished.stderr)
    assert "is not in the bundle" in line and "--lora" in line and records["gone.zst"]["engine"] is None

    changed = tmp_path / "changed-a"
    shutil.copytree(adapters["a"], changed)
    weights = changed / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    finished, records = replay_records(tmp_path, "changed", unkept, "--no-timing", f"--lora=a={changed}")
    assert finished.returncode == 3, finished.explain()
    assert "differs from the recorded one" in error_lines(finished.stderr)[0]


WINDOW = 6  # record_features.py's grammar_lora_window


def _window_records(work, name, *args):
    """`tracekit replay WINDOW --json`: the finished process and each step's record, by step."""
    out = work / f"{name}.jsonl"
    finished = tracekit("replay", *args, "--no-timing", "--json", out)
    return finished, {record["step"]: record for record in map(json.loads, out.read_text().splitlines())}


def test_a_window_of_grammar_and_lora_steps_replays_bit_exact_and_a_later_steps_mask_goes_back(work, adapters,
                                                                                              tmp_path):
    """Issues 31 and 32 together: a window whose later steps sample under grammars and run on two
    adapters replays bit-exact with the runner carrying its state, each step's mask checked; a bit
    cleared in a later step's recorded mask makes that step, and no step before it, part at its
    grammar item (the later step's mask is what its sampling gets back)."""
    _, bundles = record_features(work, "grammar_lora_window", adapters["a"], adapters["b"])
    (window,) = bundles.values()
    first = read_step(window)
    assert len(first.window_indices) == WINDOW and first.lora_adapters
    added_later = [new.lora_request.lora_name for carried in first.window.steps
                   for new in carried.scheduler_output.scheduled_new_reqs if new.lora_request]
    assert {request.lora_adapter for request in first.requests} | set(added_later) >= {"a", "b"}
    masked = [position for position, carried in enumerate(first.window.steps) if carried.grammar is not None]
    assert masked, "no later step of the window sampled under a grammar"

    finished, steps = _window_records(tmp_path, "clean", window)
    assert finished.returncode == 0, finished.explain()
    assert sorted(steps) == first.window_indices
    for index, record in steps.items():
        assert record["verdict"] == "bit_exact", (index, record["verdict"], record["first_divergence"])
        assert record["window"]["state"] == ("rebuilt" if index == first.index else "carried")
    for position in masked:
        check = checks_by_item(steps[first.window.steps[position].index])["grammar_bitmask"]
        assert check["bit_exact"], check

    position = masked[0]
    target = first.window.steps[position].index

    def cleared(metadata, tensors):
        clear_first_allowed_bit(tensors[f"steps/0/window/steps/{position}/grammar/bitmask"])

    edited = rewrite_bundle(window, tmp_path / "cleared.zst", cleared)
    finished, steps = _window_records(tmp_path, "cleared", edited)
    assert finished.returncode == 1, finished.explain()
    assert steps[target]["window"]["first_divergence"] == f"step {target}/grammar_bitmask"
    (row,) = checks_by_item(steps[target])["grammar_bitmask"]["differing_mask_rows"]
    assert row["position"] == 0 and len(row["tokens_only_recorded"]) == 1
    assert all(record["bit_exact"] for index, record in steps.items() if index < target)
