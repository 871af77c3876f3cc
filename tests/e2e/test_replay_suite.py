"""Issue 13: `tracekit replay` with many bundles is a regression suite. Bundles that need the same
engine replay on one (counted from the JSON lines' `engine_built`), each gets one JSON line and
a summary row, the exit code is the worst verdict (diverged > bad input > cannot run here > ok),
and without --keep-going the suite stops at the first failure. `--profile` writes a Chrome trace
per bundle and timed mode."""

import importlib.util
import json

import pytest
from e2e_support import STEP_KINDS, only_on_runner, read_step, tracekit

from tracekit.format.rewrite import rewrite_bundle

# The suite's grouping, verdicts and traces do not depend on the model runner (each runner's
# replays are tested in test_replay_step_kinds): V1 only, the faster one.
pytestmark = [pytest.mark.slow, only_on_runner("v1")]

ITERS = 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def first_of_each_kind(bundles, kinds):
    return [next(p for p in bundles.values() if STEP_KINDS[kind](read_step(p))) for kind in kinds]


def json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def moved_model(source, target):
    """The same step as recorded on a machine that kept the same weights at another path."""
    def elsewhere(metadata, tensors):
        for name in ("model", "tokenizer"):
            metadata["engine"]["engine_args"][name] = "/elsewhere/tiny-llama"
        metadata["engine"]["model"]["path"] = "/elsewhere/tiny-llama"

    return rewrite_bundle(source, target, elsewhere)


def test_many_bundles_replay_on_one_engine_with_a_trace_each(builtin_bundles, tmp_path, runner_kind):
    chosen = first_of_each_kind(builtin_bundles, ["pure_prefill", "mixed", "pure_decode"])
    bundles = [*chosen, moved_model(chosen[1], tmp_path / "moved.zst")]
    out, traces, plot = tmp_path / "suite.jsonl", tmp_path / "traces", tmp_path / "suite.png"
    # (matplotlib is optional; tools/setup.sh installs it, so CI draws the plot)
    plotting = ["--plot", plot] if importlib.util.find_spec("matplotlib") else []
    finished = tracekit("replay", *bundles, "--iters", ITERS, "--samples", 1, "--json", out, "--profile", traces,
                        *plotting, runner=runner_kind)
    assert finished.returncode == 0, finished.explain()
    if plotting:
        assert plot.read_bytes().startswith(PNG_MAGIC)
    records = json_lines(out)
    assert [record["bundle"] for record in records] == [str(bundle) for bundle in bundles]
    assert {record["verdict"] for record in records} == {"bit_exact"}
    # One engine configuration (the moved copy names the same weights by their fingerprint): one build.
    assert [record["engine_built"] for record in records] == [True, False, False, False]
    assert {record["engine"] for record in records} == {1}
    assert "4 bundle(s) on 1 engine(s)" in finished.stdout and "all 4 bundle(s) reproduced" in finished.stdout
    for record in records:
        assert record["recorded_forward_us"] > 0 and record["forward_us"] > 0
        trace = record["modes"]["eager"]["profile_trace"]  # the reference mode of an eager recording
        events = json.loads(open(trace).read())["traceEvents"]
        ranges = [event for event in events if event.get("cat") == "user_annotation"]
        assert sum(event["name"].startswith("tracekit forward") for event in ranges) == ITERS
        assert any(event.get("cat") == "cpu_op" for event in events)
    assert len(list(traces.glob("*.trace.json"))) == len(bundles)


def test_worst_verdict_wins_and_keep_going_runs_every_bundle(builtin_bundles, tmp_path, runner_kind):
    good = first_of_each_kind(builtin_bundles, ["mixed"])[0]
    hidden_states = read_step(good).outputs.hidden_states["$tensor"]

    def nudge_recorded_hidden_states(metadata, tensors):
        tensors[hidden_states] = tensors[hidden_states] + 1e-3

    diverging = rewrite_bundle(good, tmp_path / "diverging.zst", nudge_recorded_hidden_states)
    damaged = tmp_path / "damaged.zst"
    damaged.write_bytes(good.read_bytes()[:-64])
    bundles = [damaged, diverging, good]

    out = tmp_path / "stop.jsonl"
    stopped = tracekit("replay", *bundles, "--no-timing", "--json", out, runner=runner_kind)
    assert stopped.returncode == 2, stopped.explain()  # the damaged bundle fails first, before any engine
    assert [record["verdict"] for record in json_lines(out)] == ["bad_input"]
    assert "2 bundle(s) not run" in stopped.stdout

    out = tmp_path / "all.jsonl"
    finished = tracekit("replay", *bundles, "--no-timing", "--keep-going", "--json", out, runner=runner_kind)
    assert finished.returncode == 1, finished.explain()  # diverged outranks bad input
    records = {record["bundle"]: record for record in json_lines(out)}
    assert records[str(damaged)]["verdict"] == "bad_input" and records[str(damaged)]["engine"] is None
    assert "damaged" in records[str(damaged)]["error"]
    assert records[str(diverging)]["verdict"] == "diverged"
    assert records[str(diverging)]["first_divergence"] == "hidden_states"
    assert records[str(good)]["verdict"] == "bit_exact"
    assert sum(record["engine_built"] for record in records.values()) == 1
    assert "2 of 3 bundle(s) failed (exit 1)" in finished.stdout
