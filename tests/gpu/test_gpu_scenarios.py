"""A prefix-cache hit and preemption-and-resume on a GPU (Model Runner V2, eager: the graphs are
not the point), recorded by the CPU suite's own scenario script and replayed in a fresh process."""

import sys

import pytest
from gpu_support import E2E, bundles_by_step, json_records, of_kind, run, tracekit


@pytest.fixture(scope="module", params=["prefix_cache", "preemption"])
def scenario(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(request.param)
    out = work / "steps"
    out.mkdir()
    recorded = run([sys.executable, str(E2E / "engine_scripts" / "record_scenario.py"), str(work / "result.json"),
                    str(out), request.param])
    assert recorded.returncode == 0, recorded.explain()
    replayed = tracekit("replay", out, "--keep-going", "--no-timing", "--json", work / "replays.jsonl")
    return request.param, bundles_by_step(out), json_records(work / "replays.jsonl"), replayed


def test_scenario_steps_replay_bit_exact(scenario):
    name, bundles, records, replayed = scenario
    kind = {"prefix_cache": "prefix_cache_hit", "preemption": "resumed_after_preemption"}[name]
    assert of_kind(bundles, kind), f"the {name} scenario produced no {kind} step"
    assert replayed.returncode == 0, replayed.explain()
    for path in bundles.values():
        assert records[str(path)]["verdict"] == "bit_exact", (path.name, records[str(path)].get("verdict_reason"))
