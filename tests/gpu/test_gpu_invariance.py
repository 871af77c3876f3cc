"""`tracekit invariance` on a GPU (issue 19): the built-in workload recorded on vLLM 0.26 (V1;
V2 under 0.34, which has no V1; bf16, CUDA graphs of sizes 1..64) with `VLLM_BATCH_INVARIANT` off and on, and a mixed and a
decode step of each checked in a fresh process (the invariance engine inherits the setting).

The steps: the first mixed step, and a decode step beside the workload's long (295-token)
context, the CPU suite's negative control (`e2e_support.long_context_decode`). On, vLLM promises
batch invariance: every variant of both must be bit-identical (exit 0). Off, the command runs the
same variants and says what moved; on the H200 (vLLM 0.26, 2026-12-04) the tiny model's default
kernels kept a mixed and a short-context decode step bit-identical in every variant too (fillers
to 9, 17 and 33 tokens, each alone, reordered), so whether Off breaks is reported, not asserted:
the negative control that must break is the CPU suite's (tests/e2e/test_invariance.py).
"""

import json

import pytest
from gpu_support import DEFAULT_RUNNER, GRAPHS, bundles_by_step, long_context_decode, of_kind, record_steps, tracekit

RUNNER = DEFAULT_RUNNER


@pytest.fixture(scope="module", params=["0", "1"], ids=["batch-invariant-off", "batch-invariant-on"])
def checked(request, tmp_path_factory, prompts_file):
    setting = request.param
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", setting)
    try:
        folder = tmp_path_factory.mktemp(f"invariance-{setting}")
        bundles = bundles_by_step(record_steps(folder, prompts_file, "0:40", 10, ["--dtype", "bfloat16", *GRAPHS], RUNNER))
        chosen = {"mixed": next(iter(of_kind(bundles, "mixed").values())), "long_decode": long_context_decode(bundles)[0]}
        reports = {}
        for kind, path in chosen.items():
            out = folder / f"{kind}.json"
            finished = tracekit("invariance", path, "--json", out, runner=RUNNER)
            assert out.exists(), finished.explain()
            reports[kind] = (finished, json.loads(out.read_text()))
        return setting, reports
    finally:
        monkeypatch.undo()


def test_invariance_is_reported_per_vllm_batch_invariant_setting(checked):
    setting, reports = checked
    for kind, (finished, report) in reports.items():
        assert report["verdict"] in ("invariant", "not_invariant"), (kind, finished.explain())
        assert report["exit_code"] == finished.returncode == (0 if report["invariant"] else 1), finished.explain()
        ran = [variant for variant in report["variants"] if variant["applicable"]]
        assert any(variant["name"].startswith("alone:") for variant in ran), kind
        assert report["thresholds"]["capture_sizes"], "the graphs' capture sizes were not read"
        print(f"VLLM_BATCH_INVARIANT={setting} {kind}: {report['verdict']}, first broken "
              f"{report['first_broken_variant']}, fillers {report['thresholds']['filler_targets']}")
    if setting == "1":
        for kind, (_, report) in reports.items():
            assert report["invariant"], (kind, report["first_broken_variant"],
                                         [v["moved"] for v in report["variants"] if v["moved"]])
    else:
        for kind, (_, report) in reports.items():
            if not report["invariant"]:  # a break is named: the variant, the requests, by how much
                assert report["first_broken_variant"], kind
                assert any(variant["moved"] for variant in report["variants"]), kind
