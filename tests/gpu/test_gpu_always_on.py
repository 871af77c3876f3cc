"""Issue 20 on a GPU (vLLM 0.26; 0.34 on V2 alone): event triggers left on, a real CUDA error, and the costs.

The CPU suite's `always_on` engine script runs on the GPU as is (both runners): armed and quiet
it changes no token; a NaN read from the KV is caught at the step's end and replays bit-exact;
a `--kv recompute` bundle replays with the KV rebuilt by prefilling (on a GPU the prefill may
round otherwise than the decodes that first wrote it: the verdict says which, and always that
the KV was recomputed; on V1 under async scheduling, whose runner holds the sampled ids as
placeholders, the recorder fills them in from the outputs it read). A real device-side assert (V1 without async scheduling, where the error
surfaces in the step that caused it) leaves a recompute bundle kept from host memory alone.
"""

import json
import sys
from pathlib import Path

import pytest
from gpu_support import E2E, read_step, run, tracekit

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["v1", "v2"])
def always_on(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"always-on-{request.param}")
    finished = run([sys.executable, str(E2E / "engine_scripts" / "always_on.py"), str(work / "result.json"), str(work)],
                   runner=request.param)
    assert finished.returncode == 0, finished.explain()
    return json.loads((work / "result.json").read_text())


def test_quiet_engine_is_unchanged(always_on):
    assert always_on["quiet_outputs"] == always_on["unarmed"] and always_on["quiet_written"] == []


def test_kv_nan_is_caught_and_replays_bit_exact(always_on):
    assert always_on["kv_nan_failures"] == [] and len(always_on["kv_nan_written"]) == 1
    assert always_on["kv_nan_block_is_nan"]
    assert always_on["kv_nan_replay"]["verdict"] == "bit_exact", always_on["kv_nan_replay"]


def test_recompute_bundle_says_the_kv_was_recomputed(always_on):
    # On V1 under async scheduling (on by default) the runner holds every sampled id as -1: the
    # recorder kept them from the steps' outputs, so this bundle has the tokens to prefill too.
    result = always_on["recompute_replay"]
    assert "refused" not in result, result
    assert result["kv"] == "recomputed" and "KV recomputed, not restored" in result["verdict_reason"], result
    checks = {check["item"]: check for check in result["checks"]}
    assert checks["input_ids"]["bit_exact"] and checks["positions"]["bit_exact"]
    print("recompute verdict on this GPU:", result["verdict"], result["first_divergence"])


@pytest.mark.v1_runner
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_device_side_assert_leaves_a_recompute_bundle(scheduling, tmp_path):
    """A poisoned CUDA context aborts the process at the next free of a CUDA tensor (c10 throws in
    a destructor), which may come while vLLM unwinds the step, before the engine script reports:
    what counts is the bundle the recorder wrote synchronously before that (H200, 2026-12-04: the
    recorder saw the lost context, then the process aborted in such a free)."""
    finished = run([sys.executable, str(HERE / "engine_cuda_error.py"), str(tmp_path / "result.json"), str(tmp_path),
                    scheduling], runner="v1")
    # the kernel's own assertion, printed by the device (torch 2.11 raises it as an AcceleratorError
    # whose words reach only the result and the bundle, not the process's output)
    assert "index out of bounds" in finished.stderr, finished.explain()
    if (tmp_path / "result.json").exists():  # the script reached its report
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["failures"] == [] and len(result["written"]) == 1, result
        assert "device-side assert" in result["raised"], result
    written = sorted(tmp_path.glob("lost*.zst"))
    assert len(written) == 1, (written, finished.explain())
    path = written[0]
    step = read_step(path)
    assert step.kv.mode == "recompute" and step.trigger == "exception" and step.input_ids is None
    assert "device-side assert" in step.error["message"]
    out = tmp_path / "replay.json"
    replayed = tracekit("replay", path, "--no-timing", "--json", out, runner="v1")
    record = json.loads(out.read_text())
    # the assert was injected in the recording process only: the replayed step does not raise
    assert record["verdict"] == "error_not_reproduced", replayed.explain()
    assert record["kv"] == "recomputed" and "KV recomputed, not restored" in record["verdict_reason"]
