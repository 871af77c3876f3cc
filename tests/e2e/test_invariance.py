"""Issue 19 on real engines (V1 and V2, eager, the default configuration): `tracekit invariance` finds
a recorded step that is not batch-invariant and says which variant and layer break it, passes
steps that are, and compares a prefix-cache hit with its prefix recomputed.

The negative control: a decode step beside a request with a long context (the built-in
workload's 295-token prompt). vLLM's CPU attention splits a request's KV across threads when the
batch leaves threads idle (`VLLM_CPU_ATTN_SPLIT_KV`, on by default), so that request alone sums
its attention in another order: its logits move in the last bits, from the first attention.
On the compiled engine the same request moves alone too. The positive controls: a mixed step of the same workload (every request alone and reordered is
bit-identical), the same decode step with the split off, and a prefix-cache hit whose recomputed
prefix gives bit-identical logits.
"""

import json

import pytest
from e2e_support import (
    engine_script,
    long_context_decode,
    of_kind,
    only_on_runner,
    past_the_vocabulary,
    read_step,
    tracekit,
)

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def reports(tmp_path_factory, builtin_bundles, runner_kind):
    work = tmp_path_factory.mktemp(f"invariance-{runner_kind}")
    negative, long_request = long_context_decode(builtin_bundles)
    mixed = next(iter(of_kind(builtin_bundles, "mixed").values()))
    result = engine_script("invariance_many", work / "invariance.json", work, negative, mixed, runner=runner_kind)
    for bundle, report in result["reports"].items():
        assert "error" not in report, f"{bundle}: {report['error']}"
    return {"negative": result["reports"][str(negative)], "mixed": result["reports"][str(mixed)],
            "hit": result["reports"][result["prefix_hit"]], "negative_path": negative, "long_request": long_request,
            "work": work}


def variants(report):
    return {variant["name"]: variant for variant in report["variants"]}


def test_a_long_context_decode_alone_is_reported_not_invariant_from_its_first_attention(reports):
    report, long_request = reports["negative"], reports["long_request"]
    assert report["verdict"] == "not_invariant" and report["exit_code"] == 1
    assert report["baseline_reproduces_recording"] is True
    ran = variants(report)
    assert ran["repeat"]["invariant"]  # the engine is deterministic run to run
    assert report["first_broken_variant"] == f"alone:{long_request}"
    moved = ran[f"alone:{long_request}"]["moved"]
    assert list(moved) == [long_request]
    logits = moved[long_request]["logits"]
    assert 0 < logits["max_abs"] < 1e-3 and 0 < logits["relative_rms"] < 1e-5 and logits["argmax_agreement"] == 1.0
    assert "sampled" not in moved[long_request]  # greedy: same id, compared
    for name, variant in ran.items():  # the short requests never move
        assert set(variant["moved"]) <= {long_request}, name
    assert report["first_layer"]["module"] == "model.layers.0.self_attn"
    assert report["first_layer"]["request"] == long_request
    # fillers up to the engine's 64-token steps (no capture size or 256 boundary is reachable)
    assert report["thresholds"]["filler_targets"] == [64] and report["thresholds"]["unreachable"] == [256]
    assert ran["fillers:64"]["num_tokens"] == 64 and ran["fillers:64"]["applicable"]
    assert not ran["recomputed"]["applicable"]
    sampling = report["sampling"]
    assert sampling[long_request] == "greedy"
    # V1 draws an unseeded request's sample from a generator the batch shares; V2 keeps a seed per request
    unseeded = "not compared: unseeded" if report["runner"] == "v1" else "random with its recorded per-request seed"
    assert any(how.startswith(unseeded) for how in sampling.values())


