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
from types import SimpleNamespace

import pytest
import torch
from gpu_support import (
    GRAPHS,
    INSTALLED_SERIES,
    MTP,
    bundles_by_step,
    checks_of,
    json_records,
    of_kind,
    read_step,
    record_steps,
    speculative_args,
    tiny_mtp_target,
    tracekit,
)

from tracekit.format.content import load_step

TRACES = Path(__file__).resolve().parents[2] / "traces"
RUNNER = "v2"  # the one runner both releases have


def committed_sets(kind: str) -> dict[str, Path]:
    """Committed steps of releases, by series: traces/h200-vllmXYZ-KIND/."""
    found = {}
    for folder in sorted(TRACES.glob(f"h200-vllm*-{kind}")):
        digits = folder.name.removeprefix("h200-vllm").removesuffix(f"-{kind}")
        found[f"{digits[0]}.{digits[1:]}"] = folder
    return found


def fixture_sets() -> dict[str, Path]:
    """Committed greedy steps of releases, by series: traces/h200-vllmXYZ-greedy/."""
    return committed_sets("greedy")


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
    leave_for_the_other_release(chosen, f"vllm-{INSTALLED_SERIES}")
    return chosen


def leave_for_the_other_release(chosen: dict[str, Path], folder: str) -> None:
    """`chosen` steps, by name, in `$TRACEKIT_GPU_ACROSS_RELEASES_OUT/folder/` (tools/gpu_run.sh
    brings them back)."""
    out = os.environ.get("TRACEKIT_GPU_ACROSS_RELEASES_OUT")
    if out:
        target = Path(out) / folder
        target.mkdir(parents=True, exist_ok=True)
        for name, path in chosen.items():
            shutil.copy(path, target / f"{name}.zst")


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


# -- drafted steps (MTP) across releases --------------------------------------------------------
# vLLM 0.34's scheduler tells the drafter to skip proposing where no scheduled request can use the
# drafts (`skip_drafts`: every request reaching max_tokens, a prefill chunk that is not the last):
# such a step records every proposal -1. 0.26 has no such order and proposes: its proposals are
# reported as not compared (`Release.drafter_orders_dropped`), the rest of the step decides.
DRAFTED_STEPS, DRAFTED_MAX_TOKENS = "0:40", 12
# Another release's drafted steps recorded earlier in this device call (tools/gpu_lanes.sh, a lane
# run after the one that recorded them): the folder its `TRACEKIT_GPU_ACROSS_RELEASES_OUT` was.
ACROSS_FROM = os.environ.get("TRACEKIT_GPU_ACROSS_RELEASES_FROM")


def drafted_sets() -> dict[str, Path]:
    """Other releases' drafted steps, by series: recorded earlier on this machine, or committed
    to traces/h200-vllmXYZ-drafted/."""
    found = committed_sets("drafted")
    for folder in sorted(Path(ACROSS_FROM).glob("vllm-*-drafted")) if ACROSS_FROM else []:
        found[folder.name.removeprefix("vllm-").removesuffix("-drafted")] = folder
    return found


def skipped_drafts(path: Path) -> bool:
    return read_step(path).scheduler_output.skip_drafts is True


def skips_drafts_here() -> bool:
    """Whether this vLLM's scheduler can tell its drafter to skip proposing (0.33 on)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return "skip_drafts" in SchedulerOutput.__dataclass_fields__


@pytest.fixture(scope="module")
def drafted_steps(tmp_path_factory):
    """This release's greedy workload with MTP drafting (V2, graphs, async), step by step; step 0,
    the first step that verified drafts and each step whose drafter was told to skip proposing
    left for the other release's run (`vllm-X.Y-drafted/`)."""
    folder = tmp_path_factory.mktemp("across-releases-drafted")
    prompts = folder / "greedy.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": list(range(3 + 7 * n, 3 + 7 * n + length)),
                                           "temperature": 0.0, "ignore_eos": True}) + "\n"
                               for n, length in enumerate((8, 16, 24, 40))))
    target = tiny_mtp_target(folder)  # real weights: dummy ones are drawn otherwise by 0.34
    bundles = bundles_by_step(record_steps(folder, prompts, DRAFTED_STEPS, DRAFTED_MAX_TOKENS,
                                           [*target, "--dtype", "bfloat16", *GRAPHS, *speculative_args(RUNNER, MTP)],
                                           RUNNER))
    verifying = [path for path in bundles.values() if any(r.draft_token_ids for r in read_step(path).requests)]
    assert verifying, "no step verified drafts"
    chosen = {"step0": bundles[0], "verifying": verifying[0],
              **{f"skipped{index}": path for index, path in bundles.items() if skipped_drafts(path)}}
    leave_for_the_other_release(chosen, f"vllm-{INSTALLED_SERIES}-drafted")
    return SimpleNamespace(steps=chosen, model=target[1])


def _model_here(bundle: Path, model: str) -> list[str]:
    """The tiny MTP checkpoint made here (`model`) as the target and drafter, where the recorded
    one is not on this machine (steps committed from another machine)."""
    args = load_step(bundle, None)[0].engine.engine_args
    if Path(str(args["model"])).exists():
        return []
    return ["--model", model, "--speculative-config", json.dumps({**args["speculative_config"], "model": model})]


@pytest.mark.parametrize("series", sorted(set(drafted_sets()) - {INSTALLED_SERIES}) or ["none"])
def test_drafted_steps_of_another_release_replay_here(series, drafted_steps, tmp_path):
    if series == "none":
        pytest.skip("no drafted steps of another release: run this after the other release's lane "
                    "(tools/gpu_lanes.sh NAME|RELEASE|run|drafted|AFTER), or commit them to traces/h200-vllmXYZ-drafted/")
    folder = drafted_sets()[series]
    expected = "bit_exact" if forward_equal(drafted_steps.steps["step0"], folder / "step0.zst") else "release_difference"
    steps = sorted(folder.glob("*.zst"))
    out = tmp_path / "replays.jsonl"
    finished = tracekit("replay", *steps, "--keep-going", "--no-timing", "--json", out,
                        *_model_here(steps[0], drafted_steps.model), runner=RUNNER)
    records = json_records(out) if out.exists() else {}
    assert len(records) == len(steps), finished.explain()
    skips_here = skips_drafts_here()
    for path in steps:
        record = records[str(path)]
        proposals = checks_of(record).get("spec_decode/proposals", {})
        print(f"{series} -> {INSTALLED_SERIES} {path.name}: {record['verdict']} ({record.get('verdict_reason')}); "
              f"proposals {proposals.get('why_not_deciding') or proposals.get('bit_exact')}")
        assert record["verdict"] == expected, (path.name, record["verdict"], record.get("first_divergence"))
        if skipped_drafts(path) and not skips_here:
            assert proposals.get("decides") is False and "skip_drafts=True" in proposals["why_not_deciding"], proposals
        elif proposals:
            assert proposals.get("decides", True), proposals
    assert "Traceback" not in finished.stderr


def test_a_drafter_told_to_skip_proposing_is_recorded_where_the_release_has_the_order(drafted_steps):
    if not skips_drafts_here():
        pytest.skip(f"vLLM {INSTALLED_SERIES} has no skip_drafts")
    skipped = [path for name, path in drafted_steps.steps.items() if name.startswith("skipped")]
    assert skipped, "no step of the drafted workload skipped proposing"
    for path in skipped:
        proposals = load_step(path, None)[1].spec_decode.proposals  # (read_step: metadata only)
        assert proposals is not None and bool((proposals == -1).all()), (path.name, proposals)

