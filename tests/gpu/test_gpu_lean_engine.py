"""Issue 20, part 3 on the GPU: a single-bundle replay captures only the CUDA graph its step was
dispatched to (with `--mode all`, which times vLLM's PIECEWISE graph of the step's size too, both
graph modes of that size), and replays the step bit-exact,
as the engine vLLM builds (`--full-engine`) does; on V1 and Model Runner V2, for a FULL-graph
decode step and a PIECEWISE mixed step.

Run on the GPU machine: `bash tools/gpu_run.sh -k lean_engine`.
"""

import json

import pytest
from gpu_support import GRAPHS, bundles_by_step, json_records, of_kind, read_step, record_steps, tracekit

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["v1", "v2"])
def graph_steps(request, tmp_path_factory, prompts_file):
    """(runner, {"FULL": bundle, "PIECEWISE": bundle}): a decode step and a mixed step of the
    GPU workload, recorded bf16 with graphs."""
    runner = request.param
    folder = tmp_path_factory.mktemp(f"lean-{runner}")
    bundles = bundles_by_step(record_steps(folder, prompts_file, "0:40", 8, ["--dtype", "bfloat16", *GRAPHS], runner))
    chosen = {}
    for kind, mode in (("pure_decode", "FULL"), ("mixed", "PIECEWISE")):
        found = [path for path in of_kind(bundles, kind).values() if read_step(path).graph.runtime_mode == mode]
        assert found, f"the workload has no {kind} step dispatched to a {mode} graph"
        chosen[mode] = found[0]
    return runner, chosen


def replay(bundle_paths, out, runner, *flags):
    finished = tracekit("replay", *bundle_paths, "--no-timing", "--keep-going", "--json", out, *flags, runner=runner)
    assert finished.returncode == 0, finished.explain()
    return json_records(out), finished


def assert_bit_exact(record):
    # Padding rows of a graph step are not the step's (their inputs are whatever the runner's
    # buffers held): compared apart, they do not decide.
    diverged = [check for check in record["checks"] if not check["bit_exact"] and check.get("decides", True)]
    assert record["bit_exact"] and not diverged, f"{record['bundle']} diverged: {diverged}"


def test_lean_replay_captures_only_the_step_graph_and_matches_the_full_engine(graph_steps, tmp_path):
    runner, chosen = graph_steps
    full, _ = replay([str(path) for path in chosen.values()], tmp_path / "full.jsonl", runner, "--full-engine")
    for mode, bundle in chosen.items():
        step = read_step(bundle)
        size = step.graph.num_tokens_padded
        lean, finished = replay([str(bundle)], tmp_path / f"lean-{mode}.jsonl", runner)
        record, reference = lean[str(bundle)], full[str(bundle)]
        assert_bit_exact(record)
        assert_bit_exact(reference)
        assert record["dispatch"]["replayed"] == reference["dispatch"]["replayed"]
        assert record["dispatch"]["replayed"]["runtime_mode"] == mode
        build = record["engine_build"]
        assert build["kind"] == "lean" and build["graphs_captured"] == [[mode, size]], build
        assert reference["engine_build"]["kind"] == "full"
        assert f"captured {mode} {size}" in finished.stdout
        assert build["seconds"] < reference["engine_build"]["seconds"], (build, reference["engine_build"])


def test_mode_all_captures_both_graph_modes_of_the_step_size(graph_steps, tmp_path):
    runner, chosen = graph_steps
    bundle = chosen["FULL"]
    size = read_step(bundle).graph.num_tokens_padded
    out = tmp_path / "all.jsonl"
    finished = tracekit("replay", bundle, "--mode", "all", "--iters", 2, "--samples", 2, "--json", out, runner=runner)
    assert finished.returncode == 0, finished.explain()
    record = json.loads(out.read_text().splitlines()[0])
    assert_bit_exact(record)
    assert record["engine_build"]["graphs_captured"] == [["FULL", size], ["PIECEWISE", size]], record["engine_build"]


def test_a_lean_suite_engine_captures_the_graphs_of_all_its_steps(graph_steps, tmp_path):
    runner, chosen = graph_steps
    bundles = [str(path) for path in chosen.values()]
    records, _ = replay(bundles, tmp_path / "suite.jsonl", runner)
    wanted = sorted([mode, read_step(path).graph.num_tokens_padded] for mode, path in chosen.items())
    for bundle in bundles:
        assert_bit_exact(records[bundle])
        assert records[bundle]["dispatch"]["replayed"]["runtime_mode"] == records[bundle]["dispatch"]["recorded"]["runtime_mode"]
    assert records[bundles[0]]["engine_build"]["graphs_captured"] == wanted
    assert records[bundles[1]]["engine_build"]["built_for_this_step"] is False

