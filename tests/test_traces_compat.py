"""The sample bundles under traces/ are compatibility fixtures: every later tracekit must still
read them, and, with the vLLM series that recorded them, replay them bit-exact.

The mixed-step sample names its model at a path of the machine that recorded it
(/home/recording-team/...), which exists nowhere else: its replay also proves that a bundle from
another machine finds tracekit's embedded model by the weights' fingerprint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.integrations.vllm.version import installed_vllm_version, series

TRACES = Path(__file__).resolve().parent.parent / "traces"
RECORDED_STEPS = [TRACES / "tiny-llama-mixed-step.zst"]


@pytest.mark.parametrize("bundle", RECORDED_STEPS, ids=lambda path: path.name)
def test_recorded_sample_reads_and_verifies(bundle):
    with open_bundle(bundle) as reader:
        assert reader.verify().ok
        content = BundleContent.from_plain(reader.metadata)
    step = content.steps[0]
    assert step.requests and step.outputs.sampled_token_ids is not None
    assert {r.is_prefill for r in step.requests} == {True, False}, "the sample is a mixed step"


@pytest.mark.slow
@pytest.mark.parametrize("bundle", RECORDED_STEPS, ids=lambda path: path.name)
def test_recorded_sample_replays_bit_exact_with_its_vllm_series(bundle):
    with open_bundle(bundle) as reader:
        recorded = BundleContent.from_plain(reader.metadata).engine.vllm_version
    replayed = subprocess.run(
        [str(Path(sys.executable).with_name("tracekit")), "replay", str(bundle)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )
    if series(installed_vllm_version() or "none") != series(recorded):
        assert replayed.returncode == 3, replayed.stderr
        assert "recorded with vLLM" in replayed.stderr
        return
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert "REPRODUCED (bit-exact)" in replayed.stdout
