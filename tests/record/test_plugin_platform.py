"""The plugin imports only the worker module of the platform it runs on. Another platform's may
rebind torch's device API as it loads: vLLM 0.34's CPU worker puts placeholders in
`torch.cuda.Stream`, `stream` and `set_stream`, and a GPU `vllm serve` with tracekit's live
control on failed its start in Inductor's compile ("expected stream to be a torch.Stream")."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from tracekit.integrations.vllm.releases.installed import installed_release
from vllm.platforms import current_platform
if len(sys.argv) > 1:
    current_platform.device_type = sys.argv[1]  # as a process of that platform sees it
classes = installed_release().worker_classes_here()
print(json.dumps({"device": current_platform.device_type,
                  "classes": [f"{c.__module__}.{c.__name__}" for c in classes],
                  "imported": sorted(m for m in sys.modules if m in (
                      "vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker", "vllm_ascend.worker.worker"))}))
"""


def _probe(*device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", PROBE, *device], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_cpu_process_takes_the_cpu_worker_alone():
    seen = _probe()
    assert seen["device"] == "cpu"
    assert seen["classes"] == ["vllm.v1.worker.cpu_worker.CPUWorker"]


def test_a_gpu_process_does_not_import_the_cpu_worker():
    seen = _probe("cuda")
    assert seen["classes"] == ["vllm.v1.worker.gpu_worker.Worker"]
    assert seen["imported"] == ["vllm.v1.worker.gpu_worker"]  # the CPU worker's module never loaded