def test_a_mixed_step_stays_bit_identical_alone_and_reordered(reports):
    report = reports["mixed"]
    assert report["verdict"] == "invariant" and report["exit_code"] == 0
    ran = variants(report)
    step = read_step(report["bundle"])
    assert {f"alone:{req_id}" for req_id in step.batch_order} <= set(ran)
    reversed_order = ran["order:reversed"]
    if report["runner"] == "v1":  # V1 runs the order it is given
        assert reversed_order["batch_order"] == step.batch_order[::-1] and not reversed_order["reordered_by_runner"]
    else:  # V2 runs decodes before prefills, whatever order they came in: the report says so
        prefills = [r.req_id for r in step.requests if r.is_prefill]
        assert reversed_order["reordered_by_runner"] and reversed_order["batch_order"][-len(prefills):] == prefills
    assert all(variant["applicable"] and not variant["moved"] and variant["compared"]
               for name, variant in ran.items() if name.startswith(("alone:", "order:", "repeat")))
    assert report["first_broken_variant"] is None and report["first_layer"] is None


def test_a_prefix_cache_hit_recomputed_gives_the_same_logits(reports):
    report = reports["hit"]
    ran = variants(report)
    (name,) = [name for name in ran if name.startswith("recomputed:")]
    request = name.removeprefix("recomputed:")
    assert ran[name]["applicable"] and ran[name]["compared"] == [request]
    step = read_step(report["bundle"])
    cached = step.request(request).num_computed_tokens
    assert cached == 32 and ran[name]["num_tokens"] == cached + step.request(request).num_scheduled_tokens
    assert report["verdict"] == "invariant", report


@only_on_runner("v1")
def test_the_command_passes_the_same_step_with_the_cpu_attention_split_off(reports, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
    out = reports["work"] / "split-off.json"
    finished = tracekit("invariance", reports["negative_path"], "--json", out)
    assert finished.returncode == 0, finished.explain()
    report = json.loads(out.read_text())
    assert report["verdict"] == "invariant" and report["exit_code"] == 0
    ran = variants(report)
    assert ran[f"alone:{reports['long_request']}"]["applicable"] and ran["fillers:64"]["applicable"]
    # the recording ran with the split on: the replay here differs from it, and says so
    assert report["baseline_reproduces_recording"] is False and report["notes"]
    assert "verdict invariant" in finished.stdout and "alone:" in finished.stdout


@only_on_runner("v1")
def test_the_compiled_engine_reports_the_same_request_moving_alone_and_why_it_names_no_layer(compiled_bundles,
                                                                                           tmp_path):
    bundle, long_request = long_context_decode(compiled_bundles)
    out = tmp_path / "compiled.json"
    finished = tracekit("invariance", bundle, "--variants", "repeat,alone", "--json", out)
    assert finished.returncode == 1, finished.explain()
    report = json.loads(out.read_text())
    assert report["engine_mode"] == "compiled" and report["first_broken_variant"] == f"alone:{long_request}"
    assert [variant["kind"] for variant in report["variants"]] == ["repeat"] + ["alone"] * len(report["sampling"])
    assert list(variants(report)[f"alone:{long_request}"]["moved"]) == [long_request]
    assert report["first_layer"]["module"] is None and "--enforce-eager" in report["first_layer"]["reason"]
    assert report["thresholds"]["compile_range_ends"] == [64]  # vLLM's compile range ends at the 64-token budget
    assert f"first broken variant alone:{long_request}" in finished.stdout


@only_on_runner("v1")
def test_a_replay_that_fails_inside_vllm_ends_as_crashed_with_exit_4(builtin_bundles, tmp_path):
    mixed = next(iter(of_kind(builtin_bundles, "mixed").values()))
    poisoned = rewrite_bundle(mixed, tmp_path / "poisoned.zst", past_the_vocabulary)  # IndexError in the embedding
    out = tmp_path / "report.json"
    finished = tracekit("invariance", poisoned, "--json", out)
    assert finished.returncode == 4, finished.explain()
    assert "Traceback" not in finished.stderr and "REPLAY FAILED" in finished.stdout
    record = json.loads(out.read_text())
    assert (record["verdict"], record["exit_code"]) == ("crashed", 4) and "IndexError" in record["error"]
