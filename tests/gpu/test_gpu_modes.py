"""Did the step run the graph it was captured for, and do the other forms of its dispatch agree
(issue 19)? On vLLM 0.26 with FULL_AND_PIECEWISE graphs of sizes 1..64, a decode step (a FULL
graph of its padded size) and a mixed step (PIECEWISE graphs) are replayed, in one fresh
process per runner, as dispatched and in the other forms vLLM's own dispatch offers for the same
model call: its PIECEWISE graphs of the padded size, its compiled code with no graph, and eagerly.

V1 runs every form of both steps. V2 replays a FULL graph whole (no model call): its decode step
says the other forms cannot run, its mixed step runs them all.
"""

import json

import pytest
from gpu_support import GRAPHS, bundles_by_step, json_records, of_kind, record_steps, tracekit

FORMS = ("compiled", "vllm-piecewise", "compiled-no-graph", "eager")


@pytest.fixture(scope="module", params=["v1", "v2"])
def replayed(request, tmp_path_factory, prompts_file):
    runner = request.param
    folder = tmp_path_factory.mktemp(f"modes-{runner}")
    bundles = bundles_by_step(record_steps(folder, prompts_file, "0:12", 6, ["--dtype", "bfloat16", *GRAPHS], runner))
    chosen = {kind: next(iter(of_kind(bundles, kind).values())) for kind in ("pure_decode", "mixed")}
    out = folder / "modes.jsonl"
    finished = tracekit("replay", *chosen.values(), "--keep-going", "--mode", ",".join(FORMS), "--iters", 5,
                        "--samples", 3, "--json", out, runner=runner)
    records = json_records(out) if out.exists() else {}
    assert len(records) == 2, finished.explain()
    return runner, {kind: records[str(path)] for kind, path in chosen.items()}, finished


def test_each_step_ran_the_graph_it_was_captured_for(replayed):
    runner, records, finished = replayed
    expected = {"pure_decode": "FULL", "mixed": "PIECEWISE"}
    for kind, record in records.items():
        dispatch = record["dispatch"]
        assert dispatch["recorded"]["runtime_mode"] == expected[kind], (kind, dispatch["recorded"])
        assert not dispatch["differences"], (kind, dispatch["differences"])
        assert record["verdict"] == "bit_exact", (kind, record.get("verdict_reason"))
        assert record["modes"]["compiled"]["vs_recorded"]["bit_exact"], kind
    assert finished.returncode == 0, finished.explain()


def test_the_other_forms_of_the_dispatch_run_and_are_compared(replayed):
    runner, records, _ = replayed
    for kind, record in records.items():
        modes = record["modes"]
        whole_full_graph = runner == "v2" and kind == "pure_decode"
        for form in FORMS[1:]:
            if whole_full_graph:
                assert modes[form]["available"] is False and "FULL CUDA graph" in modes[form]["reason"], modes[form]
                continue
            assert modes[form]["available"], (kind, form, modes[form].get("reason"))
            assert modes[form]["vs_recorded"]["finite"], (kind, form)
        agreement = record["mode_agreement"]
        if whole_full_graph:
            assert agreement is None  # one form ran
            continue
        assert agreement is not None and agreement["nonfinite"] == [], agreement
        assert "compiled" in agreement["bit_exact_with_recording"], agreement
        if kind == "mixed":  # dispatched to those very PIECEWISE graphs
            assert "vllm-piecewise" in agreement["bit_exact_with_recording"], agreement
        # bf16 rounding may part the forms (other kernels without graphs, or eagerly), not more
        assert all(rms is not None and rms < 1e-2 for rms in agreement["parted"].values()), agreement
        print(f"\n{runner} {kind}: {json.dumps(agreement)}")
