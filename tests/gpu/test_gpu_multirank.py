"""Tensor parallel on GPUs, as far as a one-GPU machine can check it: a step recorded on CUDA
with more ranks than this machine has devices is refused with exit 3 and the real device count,
before any engine is built, and every multi-rank CUDA engine tracekit builds keeps NVLink
multicast off. Recording and replaying both ranks of a TP=2 step on GPUs needs the two-GPU
machine, which this project has not been lent: not written yet."""

import os
import sys
from pathlib import Path

import pytest
import torch
from gpu_support import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "format"))
from rank_set_forge import make_set  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "traces" / "h200-vllm026" / "v1-bf16-decode-fullgraph-sync.zst"


@pytest.mark.v1_runner  # the sample part is a V1 step of vLLM 0.26
def test_a_step_of_more_ranks_than_devices_is_refused_with_the_device_count(tmp_path):
    devices = torch.cuda.device_count()
    parts = make_set(tmp_path, tp=devices + 1, sample=FIXTURE)
    out = tmp_path / "result.json"
    finished = run([sys.executable, "-m", "tracekit", "replay", str(parts[0]), "--json", str(out)], runner="v1")
    assert finished.returncode == 3, finished.explain()
    assert (f"recorded with TP={devices + 1} ({devices + 1} ranks); this machine can build at most {devices} "
            f"rank(s) ({devices} cuda devices)") in finished.stderr, finished.stderr
    assert "Traceback" not in finished.stderr


def test_multi_rank_engines_keep_nvlink_multicast_off(monkeypatch):
    from tracekit.integrations.vllm.engines import ranks

    for name in ranks.NO_MULTICAST_ENV:
        monkeypatch.delenv(name, raising=False)
    ranks.keep_multicast_off(2)
    assert {name: os.environ[name] for name in ranks.NO_MULTICAST_ENV} == ranks.NO_MULTICAST_ENV
