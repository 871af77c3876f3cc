"""Issue 32 on a GPU (vLLM 0.26): 8-step windows recorded under Model Runner V2 and under V1 with
async scheduling, both with CUDA graphs (FULL_AND_PIECEWISE), and replayed in a fresh process
with the runner carrying its own state step after step: every step bit-exact, dispatched to the
graph it was recorded in, and the engine's overlap of steps (a step's output read after the next
step ran) kept in the recorded call order and followed by the replay. `--from` a later step
rebuilds the state there and is bit-exact too. With the tiny EAGLE drafter (V2, and V1 async):
each later step verifies the drafts the runner proposed in the step before, and its drafts,
acceptances and proposals are checked.

    bash tools/gpu_run.sh -k window
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpu_support import CONFIGS, HAS_V1, TINY_EAGLE, read_content, speculative_args, tracekit

# vLLM's GPU defaults for V2, and V1 with async scheduling (its default too) and graphs; the same
# with EAGLE drafting.
WINDOW_CONFIGS = {
    "v2-bf16-graphs": CONFIGS["v2-bf16-graphs"],
    "v1-bf16-graphs": CONFIGS["v1-bf16-graphs"],
    "v2-eagle-bf16-graphs": ("v2", [*CONFIGS["v2-bf16-graphs"][1], *speculative_args("v2", TINY_EAGLE)]),
    "v1-eagle-bf16-graphs": ("v1", [*CONFIGS["v1-bf16-graphs"][1], *speculative_args("v1", TINY_EAGLE)]),
}
FIRST, LENGTH = 2, 8  # steps 2..9: the long prompt's chunks beside decodes, then decodes alone
CORE_ITEMS = {"batch_order", "input_ids", "positions", "hidden_states", "logits", "sampled_token_ids"}
# A later step of a drafting window: the drafts it verified, what was accepted, what it proposed
DRAFTING_ITEMS = {"spec_decode/drafts", "spec_decode/accepted", "spec_decode/proposals"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module", params=sorted(WINDOW_CONFIGS))
def window(request, tmp_path_factory, prompts_file):
    name = request.param
    runner, args = WINDOW_CONFIGS[name]
    if runner == "v1" and not HAS_V1:
        pytest.skip("this vLLM release has no Model Runner V1")
    folder = tmp_path_factory.mktemp(f"window-{name}")
    bundle = folder / "window.zst"
    record = tracekit("record", "-o", bundle, "--steps", FIRST, "--window", LENGTH, "--prompts", prompts_file,
                      "--max-tokens", 10, *args, runner=runner)
    assert record.returncode == 0, record.explain()
    replay = tracekit("replay", bundle, "--json", folder / "window.jsonl", runner=runner)
    rebuilt = tracekit("replay", bundle, "--from", FIRST + LENGTH // 2, "--json", folder / "from.jsonl", runner=runner)
    return SimpleNamespace(name=name, bundle=bundle, record=record, replay=replay, rebuilt=rebuilt,
                           records=_records(folder / "window.jsonl"), rebuilt_records=_records(folder / "from.jsonl"))


def test_the_window_holds_eight_steps_and_the_engines_overlap_of_them(window):
    first = read_content(window.bundle).steps[0]
    assert first.window_indices == list(range(FIRST, FIRST + LENGTH)), window.name
    calls = [(call["call"], call["step"]) for call in first.window.calls]
    # async scheduling: some step's output is read after the next step was executed
    assert any(calls.index(("output", index)) > calls.index(("execute", index + 1))
               for index in range(FIRST, FIRST + LENGTH - 1)), calls
    modes = {carried.graph.runtime_mode for carried in first.window.steps}
    assert modes & {"FULL", "PIECEWISE"}, modes


def test_every_step_of_the_window_replays_bit_exact_in_its_graph(window):
    assert window.replay.returncode == 0, window.replay.explain()
    assert [record["step"] for record in window.records] == list(range(FIRST, FIRST + LENGTH))
    for record in window.records:
        items = {check["item"] for check in record["checks"]}
        assert CORE_ITEMS <= items, (record["step"], items)
        if record["step"] > FIRST:  # a later step checks the KV it wrote (FlashAttention's layout is known)
            assert "kv_written" in items, (record["step"], items)
        if "eagle" in window.name and record["step"] > FIRST:
            assert DRAFTING_ITEMS <= items, (record["step"], items)
        # where a step parts: the KV it read (computed bit-exact, it parts in itself; or by a parted
        # step), and what Inductor's kernels had to do with it
        assert record["verdict"] == "bit_exact", (window.name, record["step"], record.get("verdict_reason"),
                                                  record["window"].get("kv_sources"), record.get("notes"))
        assert not record["dispatch"].get("differences"), (record["step"], record["dispatch"])
        assert record["window"]["state"] == ("rebuilt" if record["step"] == FIRST else "carried")
    assert window.records[0]["window"]["verdict"] == "bit_exact"


def test_from_a_later_step_the_window_replays_bit_exact(window):
    assert window.rebuilt.returncode == 0, window.rebuilt.explain()
    later = FIRST + LENGTH // 2
    assert window.rebuilt_records and window.rebuilt_records[0]["window"]["rebuilt"] == [FIRST, later]
    for record in window.rebuilt_records:
        assert record["verdict"] == "bit_exact", (window.name, record["step"], record.get("verdict_reason"),
                                                  record["window"].get("kv_sources"), record.get("notes"))
