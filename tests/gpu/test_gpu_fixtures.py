"""The bundles another team recorded on an H200 with vLLM 0.26 (`traces/h200-vllm026/`, from a
tracekit that stored async placeholders and no padding rows apart) get the verdict they deserve:
on a GPU with vLLM 0.26 each reproduces on its real rows; under vLLM 0.34, which has no Model
Runner V1, each (a V1 step) is a step that release cannot take; on any other machine (CI's CPU)
each is refused with exit 3 and the reason in one line, before an engine is built."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_support import DEFAULT_RUNNER, HAS_V1, INSTALLED_SERIES, checks_of, json_records, read_content, tracekit

# Two recordings of one float32 compiled engine (Inductor autotuning per process) part by up to
# 2.2e-5 relative RMS (H200, vLLM 0.26, 2026-12-03); the bound leaves room above that.
AUTOTUNED_FLOAT32_BOUND = 1e-4
FIXTURES = sorted((Path(__file__).resolve().parents[2] / "traces" / "h200-vllm026").glob("*.zst"))


def test_fixtures_are_there():
    assert len(FIXTURES) == 4, FIXTURES


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures") / "replays.jsonl"
    finished = tracekit("replay", *FIXTURES, "--keep-going", "--json", out, runner=DEFAULT_RUNNER)
    return finished, json_records(out) if out.exists() else {}


@pytest.mark.skipif(HAS_V1, reason="this vLLM has Model Runner V1: the fixtures replay (the test below)")
def test_under_a_release_without_v1_each_is_refused_in_one_line(replayed):
    """A replay across releases: vLLM 0.34 cannot take a V1 step, and says so before an engine."""
    finished, records = replayed
    assert finished.returncode == 3, finished.explain()
    for bundle in FIXTURES:
        record = records[str(bundle)]
        assert record["verdict"] == "cannot_run_here", record
        assert "recorded on Model Runner V1, which vLLM 0.34 removed" in record["error"], record
    assert "Traceback" not in finished.stderr
    print(f"vLLM {INSTALLED_SERIES}: {len(FIXTURES)} V1 fixtures refused in one line")


def _recorded_gpu() -> str:
    """The GPU model the fixtures were recorded on (an H200)."""
    return read_content(FIXTURES[0]).environment.device_name


@pytest.mark.v1_runner
def test_each_fixture_gets_the_verdict_it_deserves(replayed):
    """The three bf16 steps reproduce on their real rows (the two async ones once their
    placeholders are filled from the input ids the forward read). The float32 compiled step was
    recorded without Inductor's deterministic mode, whose kernel configs each process picks by
    timing them, and before bundles carried those choices: it parts by float32 rounding from layer
    0 on, as two recordings of such an engine part from each other (measured: relative RMS up to
    2.2e-5) — diverged, every discrete item equal, every float item within
    AUTOTUNED_FLOAT32_BOUND, and the report names the kernels autotuned without a recorded choice.

    On another GPU model than the recording's (an H100) the GPU is a numerics difference of the
    platform: a step whose rounding moved is `platform_difference` while its float items stay in
    the calibrated bounds, and `diverged` beyond them with the reason naming the GPU."""
    import torch
    from test_gpu_replay import small_float_divergence

    same_gpu = torch.cuda.get_device_name() == _recorded_gpu()
    finished, records = replayed
    verdicts = {bundle.name: records[str(bundle)]["verdict"] for bundle in FIXTURES}
    assert finished.returncode == (1 if "diverged" in verdicts.values() else 0), finished.explain()
    for bundle in FIXTURES:
        record = records[str(bundle)]
        checks = checks_of(record)
        if "fp32" in bundle.name:
            assert record["verdict"] in (("diverged",) if same_gpu else ("diverged", "platform_difference")), verdicts
            if record["verdict"] == "diverged" and not same_gpu:
                assert "device_name" in record["verdict_reason"], record["verdict_reason"]
            assert small_float_divergence(record, AUTOTUNED_FLOAT32_BOUND), bundle.name
            # recorded before bundles carried kernel choices: the kernels autotuned here are named
            assert any("no choice recorded: " in note for note in record["notes"]), record["notes"]
            assert checks["input_ids"]["bit_exact"] and checks["sampled_token_ids"]["bit_exact"]
            continue
        expected = ("bit_exact",) if same_gpu else ("bit_exact", "platform_difference")
        assert record["verdict"] in expected, (bundle.name, record["verdict"], record.get("verdict_reason"))
        if "decode" in bundle.name:  # 5 decodes ran a FULL graph of 8 rows
            assert checks["input_ids/padding"]["rows"] == [5, 8] and checks["input_ids/padding"]["decides"] is False
        assert not record["dispatch"]["differences"], (bundle.name, record["dispatch"])


@pytest.mark.cpu_side
@pytest.mark.parametrize("bundle", FIXTURES, ids=lambda path: path.name)
def test_on_a_machine_without_cuda_each_is_refused_with_the_reason(bundle, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the fixtures replay here (the test above)")
    out = tmp_path / "result.jsonl"
    finished = subprocess.run([sys.executable, "-m", "tracekit", "replay", str(bundle), "--json", str(out)],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 3, finished.stderr
    lines = [line for line in finished.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tracekit: error:"), finished.stderr
    assert "cuda device (NVIDIA H200)" in lines[0] and "replay it on a cuda machine" in lines[0], lines[0]
    assert "Traceback" not in finished.stdout + finished.stderr
    assert json.loads(out.read_text())["verdict"] == "cannot_run_here"
