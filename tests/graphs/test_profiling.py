"""`--profile`: the timed forward of a mode, traced with the torch profiler after the timed runs,
into a Chrome trace file (Perfetto). On CPU the trace holds the operators; on CUDA the kernels
too, and for the graph mode the graph replays. The CUDA half skips where there is no device."""

import json

import pytest
import torch
from toy_transformer import ToyTransformer

from tracekit.graphs.device import get_device_backend
from tracekit.graphs.modes import measure_mode
from tracekit.graphs.profiling import trace_path

ITERS = 3


def traced_runs(path):
    events = json.loads(path.read_text())["traceEvents"]
    # (on CUDA each range also appears on the GPU timeline, as "gpu_user_annotation")
    runs = sum(event.get("cat") == "user_annotation" and event["name"].startswith("tracekit forward") for event in events)
    return runs, {event.get("cat") for event in events}


def measure_traced(mode, device, tmp_path):
    torch.manual_seed(0)
    model = ToyTransformer(hidden=64, heads=2, layers=2, slots=16).to(device)
    ids, positions = torch.randint(0, 512, (8,), device=device), torch.arange(8, device=device)
    with torch.no_grad():
        expected = model(ids, positions)
        return measure_mode(mode, lambda: model(ids, positions), model.kv_caches(), expected,
                            get_device_backend(device), ITERS, 2, warmup_s=0, trace_to=trace_path(tmp_path / "step", mode))


def test_cpu_eager_trace_holds_one_range_per_run_and_the_operators(tmp_path):
    report = measure_traced("eager", "cpu", tmp_path)
    assert report["profile_trace"] == str(tmp_path / "step.eager.trace.json")
    runs, categories = traced_runs(tmp_path / "step.eager.trace.json")
    assert runs == ITERS and "cpu_op" in categories
    assert report["latency_us"]["count"] == ITERS * 2  # the traced runs are not among the timed ones
    assert [p.name for p in tmp_path.iterdir()] == ["step.eager.trace.json"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_cuda_trace_holds_the_kernels(tmp_path, mode):
    report = measure_traced(mode, "cuda", tmp_path)
    runs, categories = traced_runs(tmp_path / f"step.{mode}.trace.json")
    assert report["profile_trace"].endswith(f"step.{mode}.trace.json")
    assert runs == ITERS and "kernel" in categories
