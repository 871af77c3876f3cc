"""Replay across releases on the H200 (issue 30): steps recorded under one vLLM release (0.26 or
0.34) replay under the other with the verdict the pair of releases gives.

Each release's run records the built-in workload, greedily (so that only the forward can part
the two releases, not their samplers), on Model Runner V2 in bf16 with CUDA graphs, and leaves
three of its steps — step 0, the first mixed (PIECEWISE) step, the first FULL-graph decode step —
in `$TRACEKIT_GPU_ACROSS_RELEASES_OUT/vllm-X.Y/` (`tools/gpu_run.sh` brings them back, in
`$OUT/vllm-X.Y/across-releases/`). Committed to `traces/h200-vllmXYZ-greedy/`, the other release's
run replays them. The verdict is derived, not assumed: step 0 has the same inputs in both releases
(prompts, seeds, an empty KV cache), so whether this release's own step 0 equals the other's bit
for bit decides it: every step bit-exact if so, else `release_difference` (float rounding only)
for each.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gpu_support import (
    GRAPHS,
    INSTALLED_SERIES,
    bundles_by_step,
    json_records,
    of_kind,
    read_step,
    record_steps,
    tracekit,
)

from tracekit.format.content import load_step

TRACES = Path(__file__).resolve().parents[2] / "traces"
RUNNER = "v2"  # the one runner both releases have


def fixture_sets() -> dict[str, Path]:
    """Committed steps of other releases, by series: traces/h200-vllmXYZ-greedy/."""
    found = {}
    for folder in sorted(TRACES.glob("h200-vllm*-greedy")):
        digits = folder.name.removeprefix("h200-vllm").removesuffix("-greedy")
        found[f"{digits[0]}.{digits[1:]}"] = folder
    return found


@pytest.fixture(scope="module")
def greedy_steps(tmp_path_factory):
    """This release's greedy workload, recorded step by step; three of its steps left for the
    other release's run."""
    from tracekit.record.workload import BUILTIN_WORKLOAD

    folder = tmp_path_factory.mktemp("across-releases")
    prompts = folder / "greedy.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": r.prompt, **{k: v for k, v in r.sampling.items() if k != "seed"}, "temperature": 0.0}) + "\n"
        for r in BUILTIN_WORKLOAD))
    bundles = bundles_by_step(record_steps(folder, prompts, "0:40", 8, ["--dtype", "bfloat16", *GRAPHS], RUNNER))
    decodes = [path for path in of_kind(bundles, "pure_decode").values() if read_step(path).graph.runtime_mode == "FULL"]
    chosen = {"step0": bundles[0], "mixed": next(iter(of_kind(bundles, "mixed").values())), "full_decode": decodes[0]}
    out = os.environ.get("TRACEKIT_GPU_ACROSS_RELEASES_OUT")
    if out:
        target = Path(out) / f"vllm-{INSTALLED_SERIES}"
        target.mkdir(parents=True, exist_ok=True)
        for name, path in chosen.items():
            shutil.copy(path, target / f"{name}.zst")
    return chosen


def forward_equal(ours: Path, theirs: Path) -> bool:
    (_, a), (_, b) = load_step(ours, None), load_step(theirs, None)
    assert torch.equal(a.input_ids, b.input_ids), "step 0 of the two releases had other inputs"
    return torch.equal(a.outputs.hidden_states, b.outputs.hidden_states) and torch.equal(
        a.outputs.logits, b.outputs.logits)


@pytest.mark.parametrize("series", sorted(set(fixture_sets()) - {INSTALLED_SERIES}) or ["none"])
def test_steps_of_another_release_replay_here_with_the_verdict_the_pair_gives(series, greedy_steps, tmp_path):
    if series == "none":
        pytest.skip(f"no steps of another release in traces/ yet: commit the other release's "
                    f"$OUT/vllm-X.Y/across-releases/*.zst to traces/h200-vllmXYZ-greedy/ (this run left vLLM "
                    f"{INSTALLED_SERIES}'s)")
    folder = fixture_sets()[series]
    expected = "bit_exact" if forward_equal(greedy_steps["step0"], folder / "step0.zst") else "release_difference"
    out = tmp_path / "replays.jsonl"
    steps = [folder / f"{name}.zst" for name in ("step0", "mixed", "full_decode")]
    finished = tracekit("replay", *steps, "--keep-going", "--no-timing", "--json", out, runner=RUNNER)
    records = json_records(out) if out.exists() else {}
    assert len(records) == len(steps), finished.explain()
    for path in steps:
        record = records[str(path)]
        print(f"{series} -> {INSTALLED_SERIES} {path.name}: {record['verdict']} ({record.get('verdict_reason')})")
        assert record["verdict"] == expected, (path.name, record["verdict"], record.get("verdict_reason"))
        assert record["releases"]["here"].startswith(INSTALLED_SERIES + ".")
        assert not [line for line in record["dispatch"]["differences"] if line.startswith("runtime_mode")], record
    assert "Traceback" not in finished.stderr


def test_this_releases_steps_are_left_for_the_other_release(greedy_steps):
    assert read_step(greedy_steps["full_decode"]).graph.runtime_mode == "FULL"
    assert read_step(greedy_steps["mixed"]).graph.runtime_mode == "PIECEWISE"
    if not os.environ.get("TRACEKIT_GPU_ACROSS_RELEASES_OUT"):
        pytest.skip("TRACEKIT_GPU_ACROSS_RELEASES_OUT is not set (tools/gpu_run.sh sets it): nothing left")
